"""Entry-point module of radixserve-models-phi3: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.4,<2"  # 1.4: DecoderOnlyCausalLM (windows came in 1.3)


@hookimpl
def radixserve_register(registry) -> None:
    registry.register("model", "Phi3ForCausalLM", "radixserve_models_phi3.model:Phi3ForCausalLM",
                      description="Phi-3 decoder (fused qkv and gate_up, LongRoPE)")
