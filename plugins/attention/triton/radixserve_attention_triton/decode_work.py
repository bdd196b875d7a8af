"""The decode split kernel's work list: one program per (request, split) that has work, instead of one per
(request, split slot up to `max_kv_splits`).

Why: the split axis of the plain grid is `max_kv_splits` (32) for every request, because the split counts
live on the device and a CUDA graph cannot size its grid from them. At a large batch the planner gives
each request one or two splits, so most programs of the plain grid only load their request's split count
and exit (at 320 requests, 79k of 82k programs a layer). The number of real items is bounded without
reading the counts: every split holds at least `split_len >= total / target_programs` keys (`total` = the
batch's keys times KV heads, `compute_num_kv_splits`), so the batch's splits sum to at most
`target_programs / num_kv_heads + bs` (each request's count rounds up by less than one). A grid of that many
programs per KV head, each looking up its request and split in this list, does the same work.

Planned on the device (a cumulative sum and a sorted search: no host sync), so a decode CUDA graph
captures the lookup and a replay re-plans into the same static buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def work_items_bound(bs: int, num_kv_heads: int, target_programs: int) -> int:
    """The most (request, split) items a batch of `bs` requests can plan (see the module docstring)."""
    return bs + -(-target_programs // num_kv_heads)


def worth_a_work_list(bs: int, max_splits: int, num_kv_heads: int, target_programs: int) -> bool:
    """Whether the work list's grid is at most a quarter of the plain grid (batch 1 keeps the plain grid:
    its few programs cost nothing, and the list's planning would add two launches a step)."""
    return 4 * work_items_bound(bs, num_kv_heads, target_programs) <= bs * max_splits


@dataclass
class DecodeWork:
    """`request`: int32 [items], the request of each item in request order, `bs` past the planned items
    (no work); `split_start`: int32 [bs], each request's first item (an item's split is its index minus
    that); `items`: int32 [items], 0..items-1 (kept: a static input of the sorted search)."""

    request: torch.Tensor
    split_start: torch.Tensor
    items: torch.Tensor

    @classmethod
    def allocate(cls, bs: int, items: int, device: torch.device) -> DecodeWork:
        return cls(torch.full((items,), bs, dtype=torch.int32, device=device),
                   torch.zeros(bs, dtype=torch.int32, device=device),
                   torch.arange(items, dtype=torch.int32, device=device))

    def first(self, bs: int, items: int) -> DecodeWork:
        """Views for a batch of `bs` requests planning at most `items` items (CUDA-graph static buffers
        allocated for the largest batch)."""
        if bs > self.split_start.shape[0] or items > self.items.shape[0]:
            raise ValueError(f"a decode work list for {bs} requests / {items} items exceeds its buffers "
                             f"({self.split_start.shape[0]} / {self.items.shape[0]})")
        return DecodeWork(self.request[:items], self.split_start[:bs], self.items[:items])


def plan_decode_work(num_kv_splits: torch.Tensor, work: DecodeWork) -> None:
    """Fill `work` from the batch's split counts (int32 [bs], each >= 1)."""
    ends = torch.cumsum(num_kv_splits, 0, dtype=torch.int32)
    torch.sub(ends, num_kv_splits, out=work.split_start)
    torch.searchsorted(ends, work.items, right=True, out_int32=True, out=work.request)
