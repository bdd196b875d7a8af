"""radixserve-models-transformers: the transformers fallback model (docs/transformers-fallback.md)."""
