"""ReqToTokenPool: one row per running request, mapping token position -> KV slot."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """A `[size, max_context_len]` int64 table on `device`.

    Contract: `alloc()` hands out a free row index (or None when all rows are taken); `free(idx)`
    returns it. A row's contents are meaningful only up to the owning request's length; rows are
    not cleared on free (the next owner overwrites what it uses)."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"ReqToTokenPool needs size > 0 and max_context_len > 0, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=self.device)
        # pop() from the end: lowest indices are handed out first
        self._free_rows: list[int] = list(range(size - 1, -1, -1))
        self._in_use: set[int] = set()

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        if not self._free_rows:
            return None
        idx = self._free_rows.pop()
        self._in_use.add(idx)
        return idx

    def free(self, idx: int) -> None:
        if idx not in self._in_use:
            raise ValueError(f"ReqToTokenPool.free: row {idx} is not allocated (double free?)")
        self._in_use.remove(idx)
        self._free_rows.append(idx)

    def write(self, idx: int, start: int, slots: torch.Tensor) -> None:
        """Store `slots` at positions [start, start+len(slots)) of row `idx`."""
        end = start + int(slots.numel())
        if end > self.max_context_len:
            raise ValueError(f"request length {end} exceeds the context length {self.max_context_len}")
        self.req_to_token[idx, start:end] = slots.to(self.device, torch.int64)

    def clear(self) -> None:
        self._free_rows = list(range(self.size - 1, -1, -1))
        self._in_use.clear()
