"""RadixServe plugin: FlashInfer attention (FlashInfer is imported only when the backend is built)."""
