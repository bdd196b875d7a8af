"""Entry-point module: declares the plugin API range and the components. Keep it cheap to import."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "policy",
        "shortest-first",
        "radixserve_example_policy.policy:ShortestPromptFirst",
        description="admit the shortest prompts first (example plugin)",
    )
