"""Entry-point module of radixserve-models-deepseek: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.4,<2"  # 1.4: latent attention (Model.attention_type = "latent", RadixLatentAttention)

_ARCHS = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2 / V2-Lite: latent attention (MLA), softmax-routed experts",
    "DeepseekV3ForCausalLM": "DeepSeek-V3: latent attention (MLA), sigmoid-routed experts with a score-correction bias",
}


@hookimpl
def radixserve_register(registry) -> None:
    for arch, description in _ARCHS.items():
        registry.register("model", arch, f"radixserve_models_deepseek.model:{arch}", description=description)
