"""TokenAllocator: free-slot bookkeeping for the KV pool (page size 1)."""

from __future__ import annotations

import torch


class TokenAllocator:
    """Hands out KV slots 1..size (slot 0 is the pool's reserved padding slot, never handed out).

    Contract: `alloc(n)` returns an int64 CPU tensor of n distinct free slots, or None (and
    changes nothing) when fewer than n are free. Freed slots are handed out again before slots
    never used, and those go lowest first: on the CPU a pool's pages become resident only when
    written, so a lightly used server keeps its KV memory small. `free(slots)` returns slots;
    freeing a slot that is not allocated is an error. After everything is freed, `available_size() == size`."""

    def __init__(self, size: int, debug_checks: bool = False) -> None:
        if size <= 0:
            raise ValueError(f"TokenAllocator size must be > 0, got {size}")
        self.size = size
        self.debug_checks = debug_checks  # O(n) double-free checks; on in tests
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._pending: list[torch.Tensor] = []  # freed chunks, merged lazily (cheap free)
        self._num_free = self.size

    def available_size(self) -> int:
        return self._num_free

    def _merge(self) -> None:
        if self._pending:  # most recently freed first: their pages are already resident
            self._free = torch.cat([*reversed(self._pending), self._free])
            self._pending = []

    def alloc(self, n: int) -> torch.Tensor | None:
        if n < 0:
            raise ValueError(f"alloc({n}): n must be >= 0")
        if n > self._num_free:
            return None
        # freed chunks first, most recent first, without concatenating the (large) never-used list:
        # a per-step copy of the whole free list would cost ~1 ms on a GPU-sized pool
        taken: list[torch.Tensor] = []
        need = n
        while need and self._pending:
            chunk = self._pending.pop()
            if chunk.numel() > need:
                self._pending.append(chunk[need:])
                chunk = chunk[:need]
            taken.append(chunk)
            need -= chunk.numel()
        if need:
            taken.append(self._free[:need])
            self._free = self._free[need:]
        out = torch.cat(taken) if len(taken) > 1 else (taken[0].clone() if taken else torch.empty(0, dtype=torch.int64))
        self._num_free -= n
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots is None or slots.numel() == 0:
            return
        slots = slots.detach().to("cpu", torch.int64).flatten()
        if self.debug_checks:
            self._check_free(slots)
        self._pending.append(slots.clone())
        self._num_free += int(slots.numel())
        if self._num_free > self.size:
            raise RuntimeError(f"TokenAllocator over-freed: {self._num_free} free of {self.size}")

    def is_free(self, slots: torch.Tensor) -> torch.Tensor:
        """A bool mask: which of `slots` are free now. O(pool size): for recovery paths, not every step."""
        slots = slots.detach().to("cpu", torch.int64).flatten()
        self._merge()
        return torch.isin(slots, self._free)

    def _check_free(self, slots: torch.Tensor) -> None:
        if int(slots.min()) < 1 or int(slots.max()) > self.size:
            raise ValueError(f"free: slot out of range [1, {self.size}]")
        if slots.unique().numel() != slots.numel():
            raise ValueError("free: duplicate slots in one call")
        self._merge()
        if torch.isin(slots, self._free).any():
            raise ValueError("free: slot already free (double free)")
