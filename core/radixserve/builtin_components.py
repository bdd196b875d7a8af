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
