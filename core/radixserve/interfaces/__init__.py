"""The contracts of the plugin kinds. A plugin component subclasses one of these.

Each docstring is the contract: what the core guarantees when it calls, and what the component
must guarantee in return. Breaking one of them is a plugin-API major version bump.

`Model` (a torch module) is imported on first use only, so that importing the other contracts (a
policy, a tool parser: what the HTTP front end checks) does not import torch."""

import importlib

from radixserve.interfaces.attention import AttentionBackend, AttentionLayerSpec, AttentionRunnerInfo
from radixserve.interfaces.drafter import Drafter, DrafterInfo, DraftProposal
from radixserve.interfaces.grammar import GRAMMAR_KINDS, GrammarBackend, GrammarError, GrammarMatcher
from radixserve.interfaces.latent_attention import LatentAttentionDims, LatentAttentionLayerSpec
from radixserve.interfaces.policy import SchedulePolicy
from radixserve.interfaces.prefix_cache import MatchResult, PrefixCache
from radixserve.interfaces.quantization import QuantMethod, WeightSource
from radixserve.interfaces.reasoning_parser import ReasoningParser
from radixserve.interfaces.tool_parser import ParsedToolCall, ToolParse, ToolParser
from radixserve.plugins.kinds import KINDS  # torch-free home: discovery checks kinds without torch

# kind -> (module, class) of its base class
_BASE_CLASS_OF_KIND = {
    "attention": ("radixserve.interfaces.attention", "AttentionBackend"),
    "model": ("radixserve.interfaces.model", "Model"),
    "quantization": ("radixserve.interfaces.quantization", "QuantMethod"),
    "policy": ("radixserve.interfaces.policy", "SchedulePolicy"),
    "prefix_cache": ("radixserve.interfaces.prefix_cache", "PrefixCache"),
    "drafter": ("radixserve.interfaces.drafter", "Drafter"),
    "grammar": ("radixserve.interfaces.grammar", "GrammarBackend"),
    "tool_parser": ("radixserve.interfaces.tool_parser", "ToolParser"),  # HTTP-layer components: chosen by server.*
    "reasoning_parser": ("radixserve.interfaces.reasoning_parser", "ReasoningParser"),
}


def base_class_of_kind(kind: str) -> type:
    """The contract class a component of `kind` subclasses (imports only that contract's module)."""
    module, name = _BASE_CLASS_OF_KIND[kind]
    return getattr(importlib.import_module(module), name)


def __getattr__(name: str):
    if name == "Model":
        from radixserve.interfaces.model import Model

        return Model
    if name == "BASE_CLASS_OF_KIND":
        return {kind: base_class_of_kind(kind) for kind in _BASE_CLASS_OF_KIND}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "KINDS",
    "BASE_CLASS_OF_KIND",
    "base_class_of_kind",
    "AttentionBackend",
    "AttentionLayerSpec",
    "AttentionRunnerInfo",
    "Drafter",
    "DrafterInfo",
    "DraftProposal",
    "GRAMMAR_KINDS",
    "GrammarBackend",
    "GrammarError",
    "GrammarMatcher",
    "LatentAttentionDims",
    "LatentAttentionLayerSpec",
    "MatchResult",
    "Model",
    "ParsedToolCall",
    "PrefixCache",
    "QuantMethod",
    "ReasoningParser",
    "SchedulePolicy",
    "ToolParse",
    "ToolParser",
    "WeightSource",
]
