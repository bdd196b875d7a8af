"""Entry-point module of radixserve-models-transformers: declares its one component; cheap to import
(no torch, no transformers)."""

from radixserve.plugins import hookimpl
from radixserve.plugins.model_select import FALLBACK_MODEL

PLUGIN_API = ">=1.3,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "model",
        FALLBACK_MODEL,
        "radixserve_models_transformers.model:TransformersForCausalLM",
        capabilities=("fallback",),
        description="any AutoModelForCausalLM architecture, through transformers' attention interface "
        "(the fallback when no native plugin claims an architecture; model.impl: transformers forces it)",
    )
