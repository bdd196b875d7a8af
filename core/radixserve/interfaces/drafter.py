"""Drafter: proposes draft tokens that the target model verifies (speculative decoding)."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


class Drafter(abc.ABC):
    """Proposes up to `num_draft_tokens` tokens per running request. Kind "drafter", selected by
    the config key `stack.speculative`. Not driven by this core yet: a stack that sets
    `stack.speculative` fails at start-up ("speculative decoding is not implemented by this core yet").

    Contract:
    - `propose(reqs, num_draft_tokens)` returns one chain per request, in order, each at most
      `num_draft_tokens` long. Drafts are suggestions: the core verifies them with one target
      forward and accepts greedily (or by rejection sampling when sampling), so output is the same
      as without speculation whatever the drafter proposes.
    - `on_accepted(req, accepted)` is told which tokens were accepted, to update drafter state.

    Added in plugin API 1.0.
    """

    @abc.abstractmethod
    def propose(self, reqs: list[Req], num_draft_tokens: int) -> DraftProposal: ...

    def on_accepted(self, req: Req, accepted: list[int]) -> None:
        return None
