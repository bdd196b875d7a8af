"""Conformance kits: run a plugin component against its kind's contract from any pytest suite.

    from radixserve.testing import check_attention_backend
    def test_my_backend_conforms():
        check_attention_backend(MyBackend)

Each `check_*` function raises AssertionError naming the first violation (the case, the step,
what was expected). Default sizes are small so a kit runs in about a second on a CPU (the model
kit in a few seconds). See docs/contracts.md ("Conformance kits")."""

from radixserve.testing.attention import ReferenceAttentionBackend, check_attention_backend
from radixserve.testing.drafter import check_drafter, drafter_info
from radixserve.testing.drafter_on_model import check_drafter_on_model
from radixserve.testing.end_to_end import run_to_completion
from radixserve.testing.grammar import check_grammar_backend, tiny_tokenizer
from radixserve.testing.latent_attention import ReferenceLatentAttentionBackend, check_latent_attention_backend
from radixserve.testing.model import check_model_parity, tiny_checkpoint
from radixserve.testing.output_parsers import (
    ReasoningSample,
    ToolSample,
    check_reasoning_parser,
    check_tool_parser,
)
from radixserve.testing.policy import check_schedule_policy
from radixserve.testing.prefix_cache import check_prefix_cache
from radixserve.testing.quantization import check_quant_method, check_quant_method_moe
from radixserve.testing.toy_runner import (
    ToyRunner,
    toy_next_token,
    toy_prompt_logprobs,
    toy_prompt_ranks,
    toy_reference,
)
from radixserve.testing.weight_source import check_weight_source

__all__ = [
    "ReasoningSample",
    "ReferenceAttentionBackend",
    "ReferenceLatentAttentionBackend",
    "ToolSample",
    "ToyRunner",
    "check_attention_backend",
    "check_drafter",
    "check_drafter_on_model",
    "check_grammar_backend",
    "check_latent_attention_backend",
    "check_model_parity",
    "check_prefix_cache",
    "check_quant_method",
    "check_quant_method_moe",
    "check_reasoning_parser",
    "check_schedule_policy",
    "drafter_info",
    "run_to_completion",
    "check_tool_parser",
    "check_weight_source",
    "tiny_checkpoint",
    "tiny_tokenizer",
    "toy_next_token",
    "toy_prompt_logprobs",
    "toy_prompt_ranks",
    "toy_reference",
]
