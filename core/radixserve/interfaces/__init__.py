"""The contracts of the seven plugin kinds. A plugin component subclasses one of these.

Each docstring is the contract: what the core guarantees when it calls, and what the component
must guarantee in return. Breaking one of them is a plugin-API major version bump."""

from radixserve.interfaces.attention import AttentionBackend, AttentionLayerSpec, AttentionRunnerInfo
from radixserve.interfaces.drafter import Drafter, DraftProposal
from radixserve.interfaces.grammar import GRAMMAR_KINDS, GrammarBackend, GrammarError, GrammarMatcher
from radixserve.interfaces.model import Model
from radixserve.interfaces.policy import SchedulePolicy
from radixserve.interfaces.prefix_cache import MatchResult, PrefixCache
from radixserve.interfaces.quantization import QuantMethod, WeightSource

KINDS = ("attention", "model", "quantization", "policy", "prefix_cache", "drafter", "grammar")

BASE_CLASS_OF_KIND = {
    "attention": AttentionBackend,
    "model": Model,
    "quantization": QuantMethod,
    "policy": SchedulePolicy,
    "prefix_cache": PrefixCache,
    "drafter": Drafter,
    "grammar": GrammarBackend,
}

__all__ = [
    "KINDS",
    "BASE_CLASS_OF_KIND",
    "AttentionBackend",
    "AttentionLayerSpec",
    "AttentionRunnerInfo",
    "Drafter",
    "DraftProposal",
    "GRAMMAR_KINDS",
    "GrammarBackend",
    "GrammarError",
    "GrammarMatcher",
    "MatchResult",
    "Model",
    "PrefixCache",
    "QuantMethod",
    "SchedulePolicy",
    "WeightSource",
]
