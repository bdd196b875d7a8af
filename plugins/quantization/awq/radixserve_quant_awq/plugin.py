"""Entry-point module of radixserve-quant-awq: declares its component; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "quantization",
        "awq",
        "radixserve_quant_awq.method:AWQMethod",
        devices=("cuda", "cpu"),
        dtypes=("float16", "bfloat16", "float32"),
        description="AWQ int4 (GEMM layout, group 32/64/128): Triton dequantize-in-GEMM on CUDA, dequantize on CPU",
    )
