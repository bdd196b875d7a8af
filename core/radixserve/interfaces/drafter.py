"""Drafter: proposes draft tokens that the target model verifies (speculative decoding)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from radixserve.interfaces.target_states import TargetStates
    from radixserve.state import Req


@dataclass
class DraftProposal:
    """Drafts for a batch of requests, one entry per request, in the order they were given.

    `tokens[i]` are request i's draft tokens (may be empty: no draft). `parents` is None for
    chains (token j continues token j-1, token 0 continues the request's last verified token).
    For a tree, `parents[i][j]` is the index in `tokens[i]` of draft token j's parent, or -1
    when its parent is the request's last verified token; parents come before their children
    (`parents[i][j] < j`). Added in plugin API 1.0 (`parents` in 1.1)."""

    tokens: list[list[int]]
    parents: list[list[int]] | None = None


@dataclass(frozen=True)
class DrafterInfo:
    """What a drafter receives at construction: `Drafter(info, **speculative.options)`.

    Built by the core from the `speculative` config section and the loaded target model.
    Added in plugin API 1.1."""

    device: torch.device  # the target model's device (where a draft model would live)
    vocab_size: int  # the target's vocabulary: every draft token must be in [0, vocab_size)
    num_draft_tokens: int  # speculative.num_draft_tokens: most draft tokens per request per step
    topk: int  # speculative.topk: branching factor of tree drafts (1: chains)
    num_steps: int  # speculative.num_steps: draft depth for drafters that step a model (default num_draft_tokens)
    supports_tree: bool  # the attention backend verifies trees; False: propose chains only
    model_path: str | None = None  # the target checkpoint (for its tokenizer or config)
    draft_model_path: str | None = None  # speculative.draft_model_path (None when not set)
    eos_token_ids: frozenset[int] = frozenset()
    hf_config: Any = None  # the target's Hugging Face config object (None in toy setups)
    extra: dict[str, Any] = field(default_factory=dict)  # reserved for later capabilities
    # the target's hidden states, embedding and LM head (radixserve.interfaces.target_states);
    # None when the runner offers none (toy runners). Added in plugin API 1.1.
    target_states: TargetStates | None = None


class Drafter(abc.ABC):
    """Proposes draft tokens for running requests. Kind "drafter", selected by the config key
    `stack.speculative`; the `speculative` config section sets its limits.

    Construction: `DrafterCls(info: DrafterInfo, **options)`, once per scheduler process, where
    `options` is the `speculative.options` mapping of the config. Unknown options must raise
    TypeError (a plain keyword signature does that); the core checks them against the signature
    at start-up like `stack.policy_options`, so a typo is a start-up error naming the option.
    A drafter that cannot run with `info` (e.g. no draft model at `info.draft_model_path`)
    raises ValueError with a message naming the config key; that is a start-up error too.

    What a drafter may read from a `Req` (everything else is core-private and may change):
    `rid` (stable id, unique among live requests), `origin_input_ids` (the prompt),
    `output_ids` (verified output tokens only -- drafts never appear there), `all_ids()`
    (prompt + output), `sampling_params` (read-only), `eos_token_ids`. A drafter never writes
    to a `Req`; it keeps its own per-request state keyed by `rid`.

    Calls, all from the scheduler thread, never concurrently:
    - `propose(reqs, num_draft_tokens)` once per verify step with the requests that decode in
      that step (prompt fully prefilled, at least one output token). Returns a `DraftProposal`
      with exactly one entry per request, in order. Each entry has at most `num_draft_tokens`
      tokens (for a tree: nodes, not counting the root). `num_draft_tokens` may be smaller than
      `info.num_draft_tokens` (near a request's max_new_tokens or context end, or when the
      scheduler shortens drafts because acceptance is low); 0 is never passed.
      Trees only when `info.supports_tree`; otherwise the core keeps, of a tree, the chain that
      follows the first child at each level. Tokens outside `[0, vocab_size)` end the draft
      there, entries beyond the limit are cut. A `propose` that raises is logged and the step
      runs without drafts.
    - `on_accepted(req, accepted)` after every step that appended tokens to a request's output
      (a verify step, but also the first token from the prompt's prefill and plain decode steps
      when speculation is skipped for a batch), with exactly those tokens, oldest first: the
      accepted drafts followed by the target's own next token, cut at a stop token, a stop
      string or max_new_tokens. The concatenation of all `accepted` lists of a request equals
      its `output_ids`; on the call, `req.output_ids` already ends with `accepted`.
    - `on_finished(req)` once when the request leaves the scheduler (finished, aborted or
      failed): drop its state. Not called for a retraction (the request comes back later with
      the same `rid` and `output_ids`).

    Drafts are suggestions: the core scores them with one target forward and keeps the longest
    prefix (path, for trees) that matches what the target itself produces (its argmax for greedy
    requests, its own sample for sampled ones), so the output is that of the target alone
    whatever the drafter proposes; only the speed depends on draft quality.

    Added in plugin API 1.0 (DrafterInfo construction, on_finished and trees in 1.1).
    """

    supports_tensor_parallel: bool = False
    """Class flag: this component works when `runtime.tp_size > 1` (the drafter runs on rank 0 only;
    a drafter with its own model would need that model sharded too). The stack resolution refuses
    a tp_size > 1 config that selects a component leaving it False, naming it. Added in plugin
    API 1.3."""

    def __init__(self, info: DrafterInfo) -> None:
        self.info = info

    @abc.abstractmethod
    def propose(self, reqs: list[Req], num_draft_tokens: int) -> DraftProposal:
        """Draft tokens for `reqs` (see the class docstring for the rules).

        :param reqs: the requests verifying in this step, in batch order.
        :param num_draft_tokens: the most draft tokens (tree nodes) per request this step, >= 1.
        :return: one chain or tree per request, in the same order.

        Added in plugin API 1.0.
        """

    def on_accepted(self, req: Req, accepted: list[int]) -> None:
        """Tokens just appended to `req.output_ids` (see the class docstring). Default: nothing.

        Added in plugin API 1.0."""
        return None

    def on_finished(self, req: Req) -> None:
        """`req` finished, was aborted or failed; drop per-request state. Default: nothing.

        Added in plugin API 1.1."""
        return None
