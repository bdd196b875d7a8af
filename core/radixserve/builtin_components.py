"""Components that ship with the core itself, registered through the same hook as any plugin."""

from radixserve.plugins.hookspec import hookimpl

PLUGIN_API = ">=1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "quantization",
        "unquantized",
        "radixserve.layers.quant_unquantized:UnquantizedMethod",
        description="plain floating-point weights (the default)",
    )
    registry.register(
        "drafter",
        "oracle",
        "radixserve.scheduler.speculative.oracle:OracleDrafter",
        description="benchmark drafter: proposes stored greedy continuations (known acceptance)",
    )
