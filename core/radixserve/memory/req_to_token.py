"""ReqToTokenPool: one row per running request, mapping token position -> KV slot."""

from __future__ import annotations

import torch

from radixserve.memory.host_zeros import zeros_on_demand


class ReqToTokenPool:
    """A `[size, max_context_len]` int64 table on `device`.

    Contract: `alloc()` hands out a free row index (or None when all rows are taken); `free(idx)`
    returns it. A row's contents are meaningful only up to the owning request's length; rows are
    not cleared on free (the next owner overwrites what it uses).

    Write through `write` / `write_positions` only: they keep `host`, a CPU mirror of the table,
    in step, and `read` serves rows from it. The scheduler and prefix caches read rows while a batch
    may still be running on the device; reading the device table would wait for it."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"ReqToTokenPool needs size > 0 and max_context_len > 0, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = zeros_on_demand((size, max_context_len), torch.int64, self.device)  # CPU: rows resident once used
        on_host = self.device.type == "cpu"
        self.host = self.req_to_token if on_host else torch.zeros((size, max_context_len), dtype=torch.int64)
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
        slots = slots.to("cpu", torch.int64)
        if self.host is not self.req_to_token:
            self.host[idx, start:end] = slots
        self.req_to_token[idx, start:end] = slots.to(self.device, non_blocking=True)

    def write_positions(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """Store slots[i] at position cols[i] of row rows[i] (one decode step's new tokens)."""
        r, c = torch.tensor(rows, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64)
        slots = slots.to("cpu", torch.int64)
        if self.host is not self.req_to_token:
            self.host[r, c] = slots
        dev = self.device  # non_blocking: a blocking copy would wait for the batch in flight
        self.req_to_token[r.to(dev, non_blocking=True), c.to(dev, non_blocking=True)] = slots.to(dev, non_blocking=True)

    def read(self, idx: int, end: int, start: int = 0) -> torch.Tensor:
        """Slots at positions [start, end) of row `idx`: a new int64 CPU tensor, no device sync."""
        return self.host[idx, start:end].clone()

    def clear(self) -> None:
        self._free_rows = list(range(self.size - 1, -1, -1))
        self._in_use.clear()
