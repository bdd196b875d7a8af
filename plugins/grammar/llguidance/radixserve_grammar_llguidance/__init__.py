"""RadixServe plugin: grammar backend built on llguidance."""
