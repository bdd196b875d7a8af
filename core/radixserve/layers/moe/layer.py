"""FusedMoE: the routed experts of an MoE block, with stacked expert weights.

Parameters (created by the layer's QuantMethod; unquantized: `w13_weight` [E, 2I, H], gate rows
then up rows, and `w2_weight` [E, H, I]) load through one loader,
`weight_loader(param, loaded, shard_id=None, expert_id=None)`:
- `expert_id=e, shard_id="gate" | "up" | "down"` (aliases "w1", "w3", "w2" as Mixtral names
  them): one expert's HF matrix, e.g. `experts.3.up_proj.weight` [I, H];
- `expert_id=None, shard_id=None`: the whole stack as transformers 5 stores it
  (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]);
- `expert_id=None, shard_id="gate" | "up"`: one half for every expert ([E, I, H]).
`FusedMoE.map_checkpoint_name(...)` tells a model's `load_weights` where a checkpoint's expert
tensor goes (both layouts)."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn as nn

from radixserve.interfaces.quantization import QuantMethod
from radixserve.layers.moe import small_m
from radixserve.layers.moe.routing import RoutingConfig, select_experts
from radixserve.layers.norm import RMSNorm
from radixserve.layers.quant_unquantized import UnquantizedMethod

_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.")
# a per-expert tensor's suffix (`weight`, fp8's `weight_scale_inv`, an int8 `weight_scale`, int4's `qweight`,
# `scales`, ...): whatever names the layer's QuantMethod gave its `w13_<suffix>` / `w2_<suffix>` parameters
_EXPERT_TENSOR_SUFFIX = re.compile(r"\w+")
_SHARD_ALIASES = {"gate": "gate", "w1": "gate", "up": "up", "w3": "up", "down": "down", "w2": "down"}


class FusedMoE(nn.Module):
    """Routed experts: `forward(x [T, H], router_logits [T, E]) -> [T, H]`, the sum over each
    token's top-k experts of weight * down(silu(gate(x)) * up(x)).

    :param num_experts: E.
    :param hidden_size: H.
    :param intermediate_size: I, each expert's (full, unsharded) intermediate width.
    :param routing: the router's rule (top-k, scoring, renormalisation, groups, scaling).
    :param quant_method: creates and applies the expert weights (default unquantized); a method
        without MoE support refuses at construction, naming itself and `prefix`.
    :param correction_bias: register `e_score_correction_bias` [E] (DeepSeek-V3), used by the
        router to choose experts only.
    :param prefix: the layer's parameter-name prefix, for error messages.
    :param tp_rank, tp_size: tensor parallelism; only tp_size=1 is implemented.

    Added in plugin API 1.3."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, routing: RoutingConfig,
                 quant_method: QuantMethod | None = None, correction_bias: bool = False, prefix: str = "",
                 tp_rank: int = 0, tp_size: int = 1, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if tp_size != 1:
            raise NotImplementedError(f"FusedMoE {prefix or ''} with tp_size={tp_size}: expert tensor parallelism "
                                      "is not implemented yet (run MoE models with tp_size=1)")
        routing.validate(num_experts)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.routing = routing
        self.prefix = prefix
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.quant_method = quant_method or UnquantizedMethod()
        self._loaded_parts: dict[str, set] = {}  # parameter -> {(expert, half)} loaded so far
        dtype = params_dtype or torch.get_default_dtype()
        self.quant_method.create_moe_weights(self, num_experts, hidden_size, intermediate_size, dtype)
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)
        # per-token arrival counters of the one-launch router (forward_with_gate), zeros between launches
        self.register_buffer("_gate_arrivals", torch.zeros(small_m.SMALL_M_MAX_PAIRS, dtype=torch.int32),
                             persistent=False)

    @staticmethod
    def map_checkpoint_name(name: str, gate: str = "gate_proj", up: str = "up_proj",
                            down: str = "down_proj") -> tuple[str, int | None, str | None] | None:
        """Where an expert tensor of the checkpoint goes: (parameter name, expert id, shard id) for
        this layer's `weight_loader`, or None for a name that is not an expert tensor.

        Per-expert names `....experts.{e}.{gate|up|down}.<suffix>` (Mixtral: gate="w1", up="w3",
        down="w2") map to `....experts.w13_<suffix>` (gate, up) / `w2_<suffix>` (down) with expert e,
        for any suffix that is one identifier: `weight`, and whatever the layer's QuantMethod named its
        other expert parameters (block FP8's `weight_scale_inv`, a per-row `weight_scale`, int4's
        `qweight` / `scales` / `qzeros`). The caller checks that the layer has the parameter
        (`load_stacked_weights` refuses a tensor whose parameter it lacks, naming those it has).
        The stacked names of transformers 5 (`....experts.gate_up_proj`, `....experts.down_proj`) map
        whole. Any suffix since plugin API 1.14 (before: `weight` and `weight_scale_inv` only)."""
        match = _PER_EXPERT.search(name)
        if match is not None:
            shard = {gate: "gate", up: "up", down: "down"}.get(match.group(2))
            suffix = name[match.end():]  # "weight", or a quantized format's companion ("weight_scale", "scales")
            if shard is None or not _EXPERT_TENSOR_SUFFIX.fullmatch(suffix):
                return None
            param = ("experts.w13_" if shard != "down" else "experts.w2_") + suffix
            return name[: match.start()] + "." + param, int(match.group(1)), shard
        for stacked, param in ((".experts.gate_up_proj", "experts.w13_weight"),
                               (".experts.down_proj", "experts.w2_weight")):
            if name.endswith(stacked):
                return name[: -len(stacked)] + "." + param, None, None
        return None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None,
                      expert_id: int | None = None) -> None:
        """Copy a checkpoint tensor into a stacked expert parameter (see the module docstring for
        the accepted (shard_id, expert_id) forms). Raises ValueError naming a bad id or shape."""
        shard = None
        if shard_id is not None:
            shard = _SHARD_ALIASES.get(shard_id)
            if shard is None:
                raise ValueError(f"{self.prefix}: unknown expert shard id {shard_id!r} "
                                 f"(expected one of {', '.join(_SHARD_ALIASES)})")
        if expert_id is not None and not 0 <= int(expert_id) < self.num_experts:
            raise ValueError(f"{self.prefix}: expert id {expert_id} out of range (the layer has {self.num_experts})")
        target = param.data if expert_id is None else param.data[int(expert_id)]
        if shard in ("gate", "up") and getattr(param, "moe_fused_dim", None) is not None:
            dim = param.moe_fused_dim - (0 if expert_id is None else 1)
            half = target.shape[dim] // 2
            target = target.narrow(dim, 0 if shard == "gate" else half, half)
        if tuple(target.shape) != tuple(loaded.shape):
            what = ("every expert's stacked tensor" if expert_id is None else f"expert {expert_id}'s tensor") + \
                ("" if shard_id is None else f" ({shard} projection)")
            raise ValueError(f"{self.prefix}: {what} has shape {tuple(loaded.shape)}, the parameter expects "
                             f"{tuple(target.shape)}")
        target.copy_(loaded.to(target.dtype))
        self._record_loaded(param, shard, expert_id)

    def _record_loaded(self, param: torch.Tensor, shard: str | None, expert_id: int | None) -> None:
        name = next(n for n, p in self.named_parameters(recurse=False) if p is param)
        halves = ("gate", "up") if getattr(param, "moe_fused_dim", None) is not None else (None,)
        experts = range(self.num_experts) if expert_id is None else (int(expert_id),)
        parts = halves if shard is None or shard == "down" else (shard,)
        self._loaded_parts.setdefault(name, set()).update((e, h) for e in experts for h in parts)

    def incomplete_params(self) -> list[str]:
        """Names (local to this layer) of expert parameters some expert's tensor has not reached yet:
        a model's `load_weights` leaves them out of its loaded set, so a checkpoint missing one
        expert is reported instead of running with uninitialised memory."""
        out = []
        for name, param in self.named_parameters(recurse=False):
            if name == "e_score_correction_bias":
                continue
            halves = 2 if getattr(param, "moe_fused_dim", None) is not None else 1
            if len(self._loaded_parts.get(name, ())) < self.num_experts * halves:
                out.append(name)
        return out

    def partly_loaded_parts(self) -> dict[str, list[tuple[int, str | None]]]:
        """Those of `incomplete_params()` that some expert's tensor did reach: name -> the (expert,
        half) parts still missing, half "gate" / "up" of the fused gate-up parameter, else None.
        `load_stacked_weights` names them in its error."""
        out = {}
        params = dict(self.named_parameters(recurse=False))
        for name in self.incomplete_params():
            got = self._loaded_parts.get(name)
            if not got:
                continue
            if getattr(params[name], "moe_fused_dim", None) is not None:
                out[name] = [(e, h) for e in range(self.num_experts) for h in ("gate", "up") if (e, h) not in got]
            else:
                have = {e for e, _ in got}
                out[name] = [(e, None) for e in range(self.num_experts) if e not in have]
        return out

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if small_m.fused_router_applies(router_logits, self.routing):  # decode batches on CUDA: one launch
            weights, ids = small_m.fused_select_experts(router_logits, self.routing, self.e_score_correction_bias)
        else:
            weights, ids = select_experts(router_logits, self.routing, self.e_score_correction_bias)
        return self.quant_method.apply_moe(self, x, weights, ids)

    def forward_with_gate(self, x: torch.Tensor, gate: nn.Module) -> torch.Tensor:
        """`forward(x, gate(x))` for a router `gate` (a linear layer): where the one-launch router
        applies (CUDA, a small batch, an unquantized bias-free gate in x's dtype, no expert groups:
        `small_m.fused_gate_applies`) the router's linear and its top-k run in one kernel
        (`small_m.fused_gate_select_experts`), otherwise exactly `forward(x, gate(x))`.
        Added in plugin API 1.6."""
        w = getattr(gate, "weight", None)
        if (isinstance(w, torch.Tensor) and getattr(gate, "bias", None) is None
                and isinstance(getattr(gate, "quant_method", None), UnquantizedMethod)
                and small_m.fused_gate_applies(x, w, self.routing, self._gate_arrivals)):
            weights, ids = small_m.fused_gate_select_experts(x, w, self.routing, self._gate_arrivals,
                                                             self.e_score_correction_bias)
            return self.quant_method.apply_moe(self, x, weights, ids)
        return self(x, gate(x))

    def forward_with_norm_gate(self, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                               gate: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The post-attention `x, res = norm(h, residual)` fused into the one-launch router of
        `forward_with_gate` (one launch fewer per layer): returns (experts' output, x, res), or None
        where the fusion does not apply (then call `norm` and `forward_with_gate` as usual). It
        applies where `forward_with_gate` fuses the router, `norm` is a `radixserve.layers.norm.RMSNorm`
        (not a subclass changing its forward) whose weight has h's dtype, and the residual has h's
        shape and dtype. On the H200 the router with the norm took 5.4 us against 6.1 us for the
        norm's launch + the router's (Qwen3-30B-A3B, 1 token).
        Added in plugin API 1.7."""
        w = getattr(gate, "weight", None)
        norm_w, eps = getattr(norm, "weight", None), getattr(norm, "eps", None)
        plain_rmsnorm = isinstance(norm, RMSNorm) and type(norm).forward is RMSNorm.forward  # not a variant
        if not (plain_rmsnorm
                and isinstance(w, torch.Tensor) and getattr(gate, "bias", None) is None
                and isinstance(getattr(gate, "quant_method", None), UnquantizedMethod)
                and isinstance(norm_w, torch.Tensor) and isinstance(eps, float) and norm_w.dtype == h.dtype
                and norm_w.shape == (h.shape[-1],) and residual is not None and residual.shape == h.shape
                and residual.dtype == h.dtype and h.dim() == 2
                and small_m.fused_gate_applies(h, w, self.routing, self._gate_arrivals)):
            return None
        x, res, weights, ids = small_m.fused_norm_gate_select_experts(
            h, residual, norm_w, eps, w, self.routing, self._gate_arrivals, self.e_score_correction_bias)
        return self.quant_method.apply_moe(self, x, weights, ids), x, res

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"top_k={self.routing.top_k}, scoring={self.routing.scoring}")
