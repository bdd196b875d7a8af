"""RadixServe model plugin: OLMo 2."""
