"""Entry-point module of radixserve-models-qwen_moe: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.4,<2"  # 1.4: DecoderOnlyCausalLM (the MoE layers came in 1.3)

_ARCHS = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@hookimpl
def radixserve_register(registry) -> None:
    for arch in _ARCHS:
        registry.register("model", arch, f"radixserve_models_qwen_moe.model:{arch}",
                          description="Qwen mixture-of-experts decoder")
