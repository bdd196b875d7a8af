"""TargetStates: the target model's hidden states, embedding and LM head, as a drafter sees them.

Drafters that feed a draft model with the target's features (EAGLE-2 reads the final hidden state,
EAGLE-3 three intermediate layers) get this object as `DrafterInfo.target_states`. They never
touch the model class: the runner records what was asked for on every forward and hands it over
per request. Added in plugin API 1.1."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class HiddenRows:
    """The rows one forward computed for one request, in the order the request's tokens were fed.

    `positions[j]` is row j's position in the sequence and `token_ids[j]` its input token. `parents`
    is None for a prefill chunk or a plain decode step; for a verify step it is the draft tree as
    the core verified it (node 0 = the request's last verified token, `parents[j]` = node j's
    parent node, -1 for node 0), so a drafter can pick the rows of the accepted path. `final` is
    `[rows, hidden]`: the model's output after the final norm (what the LM head reads), when
    requested; `aux` is `[rows, len(aux_layers) * hidden]`: the residual stream after each requested
    decoder layer, concatenated in the requested order, when requested."""

    positions: list[int]
    token_ids: list[int]
    parents: list[int] | None
    final: torch.Tensor | None
    aux: torch.Tensor | None


def verified_rows(rows: HiddenRows, ids: list[int]) -> list[int]:
    """Indices of `rows` on the request's verified sequence `ids`: for a prefill or decode step
    those whose token is the sequence's; for a verify step the accepted path (from each node, the
    first child carrying the next verified token, as the core accepts).

    Row j at position p was computed from token p (its `final` is what predicts token p + 1), so
    the newest verified token has no row until a later forward feeds it. Added in plugin API 1.4
    (in `radixserve.scheduler.speculative.draft_state`; here, its public home, since 1.12)."""
    pos, toks = rows.positions, rows.token_ids
    if rows.parents is None:
        return [j for j, p in enumerate(pos) if p < len(ids) and (not toks or ids[p] == toks[j])]
    if not toks or pos[0] >= len(ids) or ids[pos[0]] != toks[0]:
        return []
    path, node = [0], 0
    while pos[node] + 1 < len(ids):
        want = ids[pos[node] + 1]
        child = next((c for c in range(node + 1, len(pos)) if rows.parents[c] == node and toks[c] == want), None)
        if child is None:
            break
        path.append(child)
        node = child
    return path


class TargetStates:
    """What the core offers a drafter about the target model. Added in plugin API 1.1.

    Recording is off until a drafter calls `request(...)` (normally in its constructor), so a
    server without such a drafter pays nothing. Once on, every target forward (prefill chunks,
    decode and verify steps) appends one `HiddenRows` per request; the runner's decode CUDA graphs
    are captured again to write the requested rows too (the same values as an eager forward). A drafter collects a request's rows with `take(rid)`
    (typically in `on_accepted`, which follows the forward that produced the tokens) and calls
    `discard(rid)` in `on_finished`. Rows of positions served from the prefix cache were never
    computed and are absent: a drafter must cope with a sequence whose early positions are missing.
    All tensors live on the target's device, in its dtype; they are copies the drafter may keep.
    """

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        vocab_size: int,
        dtype: torch.dtype,
        supports_aux_layers: bool,
        enable: Callable[[bool, tuple[int, ...]], None],
        embed: Callable[[torch.Tensor], torch.Tensor],
        logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.num_layers = num_layers  # the target's decoder layers
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.dtype = dtype  # of the hidden states and the embedding
        self.supports_aux_layers = supports_aux_layers  # the model implements the capability
        self._enable, self._embed, self._logits = enable, embed, logits
        self.final = False
        self.aux_layers: tuple[int, ...] = ()
        self._rows: dict[str, list[HiddenRows]] = {}

    # ---- for drafters ----------------------------------------------------------------------
    def request(self, final: bool = False, aux_layers: Sequence[int] = ()) -> None:
        """Start recording the final hidden state (`final`) and/or the residual stream after the
        decoder layers `aux_layers` (0-based, each in [0, num_layers)). Raises ValueError when a
        layer is out of range or the model does not offer intermediate layers."""
        layers = tuple(int(i) for i in aux_layers)
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"aux hidden-state layers {bad} are outside the target's {self.num_layers} layers")
        if layers and not self.supports_aux_layers:
            raise ValueError("the target model does not expose intermediate hidden states (Model capability "
                             "`supports_aux_hidden_states`)")
        self.final = self.final or bool(final)
        self.aux_layers = layers or self.aux_layers
        self._enable(self.final, self.aux_layers)

    @property
    def recording(self) -> bool:
        return self.final or bool(self.aux_layers)

    def take(self, rid: str) -> list[HiddenRows]:
        """The rows recorded for request `rid` since the last `take` (oldest forward first)."""
        return self._rows.pop(rid, [])

    def discard(self, rid: str) -> None:
        """Drop whatever is recorded for `rid` (call it from `on_finished`)."""
        self._rows.pop(rid, None)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings `[n, hidden]` of int64 `token_ids` `[n]`."""
        return self._embed(token_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head: fp32 `[rows, vocab_size]` for `hidden` `[rows, hidden]`."""
        return self._logits(hidden)[:, : self.vocab_size]

    # ---- for the runner ----------------------------------------------------------------------
    def record(self, rid: str, rows: HiddenRows) -> None:
        self._rows.setdefault(rid, []).append(rows)
