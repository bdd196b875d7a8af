"""Entry-point module of radixserve-cache-chunk: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "prefix_cache",
        "chunk",
        "radixserve_cache_chunk.chunk_cache:ChunkCache",
        description="no prefix sharing; finished requests' KV is freed at once",
    )
