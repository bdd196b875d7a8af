"""Entry-point module of radixserve-grammar-llguidance: declares its component; cheap to import."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.1,<2"


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "grammar",
        "llguidance",
        "radixserve_grammar_llguidance.backend:LLGuidanceBackend",
        priority=5,
        capabilities=("json_schema", "regex", "ebnf"),
        description="llguidance: JSON schema, regex and GBNF (converted to Lark) constraints",
    )
