"""TP-aware linear layers whose weights come from a QuantMethod.

Every layer stores the *local* (this TP rank's) shard. Its `weight_loader(param, full, shard_id)`
receives the full checkpoint tensor and narrows it to the rank's rows (column parallel) or columns
(row parallel); fused layers (qkv, gate_up) place each shard at its offset, chosen by `shard_id`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers import cpu_gemm
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.distributed import TPGroup, divide, group_for
from radixserve.layers.quant_unquantized import UnquantizedMethod
from radixserve.layers.weight_utils import default_weight_loader, set_weight_attrs


class LinearBase(nn.Module):
    """y = x @ W.T (+ b). `output_sizes` are the local rows of each fused sub-matrix."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        quant_method: QuantMethod | None,
        tp_rank: int,
        tp_size: int,
        params_dtype: torch.dtype | None = None,
        tp_group: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = output_sizes
        self.output_size = sum(output_sizes)
        self.tp_group = group_for(tp_group, tp_rank, tp_size)
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.size
        self.quant_method = quant_method or UnquantizedMethod()
        dtype = params_dtype or torch.get_default_dtype()
        self.quant_method.create_weights(self, input_size, output_sizes, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size, dtype=dtype), requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


def _rank_slice(loaded: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    return loaded.narrow(dim, rank * size, size)


def _check_full_shape(loaded: torch.Tensor, local: torch.Size, dim: int | None, whole: int, what: str = "") -> None:
    """The checkpoint tensor must be the local shape with `whole` entries along `dim` (None: the
    local shape itself): narrow() would silently cut a larger one and copy_() broadcast a smaller."""
    want = list(local)
    if dim is not None:
        want[dim] = whole
    if tuple(loaded.shape) != tuple(want):
        raise ValueError(f"{what}expected checkpoint shape {tuple(want)}, got {tuple(loaded.shape)}")


def _packed(param: torch.Tensor, dim: int, n: int) -> int:
    """`n` features along `dim` in the parameter's own units: a packed dim (int4 in int32, block
    scales) holds `pack_factor` features per element."""
    if getattr(param, "packed_dim", None) != dim:
        return n
    factor = int(param.pack_factor)
    if n % factor:
        raise ValueError(f"{n} features do not split into whole packed elements of {factor} (packed dim {dim})")
    return n // factor


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None, **kw) -> None:
        super().__init__(input_size, [output_size], bias, quant_method, 0, 1, **kw)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks. `gather_output` all-gathers the result."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_method: QuantMethod | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        gather_output: bool = False,
        output_sizes: list[int] | None = None,
        tp_group: TPGroup | None = None,
        **kw,
    ) -> None:
        self.gather_output = gather_output
        group = group_for(tp_group, tp_rank, tp_size)
        local = output_sizes if output_sizes is not None else [divide(output_size, group.size)]
        super().__init__(input_size, local, bias, quant_method, group.rank, group.size, tp_group=group, **kw)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused; got shard_id={shard_id!r}")
        dim = getattr(param, "output_dim", 0)
        size = param.shape[dim]
        _check_full_shape(loaded, param.shape, dim, size * self.tp_size)
        param.data.copy_(_rank_slice(loaded, dim, size, self.tp_rank).to(param.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.tp_group.all_gather_last_dim(y) if self.gather_output else y


_SILU_AND_MUL = SiluAndMul()


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices fused along the output dim (gate_up: shard ids 0, 1).

    `fuse_silu_and_mul=True` marks a [gate; up] projection whose output always goes through
    SiluAndMul: quant methods may then pack it so that `forward_silu_and_mul` applies the
    activation inside the GEMM (the CPU fp32 path does), skipping the [n, 2I] intermediate."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, quant_method=None,
                 tp_rank: int = 0, tp_size: int = 1, fuse_silu_and_mul: bool = False,
                 tp_group: TPGroup | None = None, **kw) -> None:
        if fuse_silu_and_mul and (len(output_sizes) != 2 or output_sizes[0] != output_sizes[1]):
            raise ValueError(f"fuse_silu_and_mul needs two equal output sizes (gate, up), got {output_sizes}")
        self.fuse_silu_and_mul = fuse_silu_and_mul
        self.full_output_sizes = list(output_sizes)
        group = group_for(tp_group, tp_rank, tp_size)
        local = [divide(s, group.size) for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, quant_method, group.rank, group.size,
                         output_sizes=local, tp_group=group, **kw)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this projection: `SiluAndMul()(self(x))`, in one kernel where packed for it."""
        fused = cpu_gemm.silu_gated_linear(x, getattr(self, "packed_weight", None))
        return fused if fused is not None else _SILU_AND_MUL(self.forward(x))

    def _shard_range(self, shard_id: Any) -> tuple[int, int]:
        idx = _shard_index(shard_id, len(self.output_sizes), type(self).__name__)
        return sum(self.output_sizes[:idx]), self.output_sizes[idx]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        dim = getattr(param, "output_dim", 0)
        if shard_id is None:  # the checkpoint already holds the fused matrix: load shard by shard
            fulls = [_packed(param, dim, n) for n in self.full_output_sizes]
            _check_full_shape(loaded, param.shape, dim, sum(fulls), f"fused matrix of {fulls} along dim {dim}: ")
            offset = 0
            for i, full in enumerate(self.full_output_sizes):
                full = _packed(param, dim, full)
                self.weight_loader(param, loaded.narrow(dim, offset, full), i)
                offset += full
            return
        start, size = (_packed(param, dim, n) for n in self._shard_range(shard_id))
        region = param.data.narrow(dim, start, size)
        _check_full_shape(loaded, region.shape, dim, size * self.tp_size, f"shard {shard_id!r}: ")
        region.copy_(_rank_slice(loaded, dim, size, self.tp_rank).to(param.dtype))


def _shard_index(shard_id: Any, count: int, layer: str, names: tuple[str, ...] = ()) -> int:
    """The output index shard id `shard_id` names (an index below `count`, or one of `names`), or a
    ValueError listing the ids `layer` takes (audit 34: an unknown id surfaced as a bare KeyError)."""
    if shard_id in names:
        return names.index(shard_id)
    if isinstance(shard_id, int) and not isinstance(shard_id, bool) and 0 <= shard_id < count:
        return shard_id
    ids = ", ".join([repr(n) for n in names] + [str(i) for i in range(count)])
    raise ValueError(f"unknown shard id {shard_id!r}: {layer} takes {ids}")


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q, k, v projection (shard ids "q", "k", "v"). KV heads are replicated when tp_size
    exceeds their count."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 quant_method=None, tp_rank: int = 0, tp_size: int = 1, tp_group: TPGroup | None = None,
                 **kw) -> None:
        group = group_for(tp_group, tp_rank, tp_size)
        tp_rank, tp_size = group.rank, group.size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size)
        if tp_size >= num_kv_heads:
            self.num_kv_heads, self.kv_replicas = 1, divide(tp_size, num_kv_heads)
        else:
            self.num_kv_heads, self.kv_replicas = divide(num_kv_heads, tp_size), 1
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.full_output_sizes = [q * tp_size, kv * tp_size // self.kv_replicas, kv * tp_size // self.kv_replicas]
        self.gather_output = False
        # sizes are already local: skip MergedColumnParallelLinear's per-rank division
        LinearBase.__init__(self, hidden_size, [q, kv, kv], bias, quant_method, tp_rank, tp_size, tp_group=group, **kw)

    def _shard_range(self, shard_id: Any) -> tuple[int, int]:
        idx = _shard_index(shard_id, 3, "QKVParallelLinear", ("q", "k", "v"))
        return sum(self.output_sizes[:idx]), self.output_sizes[idx]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        dim = getattr(param, "output_dim", 0)
        if shard_id is None:
            fulls = [_packed(param, dim, n) for n in self.full_output_sizes]
            _check_full_shape(loaded, param.shape, dim, sum(fulls), f"fused qkv matrix of {fulls} along dim {dim}: ")
            offset = 0
            for sid, full in zip(("q", "k", "v"), self.full_output_sizes, strict=True):
                full = _packed(param, dim, full)
                self.weight_loader(param, loaded.narrow(dim, offset, full), sid)
                offset += full
            return
        start, size = (_packed(param, dim, n) for n in self._shard_range(shard_id))
        rank = self.tp_rank if shard_id in ("q", 0) else self.tp_rank // self.kv_replicas
        region = param.data.narrow(dim, start, size)
        full = _packed(param, dim, self.full_output_sizes[self._index(shard_id)])
        _check_full_shape(loaded, region.shape, dim, full, f"qkv shard {shard_id!r}: ")
        region.copy_(_rank_slice(loaded, dim, size, rank).to(param.dtype))

    @staticmethod
    def _index(shard_id: Any) -> int:
        return {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else int(shard_id)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial results are all-reduced (bias added once)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method=None,
                 tp_rank: int = 0, tp_size: int = 1, reduce_results: bool = True,
                 tp_group: TPGroup | None = None, **kw) -> None:
        self.reduce_results = reduce_results
        group = group_for(tp_group, tp_rank, tp_size)
        super().__init__(divide(input_size, group.size), [output_size], bias, quant_method, group.rank, group.size,
                         tp_group=group, **kw)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear is not fused; got shard_id={shard_id!r}")
        dim = getattr(param, "input_dim", None)
        if dim is None:  # bias: replicated
            _check_full_shape(loaded, param.shape, None, 0)
            param.data.copy_(loaded.to(param.dtype))
            return
        size = param.shape[dim]
        _check_full_shape(loaded, param.shape, dim, size * self.tp_size)
        param.data.copy_(_rank_slice(loaded, dim, size, self.tp_rank).to(param.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        y = self.quant_method.apply(self, x, bias)
        return self.tp_group.all_reduce(y) if self.reduce_results else y
