"""Entry-point module: declares the policies; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register("policy", "fcfs", "radixserve_policies.fcfs:FCFSPolicy", description="first come, first served")
