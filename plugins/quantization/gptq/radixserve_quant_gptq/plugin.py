"""Entry-point module of radixserve-quant-gptq: declares its component; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "quantization",
        "gptq",
        "radixserve_quant_gptq.method:GPTQMethod",
        devices=("cuda", "cpu"),
        dtypes=("float16", "bfloat16", "float32"),
        description="GPTQ int4 (sym/asym, act-order, group 32/64/128): Triton dequantize-in-GEMM on CUDA, dequantize on CPU",
    )
