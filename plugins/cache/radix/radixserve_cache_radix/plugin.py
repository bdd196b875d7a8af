"""Entry-point module of radixserve-cache-radix: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "prefix_cache",
        "radix",
        "radixserve_cache_radix.radix_cache:RadixCache",
        priority=10,
        capabilities=("sharing", "lru_eviction"),
        description="token-level radix tree over KV slots, shared prefixes, LRU eviction",
    )
