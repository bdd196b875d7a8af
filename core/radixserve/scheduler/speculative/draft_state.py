"""Per-request bookkeeping shared by drafters that run their own layers over the target's hidden
states (EAGLE, MTP): which verified rows a request has collected, which draft-pool slots it holds,
and their release when it finishes. A drafter subclasses `PooledDrafter` and writes only how it
runs the collected rows and drafts from them.

Added in plugin API 1.4."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.interfaces.drafter import Drafter
from radixserve.interfaces.target_states import HiddenRows, verified_rows


@dataclass
class DraftRequestState:
    """What a pooled drafter keeps per request. The draft row at position p reads (token p + 1,
    the target's feature at p).

    Added in plugin API 1.4."""

    slots: torch.Tensor  # draft-pool slots of the rows run so far
    last_pos: int = -1  # highest position run or pending
    pending_pos: list[int] = field(default_factory=list)  # verified rows not yet run: position p,
    pending_tok: list[int] = field(default_factory=list)  # token p + 1,
    pending_feats: list[torch.Tensor] = field(default_factory=list)  # the target's features (chunks)
    root: Any = None  # the drafter's own record of the last row run (position first)


class PooledDrafter(Drafter):
    """Base of a drafter with a per-request draft KV pool fed the target's hidden states.

    A subclass sets `self.target` (`DrafterInfo.target_states`, after its `request(...)`),
    `self.pool` (a `DraftSlotStack`) and calls `init_states()` in its constructor, and implements
    `_features(rows)`: the feature tensor of one `HiddenRows` it drafts from (e.g. `rows.aux`),
    or None to skip those rows. It gets:

    - `on_accepted(req, accepted)`: collects the request's newly verified rows (`_collect`);
    - `on_finished(req)`: drops the request's state and frees its pool slots;
    - `states` (rid -> `DraftRequestState`) and `_state(rid)` (creating it).

    Restrictions: a row at position p is collected once token p + 1 is verified, so the newest
    token's row stays with the target until the next step.

    Added in plugin API 1.4.
    """

    target: Any
    pool: Any

    def init_states(self) -> None:
        self.states: dict[str, DraftRequestState] = {}

    def _features(self, rows: HiddenRows) -> torch.Tensor | None:
        raise NotImplementedError(f"{type(self).__name__} must implement _features")

    @torch.inference_mode()
    def on_accepted(self, req, accepted: list[int]) -> None:
        self._collect(req)

    def on_finished(self, req) -> None:
        self.target.discard(req.rid)
        st = self.states.pop(req.rid, None)
        if st is not None and st.slots.numel():
            self.pool.free(st.slots)

    def _state(self, rid: str) -> DraftRequestState:
        st = self.states.get(rid)
        if st is None:
            st = self.states[rid] = DraftRequestState(torch.empty(0, dtype=torch.int64, device=self.pool.device))
        return st

    def _collect(self, req) -> None:
        """Append the verified rows of the target's new hidden states to the request's pending rows."""
        st = self._state(req.rid)
        ids = req.all_ids()
        for rows in self.target.take(req.rid):
            feats = self._features(rows)
            if feats is None:
                continue
            take = []
            for j in verified_rows(rows, ids):
                pos = rows.positions[j]
                if pos > st.last_pos and pos + 1 < len(ids):
                    take.append(j)
                    st.pending_pos.append(pos)
                    st.pending_tok.append(ids[pos + 1])
                    st.last_pos = pos
            if take:  # one gather per forward, not one slice per row
                st.pending_feats.append(feats[torch.tensor(take, dtype=torch.int64, device=feats.device)])
