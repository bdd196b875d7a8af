"""RadixServe plugin: grammar backend built on xgrammar."""
