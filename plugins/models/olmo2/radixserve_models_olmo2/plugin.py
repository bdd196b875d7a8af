"""Entry-point module of radixserve-models-olmo2: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.4,<2"  # 1.4: DecoderOnlyCausalLM


@hookimpl
def radixserve_register(registry) -> None:
    registry.register("model", "Olmo2ForCausalLM", "radixserve_models_olmo2.model:Olmo2ForCausalLM",
                      description="OLMo 2 decoder (post-norms, q/k RMSNorm over the whole projection)")
