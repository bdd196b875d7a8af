"""Tensor-parallel communication: `TPGroup`, one object per process, handed to every layer that
needs a collective at construction (no process-global context is read by the layers).

A group of size 1 does nothing: every collective returns its input untouched, without a call
into torch.distributed, so `tp_size=1` runs exactly the single-process code.

Two process groups back a group of size > 1 (see `init_tp_group`):
- the *device* group carries the model's collectives (all-reduce after row-parallel layers, the
  vocab all-gather of the LM head): NCCL on CUDA (capturable in CUDA graphs), gloo on CPU;
- the *CPU* group (gloo) carries the scheduler's per-step broadcast of the batch (a pickled
  object: host data, never a device sync). On CPU both are the same group."""

from __future__ import annotations

import datetime
import os
import pickle
from typing import Any

import torch


def divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by tp_size {d}")
    return n // d


class TPGroup:
    """This process's place in its tensor-parallel group and the collectives over it.

    :param rank: this process's TP rank, 0 <= rank < size.
    :param size: the number of ranks.
    :param device_group: torch.distributed process group for tensors on the model's device
        (None: a *detached* group: layers can shard weights for `rank` but any collective raises;
        what tests of weight sharding use).
    :param cpu_group: gloo group for host objects (None: `device_group`).

    Added in plugin API 1.3."""

    def __init__(self, rank: int = 0, size: int = 1, device_group: Any = None, cpu_group: Any = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"invalid tensor-parallel rank {rank} of size {size}")
        self.rank, self.size = rank, size
        self.device_group = device_group
        self.cpu_group = cpu_group if cpu_group is not None else device_group

    @classmethod
    def single(cls) -> TPGroup:
        """The group of one process (tp_size=1): every collective is the identity."""
        return cls(0, 1)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"

    def _dist(self):
        if self.device_group is None:
            raise RuntimeError(f"{self!r} has no process group: build it with init_tp_group to run collectives")
        import torch.distributed as dist

        return dist

    # ---- model collectives (device group) -------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (in place; returns `x`)."""
        if self.size == 1:
            return x
        self._dist().all_reduce(x, group=self.device_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dim, rank order."""
        if self.size == 1:
            return x
        dist = self._dist()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast_tensor(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` into `x` on every rank (same shape and dtype everywhere)."""
        if self.size == 1:
            return x
        self._dist().broadcast(x, src=src, group=self.device_group)
        return x

    # ---- host collectives (CPU group) -----------------------------------------------------
    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank `src`'s picklable `obj`, returned on every rank (two small broadcasts: length, bytes)."""
        if self.size == 1:
            return obj
        dist = self._dist()
        if self.rank == src:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            length = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(length, src=src, group=self.cpu_group)
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=src, group=self.cpu_group)
            return obj
        length = torch.empty(1, dtype=torch.int64)
        dist.broadcast(length, src=src, group=self.cpu_group)
        buf = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=src, group=self.cpu_group)
        return pickle.loads(buf.numpy().tobytes())

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. the KV pool size every rank can hold)."""
        if self.size == 1:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64)
        import torch.distributed as dist

        self._dist().all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            self._dist().barrier(group=self.cpu_group)

    def destroy(self) -> None:
        """Leave the process groups (at shutdown)."""
        if self.size > 1 and self.device_group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.device_group = self.cpu_group = None


def init_tp_group(rank: int, size: int, init_addr: str, device: str, local_rank: int | None = None,
                  timeout_s: float | None = None) -> TPGroup:
    """Join the TP group of `size` processes that rendezvous at `init_addr` ("host:port", served by
    rank 0). NCCL for the device group on CUDA (this rank's GPU: `local_rank`, its index on its
    node), gloo otherwise; plus a gloo group for host objects. Size 1: `TPGroup.single()`."""
    if size == 1:
        return TPGroup.single()
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s or float(os.environ.get("RADIXSERVE_DIST_TIMEOUT_S", 1800)))
    on_cuda = device.startswith("cuda")
    if on_cuda:
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    dist.init_process_group(
        backend="nccl" if on_cuda else "gloo", init_method=f"tcp://{init_addr}", rank=rank, world_size=size,
        timeout=timeout,
    )
    world = dist.group.WORLD
    cpu = dist.new_group(backend="gloo", timeout=timeout) if on_cuda else world
    return TPGroup(rank, size, device_group=world, cpu_group=cpu)


def group_for(tp_group: TPGroup | None, tp_rank: int = 0, tp_size: int = 1) -> TPGroup:
    """The group a layer uses: `tp_group` when given, else a detached one for (tp_rank, tp_size)."""
    if tp_group is not None:
        return tp_group
    return TPGroup.single() if tp_size == 1 else TPGroup(tp_rank, tp_size)
