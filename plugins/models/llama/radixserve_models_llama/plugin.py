"""Entry-point module of radixserve-models-llama: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    pass  # components are registered here as they are built
