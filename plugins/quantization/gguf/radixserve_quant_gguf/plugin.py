"""Entry-point module of radixserve-quant-gguf: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "quantization",
        "gguf",
        "radixserve_quant_gguf.method:GGUFMethod",
        weight_file_suffixes=(".gguf",),
        description="GGUF files (llama.cpp): dequantized at load; dequantize: auto keeps Q4_0/Q4_1/Q8_0 blocks on "
        "the CPU (integer kernels over int16 or int8 activations)",
    )
