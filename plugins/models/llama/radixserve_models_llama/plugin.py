"""Entry-point module of radixserve-models-llama: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.4,<2"  # 1.4: DecoderOnlyCausalLM

_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@hookimpl
def radixserve_register(registry) -> None:
    for arch in _ARCHS:
        registry.register("model", arch, f"radixserve_models_llama.model:{arch}", description="Llama-family decoder")
