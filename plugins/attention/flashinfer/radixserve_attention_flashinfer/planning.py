"""Plan inputs for FlashInfer's wrappers over RadixServe's token-slot KV pool (torch only).

FlashInfer addresses a paged KV cache by (indptr, indices, last_page_len). The pool here is paged
with page size 1: a "page" is one token slot, so request i's page list is exactly its
`req_to_token` row cut to its length, and every last page holds one token. The query side of a
prefill is described by `qo_indptr` over the packed new tokens.

Host-side inputs (indptr, last_page_len) are built from the batch's host length lists, so planning
never reads lengths back from the device; the page lists are gathered on the device with ops whose
output sizes are known on the host (no synchronisation either).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def indptr_from_lens(lens: Sequence[int]) -> torch.Tensor:
    """int32 CPU `[len(lens) + 1]`: 0 followed by the running sum of `lens` (FlashInfer's indptr)."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if lens:
        torch.cumsum(torch.tensor(list(lens), dtype=torch.int32), 0, out=out[1:])
    return out


def last_page_lens(bs: int) -> torch.Tensor:
    """int32 CPU `[bs]` of ones: with page size 1 every request's last page holds one token."""
    return torch.ones(bs, dtype=torch.int32)


def gather_token_slots(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lens: torch.Tensor,
    total: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The page list of a batch: for each request i in order, `req_to_token[req_pool_indices[i], :lens[i]]`,
    concatenated, as int32 on `req_to_token`'s device.

    :param lens: int `[bs]` on the device: how many leading slots of each row to take.
    :param total: `sum(lens)`, known on the host (sizes the result without a device sync).
    :param out: optional int32 buffer of at least `total` entries (CUDA-graph state); the result is
        then its first `total` entries.
    """
    device = req_to_token.device
    bs = req_pool_indices.shape[0]
    owner = torch.repeat_interleave(torch.arange(bs, device=device), lens.to(device), output_size=total)
    starts = torch.zeros(bs, dtype=torch.int64, device=device)
    if bs > 1:
        torch.cumsum(lens[:-1].to(device=device, dtype=torch.int64), 0, out=starts[1:])
    pos = torch.arange(total, device=device) - starts[owner]
    slots = req_to_token[req_pool_indices.to(device)[owner], pos]
    if out is None:
        return slots.to(torch.int32)
    if out.shape[0] < total:
        raise ValueError(f"the page-list buffer holds {out.shape[0]} slots, this batch needs {total}")
    out[:total].copy_(slots)
    return out[:total]


def tree_custom_mask(
    tree_mask: torch.Tensor, prefix_lens: Sequence[int], extend_lens: Sequence[int]
) -> torch.Tensor:
    """FlashInfer's flattened custom mask for a speculative verify of draft trees.

    :param tree_mask: `ForwardBatch.tree_mask`: per request i a row-major `[e_i, e_i]` bool block
        (new token a may see new token b).
    :return: bool, per request a row-major `[e_i, p_i + e_i]` block (rows: new tokens; columns: the
        request's whole KV, prefix first): every prefix column True, the last `e_i` columns the
        tree block. This is the layout `BatchPrefillWithPagedKVCacheWrapper.plan(custom_mask=...)`
        takes for page-list KV of length `p_i + e_i`.
    """
    flat = tree_mask.reshape(-1).to(torch.bool)
    expected = sum(e * e for e in extend_lens)
    if flat.shape[0] != expected:
        raise ValueError(f"tree_mask has {flat.shape[0]} entries, the extend lengths account for {expected}")
    pieces = []
    offset = 0
    for p, e in zip(prefix_lens, extend_lens, strict=True):
        block = flat[offset: offset + e * e].view(e, e)
        offset += e * e
        prefix = torch.ones(e, p, dtype=torch.bool, device=flat.device)
        pieces.append(torch.cat([prefix, block], dim=1).reshape(-1))
    return torch.cat(pieces) if pieces else flat[:0]


@dataclass
class DecodeGraphBuffers:
    """Static buffers the CUDA-graph decode wrappers plan into (one wrapper per captured batch size,
    all sharing these: only one graph replays at a time).

    `indptr`: int32 `[max_bs + 1]`; `last_page_len`: int32 `[max_bs]` (ones); `indices`: int32
    `[capacity]`, the page list of the largest batch a replay may bring.
    """

    indptr: torch.Tensor
    last_page_len: torch.Tensor
    indices: torch.Tensor

    @classmethod
    def allocate(cls, max_bs: int, capacity: int, device: torch.device) -> DecodeGraphBuffers:
        if max_bs < 1 or capacity < max_bs:
            raise ValueError(f"graph buffers need max_bs >= 1 and capacity >= max_bs, got {max_bs}, {capacity}")
        return cls(
            indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            last_page_len=torch.ones(max_bs, dtype=torch.int32, device=device),
            # zeros: slot 0 is the pool's padding slot, so an unplanned entry reads nothing real
            indices=torch.zeros(capacity, dtype=torch.int32, device=device),
        )

    @property
    def max_bs(self) -> int:
        return int(self.last_page_len.shape[0])

    def for_batch(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indptr, indices, last_page_len) views for a wrapper of batch size `bs`."""
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"batch size {bs} is outside the graph buffers' 1..{self.max_bs}")
        return self.indptr[: bs + 1], self.indices, self.last_page_len[:bs]

    def check_fits(self, total: int) -> None:
        if total > self.indices.shape[0]:
            raise ValueError(
                f"decode batch reads {total} KV slots, more than the graph page-list buffer's "
                f"{self.indices.shape[0]}; raise FlashInferAttentionBackend(max_graph_kv_slots=...)"
            )


@dataclass
class ExtendGraphBuffers:
    """Static buffers the CUDA-graph paged-prefill wrappers of EXTEND batches plan into (one wrapper
    per captured token count, all sharing these; plugin API 1.10). Every such batch has exactly
    `max_reqs` requests (the runner pads it), so the wrappers' batch size never changes.

    `qo_indptr`: int32 `[max_reqs + 1]`, where each request's new tokens start; `kv`: the page tables
    (`indptr`, `indices`, `last_page_len`) as the decode graphs keep them.
    """

    qo_indptr: torch.Tensor
    kv: DecodeGraphBuffers

    @classmethod
    def allocate(cls, max_reqs: int, capacity: int, device: torch.device) -> ExtendGraphBuffers:
        return cls(qo_indptr=torch.zeros(max_reqs + 1, dtype=torch.int32, device=device),
                   kv=DecodeGraphBuffers.allocate(max_reqs, capacity, device))

    @property
    def max_reqs(self) -> int:
        return self.kv.max_bs
