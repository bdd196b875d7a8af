"""Entry-point module of radixserve-grammar-xgrammar: declares its component; cheap to import."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.17,<2"  # resolve_json_pointer


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "grammar",
        "xgrammar",
        "radixserve_grammar_xgrammar.backend:XGrammarBackend",
        priority=10,
        capabilities=("json_schema", "regex", "ebnf"),
        description="xgrammar 0.1.34: JSON schema, regex and EBNF constraints (the default)",
    )
