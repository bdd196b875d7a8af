"""Entry-point module of radixserve-models-mixtral: declares its components; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.4,<2"  # 1.4: DecoderOnlyCausalLM (the MoE layers came in 1.3)


@hookimpl
def radixserve_register(registry) -> None:
    registry.register("model", "MixtralForCausalLM", "radixserve_models_mixtral.model:MixtralForCausalLM",
                      description="Mixtral mixture-of-experts decoder")
