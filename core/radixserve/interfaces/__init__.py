"""The contracts of the plugin kinds. A plugin component subclasses one of these.

Each docstring is the contract: what the core guarantees when it calls, and what the component
must guarantee in return. Breaking one of them is a plugin-API major version bump."""

from radixserve.interfaces.attention import AttentionBackend, AttentionLayerSpec, AttentionRunnerInfo
from radixserve.interfaces.drafter import Drafter, DrafterInfo, DraftProposal
from radixserve.interfaces.grammar import GRAMMAR_KINDS, GrammarBackend, GrammarError, GrammarMatcher
from radixserve.interfaces.latent_attention import LatentAttentionDims, LatentAttentionLayerSpec
from radixserve.interfaces.model import Model
from radixserve.interfaces.policy import SchedulePolicy
from radixserve.interfaces.prefix_cache import MatchResult, PrefixCache
from radixserve.interfaces.quantization import QuantMethod, WeightSource
from radixserve.interfaces.reasoning_parser import ReasoningParser
from radixserve.interfaces.tool_parser import ParsedToolCall, ToolParse, ToolParser
from radixserve.plugins.kinds import KINDS  # torch-free home: discovery checks kinds without torch

BASE_CLASS_OF_KIND = {
    "attention": AttentionBackend,
    "model": Model,
    "quantization": QuantMethod,
    "policy": SchedulePolicy,
    "prefix_cache": PrefixCache,
    "drafter": Drafter,
    "grammar": GrammarBackend,
    "tool_parser": ToolParser,  # HTTP-layer components: chosen by server.*, not by the stack
    "reasoning_parser": ReasoningParser,
}

__all__ = [
    "KINDS",
    "BASE_CLASS_OF_KIND",
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
