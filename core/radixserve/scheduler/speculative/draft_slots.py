"""`DraftSlotStack`: the slot bookkeeping of a drafter's own KV memory (one pool of token slots
shared by every request, growing on demand, each request holding the slots of its verified
positions until it is released), so a drafter's pool class writes only its storage.

Added in plugin API 1.4."""

from __future__ import annotations

import torch


class DraftSlotStack:
    """Free slots `first .. first + capacity - 1` of a drafter's KV storage, handed out low slots
    first; `alloc` doubles the storage when it runs out.

    A subclass owns the tensors and implements `capacity` (slots usable now) and
    `_grow_storage(old_capacity)`, which must make the storage hold `2 * old_capacity` usable
    slots, keeping the rows of the old ones in place. Call `__init__(capacity, first)` after the
    storage of `capacity` slots exists.

    :param capacity: usable slots at the start (> 0).
    :param first: the lowest usable slot (1 when slot 0 is the storage's padding row).
    :param device: where `alloc` puts the slot tensor.

    Restrictions: not thread-safe; a slot freed twice is handed out twice.

    Added in plugin API 1.4.
    """

    def __init__(self, capacity: int, first: int, device: torch.device) -> None:
        self.first = first
        self.device = torch.device(device)
        self._free = list(range(first + capacity - 1, first - 1, -1))  # a stack: low slots first

    @property
    def capacity(self) -> int:
        """Usable slots now."""
        raise NotImplementedError(f"{type(self).__name__} must implement capacity")

    def _grow_storage(self, old_capacity: int) -> None:
        """Make the storage hold `2 * old_capacity` usable slots, keeping the old rows."""
        raise NotImplementedError(f"{type(self).__name__} must implement _grow_storage")

    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> torch.Tensor:
        """`n` slots (int64, on `device`); the storage doubles when it runs out."""
        while len(self._free) < n:
            old = self.capacity
            self._grow_storage(old)
            self._free[:0] = list(range(self.first + 2 * old - 1, self.first + old - 1, -1))
        got = [self._free.pop() for _ in range(n)]
        return torch.tensor(got, dtype=torch.int64, device=self.device)

    def free(self, slots: torch.Tensor) -> None:
        """Give `slots` (from `alloc`) back."""
        self._free.extend(reversed(slots.tolist()))
