"""Conformance kit for quantization methods: each linear layer kind a model uses (replicated,
column- and row-parallel, fused gate_up and qkv), built with the method, loaded from a checkpoint
through its parameters' weight loaders (as one tensor, or shard by shard with the fused layers'
shard ids, and split over 2 tensor-parallel ranks), must compute `x @ dequant(W).T + b`.
`check_quant_method_moe` does the same for a method's MoE hooks: a `FusedMoE` layer's stacked
experts, loaded expert by expert, must compute the routed sum of its dequantized experts.

Splitting over ranks is what catches a parameter without `input_dim` / `output_dim`: the layer's
loader cannot tell which dimension to cut and loads the full tensor (a row-parallel weight is then
taken for a replicated bias)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.moe.routing import RoutingConfig
from radixserve.layers.weight_utils import CheckpointDtypeError, load_into
from radixserve.testing._threads import single_threaded

# quantize(w [out, in] fp32 CPU) -> (checkpoint tensors by parameter name, the dequantized weight)
Quantize = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]
DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass
class _Shard:
    shard_id: Any  # None for an unfused layer
    tensors: dict[str, torch.Tensor]
    dequantized: torch.Tensor  # [rows, in] fp32
    bias: torch.Tensor  # [rows] fp32


def _shards(quantize: Quantize, ids: list[Any], rows: list[int], in_features: int, gen) -> list[_Shard]:
    out = []
    for sid, n in zip(ids, rows, strict=True):
        w = torch.randn(n, in_features, generator=gen) * in_features**-0.5
        tensors, deq = quantize(w)
        assert tuple(deq.shape) == (n, in_features), f"quantize returned a dequantized weight of shape {tuple(deq.shape)}"
        out.append(_Shard(sid, dict(tensors), deq.float(), 0.1 * torch.randn(n, generator=gen)))
    return out


def _load(layer, shards: list[_Shard], where: str, tp: int) -> None:
    """Load the shards' tensors through the one path the model loader calls each parameter's
    `weight_loader` by (`weight_utils`: its dtype and shape checks included)."""
    params = dict(layer.named_parameters(recurse=False))
    given = set().union(*(s.tensors for s in shards)) | ({"bias"} if layer.bias is not None else set())
    missing, extra = sorted(set(params) - given), sorted(given - set(params))
    assert not missing, f"{where}: quantize() gave no checkpoint tensor for parameter(s) {missing}"
    assert not extra, f"{where}: the layer has no parameter(s) {extra} that quantize() produced"
    for shard in shards:
        tensors = dict(shard.tensors)
        if layer.bias is not None:
            tensors["bias"] = shard.bias
        for name, tensor in tensors.items():
            param = params[name]
            try:
                load_into(param, tensor, shard.shard_id, name=name, target=name)
            except CheckpointDtypeError as e:
                raise AssertionError(f"{where}: {e}. quantize() must return each tensor in the dtype create_weights "
                                     "registered for its parameter") from e
            except Exception as e:
                cause = e.__cause__ if e.__cause__ is not None else e  # the layer loader's own words
                # only a split can be cut along the wrong dim; unsplit, the shape create_weights registered is off
                hint = ("A parameter split across tensor-parallel ranks needs `output_dim` (column-parallel) and "
                        "`input_dim` (row-parallel) attributes, and the layer's own `weight_loader` (see "
                        "docs/contracts.md)") if tp > 1 else (
                        "Unsplit, the parameter create_weights registers must have the shape of the whole checkpoint "
                        "tensor quantize() returns: check the shape create_weights gives it for these input_size / "
                        "output_sizes")
                raise AssertionError(
                    f"{where}: loading {name!r} (shard {shard.shard_id!r}, checkpoint shape {tuple(tensor.shape)}) "
                    f"into a parameter of shape {tuple(param.shape)} failed: {cause!r}. {hint}") from e


@contextmanager
def _step(where: str, step: str) -> Iterator[None]:
    """The method under test raising in `step` is a kit failure naming the case and the step, the
    method's exception chained (its traceback shows where in the method)."""
    try:
        yield
    except Exception as e:
        raise AssertionError(f"{where}: {step} raised {type(e).__name__}: {e}") from e


def _method_name(method: Callable[[], QuantMethod]) -> str:
    """The class the kit's messages name: that of the instance `method()` builds (the docs' `lambda:
    M.from_config(...)` has no useful `__name__`)."""
    with _step("building the method under test", "method()"):
        return type(method()).__name__


def _local(shards: list[_Shard], rank: int, tp: int, replicas: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows of the fused dequantized weight and bias (column parallel)."""
    ws, bs = [], []
    for i, s in enumerate(shards):
        parts = tp // (replicas[i] if replicas else 1)
        size = s.dequantized.shape[0] // parts
        r = rank // (replicas[i] if replicas else 1)
        ws.append(s.dequantized[r * size : (r + 1) * size])
        bs.append(s.bias[r * size : (r + 1) * size])
    return torch.cat(ws), torch.cat(bs)


def _assert_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, tol: float, where: str,
                  reference: str = "x @ dequant(W).T + b") -> None:
    assert got.dtype == x.dtype, f"{where}: apply returned {got.dtype} for {x.dtype} input"
    assert tuple(got.shape) == tuple(want.shape), f"{where}: output shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.double().cpu() - want).norm().item() / max(want.norm().item(), 1e-12)
    assert err < tol, f"{where}: relative error {err:.2e} >= {tol:.0e} against {reference}"


@single_threaded
def check_quant_method(
    method: Callable[[], QuantMethod],
    quantize: Quantize,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    unit: int = 16,
    tolerance: float | None = None,
    seed: int = 0,
    tp_sizes: tuple[int, ...] = (1, 2),
) -> None:
    """Run a QuantMethod against its dequantized reference; raise AssertionError naming the layer.

    :param method: the class (built with no arguments) or a callable returning an instance.
    :param quantize: `quantize(w)` for a float32 CPU weight `[out, in]` returns
        `(tensors, dequantized)`: the checkpoint tensors of one linear layer keyed by the parameter
        names your `create_weights` registers (e.g. {"weight": ..., "weight_scale": ...}), and the
        float weight they stand for. Fused layers get one call per shard (q, k, v; gate, up).
    :param dtype, device: the layers' parameter dtype and the input's dtype and device.
    :param unit: size step; input features are 4*unit (2*unit per rank when split in two), output
        features multiples of unit. Raise it to your block size if you quantize in blocks.
    :param tolerance: largest relative error of the output (default by dtype: 1e-3 fp32,
        5e-3 fp16, 2e-2 bf16), on top of what quantize's dequantized weight already loses.
    :param tp_sizes: the tensor-parallel splits each parallel layer is checked at, out of (1, 2).
        Keep 2 where you can: it is what catches a parameter without `input_dim` / `output_dim`.
        `(1,)` is for a mode that is right only unsplit (an online mode whose per-row scale a rank
        would compute from its own columns); such a method must leave `supports_tensor_parallel`
        False, which the kit then checks. Added in plugin API 1.7.
    """
    if not tp_sizes or any(tp not in (1, 2) for tp in tp_sizes):
        raise ValueError(f"tp_sizes={tp_sizes!r}: a non-empty choice out of (1, 2)")
    name = _method_name(method)
    if 2 not in tp_sizes and getattr(method(), "supports_tensor_parallel", False):
        raise AssertionError("tp_sizes leaves out the 2-rank split, but the method declares supports_tensor_parallel")
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCE[dtype]
    gen = torch.Generator().manual_seed(seed)
    d_in, d_out, inter, head = 4 * unit, 3 * unit, 2 * unit, unit
    x = (torch.randn(5, d_in, generator=gen)).to(dtype).to(device)
    x64 = x.double().cpu()

    def build(make, where):
        with _step(where, "building the layer (create_weights)"), torch.device(device):
            return make(method())

    def finish(layer, where):
        with _step(where, "process_weights_after_loading"):
            layer.quant_method.process_weights_after_loading(layer)
        return layer

    def apply(layer, where, inp, bias):
        with _step(where, f"apply on {tuple(inp.shape)} input"):
            return layer.quant_method.apply(layer, inp, bias)

    # replicated, and column-parallel over 1 and 2 ranks
    shards = _shards(quantize, [None], [d_out], d_in, gen)
    w, b = _local(shards, 0, 1)
    for tp in tp_sizes:
        outs = []
        for rank in range(tp):
            where = f"{name}: ColumnParallelLinear tp rank {rank} of {tp}"
            layer = build(lambda qm, rank=rank, tp=tp: ColumnParallelLinear(d_in, d_out, True, qm, rank, tp,
                                                                            params_dtype=dtype), where)
            _load(layer, shards, where, tp)
            finish(layer, where)
            outs.append(apply(layer, where, x, layer.bias))
        _assert_close(torch.cat(outs, dim=-1), x64 @ w.double().T + b.double(), x, tol, f"{name}: ColumnParallelLinear tp {tp}")
    where = f"{name}: ReplicatedLinear"
    layer = build(lambda qm: ReplicatedLinear(d_in, d_out, True, qm, params_dtype=dtype), where)
    _load(layer, shards, where, 1)
    finish(layer, where)
    _assert_close(apply(layer, where, x, layer.bias), x64 @ w.double().T + b.double(), x, tol, where)
    where = f"{name}: ReplicatedLinear, processed twice"
    finish(layer, where)  # process_weights_after_loading must be idempotent in effect
    _assert_close(apply(layer, where, x, layer.bias), x64 @ w.double().T + b.double(), x, tol, where)

    # row-parallel over 1 and 2 ranks: each rank sees its slice of the input features
    for tp in tp_sizes:
        total = 0
        for rank in range(tp):
            where = f"{name}: RowParallelLinear tp rank {rank} of {tp}"
            layer = build(lambda qm, rank=rank, tp=tp: RowParallelLinear(d_in, d_out, True, qm, rank, tp,
                                                                         params_dtype=dtype), where)
            _load(layer, shards, where, tp)
            finish(layer, where)
            part = x[:, rank * d_in // tp : (rank + 1) * d_in // tp]
            total = total + apply(layer, where, part, layer.bias if rank == 0 else None).double()
        _assert_close(total.to(x.dtype), x64 @ w.double().T + b.double(), x, tol, f"{name}: RowParallelLinear tp {tp}")

    # fused layers, loaded shard by shard
    gate_up = _shards(quantize, [0, 1], [inter, inter], d_in, gen)
    qkv = _shards(quantize, ["q", "k", "v"], [4 * head, 2 * head, 2 * head], d_in, gen)
    for tp in tp_sizes:
        for kind, shards_, make in (
            ("MergedColumnParallelLinear (gate_up)", gate_up,
             lambda qm, rank, tp: MergedColumnParallelLinear(d_in, [inter, inter], True, qm, rank, tp, params_dtype=dtype)),
            ("QKVParallelLinear", qkv,
             lambda qm, rank, tp: QKVParallelLinear(d_in, head, 4, 2, True, qm, rank, tp, params_dtype=dtype)),
        ):
            for rank in range(tp):
                where = f"{name}: {kind} tp rank {rank} of {tp}"
                layer = build(lambda qm, make=make, rank=rank, tp=tp: make(qm, rank, tp), where)
                _load(layer, shards_, where, tp)
                finish(layer, where)
                w_r, b_r = _local(shards_, rank, tp)
                _assert_close(apply(layer, where, x, layer.bias), x64 @ w_r.double().T + b_r.double(), x, tol, where)


@single_threaded
def check_quant_method_moe(
    method: Callable[[], QuantMethod],
    quantize: Quantize,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    unit: int = 16,
    num_experts: int = 4,
    top_k: int = 2,
    tolerance: float | None = None,
    seed: int = 0,
) -> None:
    """Run a QuantMethod's MoE hooks (`create_moe_weights`, `process_moe_weights_after_loading`,
    `apply_moe`) against the dequantized experts; raise AssertionError naming the step.

    A `FusedMoE` layer (hidden 4*unit, intermediate 2*unit, `num_experts` experts) is built with
    the method; each expert's gate, up and down matrix goes through `quantize`, and every tensor it
    returns is loaded as a checkpoint loader loads it: named as in a checkpoint
    (`....experts.{e}.gate_proj.<suffix>`), mapped by `FusedMoE.map_checkpoint_name` (to
    `w13_<suffix>` for gate and up, `w2_<suffix>` for down) and loaded through the layer's loader
    with its shard id and expert id; then `apply_moe` on 1 and 7 tokens (distinct experts per token,
    fp32 routing weights) must equal `sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))` of the
    dequantized weights.

    :param method, quantize, dtype, device, unit, tolerance, seed: as for `check_quant_method`;
        `quantize(w)` must return tensors named by the suffixes the method's expert parameters
        use (e.g. {"weight": ..., "weight_scale_inv": ...} for `w13_weight`, `w13_weight_scale_inv`;
        any suffix that is one identifier, as a pre-quantized checkpoint may name them).
    :param num_experts, top_k: the layer's experts and the experts each token uses.

    Added in plugin API 1.5."""
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCE[dtype]
    gen = torch.Generator().manual_seed(seed)
    name = _method_name(method)
    hidden, inter = 4 * unit, 2 * unit
    where = f"{name}: FusedMoE ({num_experts} experts, top-{top_k})"
    with _step(where, "building the layer (create_moe_weights)"), torch.device(device):
        layer = FusedMoE(num_experts, hidden, inter, RoutingConfig(top_k=top_k), quant_method=method(),
                         prefix="kit.experts", params_dtype=dtype)
    params = dict(layer.named_parameters(recurse=False))
    proj = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    experts: list[dict[str, torch.Tensor]] = []
    for e in range(num_experts):
        deq = {}
        for shard, (rows, cols) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            tensors, deq[shard] = quantize(torch.randn(rows, cols, generator=gen) * cols**-0.5)
            for suffix, tensor in tensors.items():
                checkpoint_name = f"kit.experts.{e}.{proj[shard]}.{suffix}"
                mapped = FusedMoE.map_checkpoint_name(checkpoint_name)  # as load_stacked_weights maps it
                assert mapped is not None, (f"{name}: quantize() gave {suffix!r} for the {shard} matrix, but a checkpoint "
                                            f"tensor {checkpoint_name!r} maps to no expert parameter "
                                            "(FusedMoE.map_checkpoint_name: the suffix must be one identifier)")
                pname = mapped[0].rpartition(".")[2]
                assert pname in params, (f"{name}: quantize() gave {suffix!r} for the {shard} matrix, but the MoE layer "
                                         f"has no parameter {pname!r} (it has {sorted(params)})")
                assert getattr(params[pname], "weight_loader", None) is not None, (
                    f"{name}: MoE parameter {pname!r} has no weight_loader (use layer.weight_loader)")
                try:
                    load_into(params[pname], tensor, mapped[2], name=checkpoint_name, target=pname, expert_id=e)
                except Exception as err:
                    raise AssertionError(f"{name}: loading expert {e}'s {shard} {suffix!r} (checkpoint shape "
                                         f"{tuple(tensor.shape)}, {tensor.dtype}) into {pname!r} "
                                         f"{tuple(params[pname].shape)} {params[pname].dtype} failed: {err}") from err
        experts.append({k: v.double() for k, v in deq.items()})
    missing = layer.incomplete_params()
    assert not missing, f"{name}: MoE parameters {missing} were not filled by the per-expert tensors quantize() gave"
    with _step(where, "process_moe_weights_after_loading"):
        layer.quant_method.process_moe_weights_after_loading(layer)

    for tokens in (1, 7):
        x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
        weights = torch.rand(tokens, top_k, generator=gen).softmax(-1)
        want = torch.zeros(tokens, hidden, dtype=torch.float64)
        x64 = x.double().cpu()
        for t in range(tokens):
            for k in range(top_k):
                w = experts[int(ids[t, k])]
                act = torch.nn.functional.silu(x64[t] @ w["gate"].T) * (x64[t] @ w["up"].T)
                want[t] += float(weights[t, k]) * (act @ w["down"].T)
        step = f"apply_moe on {tokens} token(s), top-{top_k} of {num_experts}"
        with _step(f"{name}: FusedMoE", step):
            got = layer.quant_method.apply_moe(layer, x, weights.to(device), ids.to(device))
        _assert_close(got, want, x, tol, f"{name}: {step}",
                      "the routed sum over the dequantized experts, sum_k w_k * down(silu(gate x) * up x)")
