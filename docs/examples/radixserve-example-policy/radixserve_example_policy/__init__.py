"""Example RadixServe plugin (see docs/plugin-authoring.md)."""
