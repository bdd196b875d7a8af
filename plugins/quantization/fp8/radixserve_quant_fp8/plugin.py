"""Entry-point module of radixserve-quant-fp8: declares its component; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "quantization",
        "fp8",
        "radixserve_quant_fp8.method:FP8Method",
        devices=("cuda", "cpu"),
        dtypes=("float16", "bfloat16", "float32"),
        description="FP8 e4m3 W8A8: HF fp8 checkpoints (per-tensor or 128x128 block scales) and online "
                    "quantization; torch._scaled_mm on CUDA, dequantize on CPU",
    )
