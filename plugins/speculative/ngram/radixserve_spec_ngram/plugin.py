"""Entry-point module of radixserve-spec-ngram: declares its component; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1.1,<2"  # tree drafts (DraftProposal.parents) are plugin API 1.1


@hookimpl
def radixserve_register(registry) -> None:
    registry.register(
        "drafter",
        "ngram",
        "radixserve_spec_ngram.drafter:NgramDrafter",
        devices=("cpu", "cuda"),
        capabilities=("chain", "tree"),
        description="drafts from a token trie of every request's prompt and output (no draft model); "
        "chains, or trees of the most frequent continuations",
    )
