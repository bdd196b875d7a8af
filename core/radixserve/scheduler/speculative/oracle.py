"""The `oracle` drafter: proposes a stored greedy continuation, for measuring the verify path.

Its drafts do not come from a model: a request whose prompt has a stored continuation gets the
next tokens of that continuation (as long as its output so far agrees with it). Continuations come
from a JSON file (`options: {path: FILE}`, a list of `{"prompt_ids": [...], "output_ids": [...]}`)
and, with `learn: true` (the default), from every request that finishes: running the same greedy
batch twice gives the second run a perfect oracle ("computed by a first pass").

`accept_len: N` makes the acceptance exact and known: only the first N draft tokens are the
continuation's, the rest are deliberately wrong (the continuation's token + 1), so a verify of
k >= N drafts accepts exactly N (fewer only where the continuation ends).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

from radixserve.interfaces.drafter import Drafter, DrafterInfo, DraftProposal
from radixserve.state import Req

MAX_STORED = 4096  # continuations kept (least recently stored dropped first)


class OracleDrafter(Drafter):
    def __init__(self, info: DrafterInfo, path: str | None = None, learn: bool = True, accept_len: int | None = None) -> None:
        super().__init__(info)
        if accept_len is not None and accept_len < 0:
            raise ValueError(f"accept_len must be >= 0, got {accept_len}")
        self.learn = learn
        self.accept_len = accept_len
        self._store: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        if path is not None:
            self.load(path)

    def load(self, path: str) -> None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"speculative.options.path: {path!r} does not exist")
        try:
            entries = json.loads(p.read_text())
            for e in entries:
                self.remember(list(e["prompt_ids"]), list(e["output_ids"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"speculative.options.path: {path!r} is not a list of {{prompt_ids, output_ids}}: {e}") from None

    def remember(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        key = tuple(prompt_ids)
        self._store.pop(key, None)
        self._store[key] = list(output_ids)
        while len(self._store) > MAX_STORED:
            self._store.popitem(last=False)

    def propose(self, reqs: list[Req], num_draft_tokens: int) -> DraftProposal:
        return DraftProposal([self._draft(r, num_draft_tokens) for r in reqs])

    def _draft(self, req: Req, k: int) -> list[int]:
        cont = self._store.get(tuple(req.origin_input_ids))
        n = len(req.output_ids)
        if cont is None or cont[:n] != req.output_ids:
            return []
        draft = cont[n : n + k]
        if self.accept_len is not None:
            vocab = self.info.vocab_size
            draft = draft[: self.accept_len] + [(t + 1) % vocab for t in cont[n + self.accept_len : n + k]]
        return draft

    def on_finished(self, req: Req) -> None:
        if self.learn and req.finished_reason is not None and req.finished_reason.get("type") != "abort":
            self.remember(req.origin_input_ids, req.output_ids)
