"""Entry-point module of radixserve-models-gemma: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.4,<2"  # 1.4: DecoderOnlyCausalLM (windows and soft-capping came in 1.3)

_ARCHS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


@hookimpl
def radixserve_register(registry) -> None:
    for arch in _ARCHS:
        registry.register("model", arch, f"radixserve_models_gemma.model:{arch}",
                          description="Gemma 2 / Gemma 3 text decoder (soft-capping, alternating sliding windows)")
