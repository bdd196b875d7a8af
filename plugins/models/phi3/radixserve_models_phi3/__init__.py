"""RadixServe model plugin: Phi-3."""
