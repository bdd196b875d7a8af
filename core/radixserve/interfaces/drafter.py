"""Drafter: proposes draft tokens that the target model verifies (speculative decoding)."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.state import Req


@dataclass
class DraftProposal:
    """Chain drafts: `tokens[i]` continues request i's sequence (may be empty: no draft)."""

    tokens: list[list[int]]


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
