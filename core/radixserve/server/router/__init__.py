"""Data parallelism: N full engine replicas behind a cache-aware HTTP router (docs/parallelism.md)."""
