"""Swap known transformers modules for RadixServe's fused layers (the fallback's fast path).

transformers' own modules run many small kernels: an RMSNorm is ~7 elementwise kernels, a gated
MLP two GEMMs plus an activation and a multiply, attention three GEMMs and ~10 kernels of rotary
in torch ops. After the HF model is built (before the probe and before any weight loads), the
modules whose class is in one of the tables below are replaced:

- RMSNorm (x * rsqrt(mean(x^2) + eps), cast, times `weight`) -> `radixserve.layers.norm.RMSNorm`
  (one kernel), sharing the original `weight` parameter;
- gated SiLU MLP (down(silu(gate(x)) * up(x))) -> one `gate_up_proj` GEMM + `SiluAndMul`;
- Llama-style attention (q/k/v/o Linear layers, neox rotary from the model's own cos/sin) -> one
  `qkv_proj` GEMM + one rotary kernel, then transformers' attention interface as before.

Every table entry is a class whose forward was read and compared with Llama's (transformers 5.x);
each replacement is also checked numerically against the module it replaces on a random input
(random weights for norms) and the original is kept when they disagree or the class does not have
the expected structure (e.g. an MLP whose `act_fn` is not SiLU). Anything else runs unchanged.

Fused parameters keep the checkpoint's names loadable: `shards` maps each original parameter name
(`...mlp.gate_proj.weight`) to the fused parameter and the rows it fills (see weights.py)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from radixserve.layers import triton_ops
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.norm import RMSNorm

logger = logging.getLogger(__name__)

# Forward identical to LlamaRMSNorm's (fp32 statistics, cast to the input dtype, then * weight).
# Not here on purpose: Gemma-style (1 + weight) norms, Olmo2/T5-style variants that multiply before
# the cast, norms with a bias or an offset.
RMSNORM_CLASSES = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "MinistralRMSNorm", "Qwen2RMSNorm", "Qwen2MoeRMSNorm",
    "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Phi3RMSNorm", "GraniteRMSNorm", "GraniteMoeRMSNorm", "DeepseekV2RMSNorm",
    "DeepseekV3RMSNorm", "SmolLM3RMSNorm", "OlmoeRMSNorm", "GlmRMSNorm", "Glm4RMSNorm", "Ernie4_5RMSNorm",
    "Exaone4RMSNorm", "HunYuanDenseV1RMSNorm", "ArceeRMSNorm", "SeedOssRMSNorm", "ApertusRMSNorm",
})
# Forward `down_proj(act_fn(gate_proj(x)) * up_proj(x))` as LlamaMLP's; replaced only when act_fn is SiLU.
GATED_MLP_CLASSES = frozenset({
    "LlamaMLP", "MistralMLP", "MinistralMLP", "Qwen2MLP", "Qwen2MoeMLP", "Qwen3MLP", "Qwen3MoeMLP", "GraniteMLP",
    "DeepseekV2MLP", "DeepseekV3MLP", "SmolLM3MLP", "OlmoMLP", "Olmo2MLP", "Olmo3MLP", "OlmoeMLP", "HeliumMLP",
    "Ernie4_5MLP", "Exaone4MLP", "HunYuanDenseV1MLP", "SeedOssMLP",
})


def _no_extra(module: nn.Module) -> dict:
    return {}


# Forward as LlamaAttention's (and its module's apply_rotary_pos_emb/rotate_half as Llama's); the
# value: the extra keyword arguments the class passes to the attention function. Not here: Helium
# (same forward, interleaved rotary), Qwen3/Olmo2 (q/k norms), Glm (partial interleaved rotary).
LLAMA_ATTENTION_CLASSES: dict[str, Callable[[nn.Module], dict]] = {
    "LlamaAttention": _no_extra,
    "GraniteAttention": _no_extra,
    "Qwen2MoeAttention": _no_extra,
    "MistralAttention": lambda m: {"sliding_window": getattr(m.config, "sliding_window", None)},
    "Qwen2Attention": lambda m: {"sliding_window": m.sliding_window},
}


@dataclass(frozen=True)
class Shard:
    """A checkpoint tensor that now fills rows [start, start + size) of fused parameter `target`."""

    target: str
    start: int
    size: int


@dataclass
class FusionReport:
    shards: dict[str, Shard]
    replaced: Counter  # "LlamaRMSNorm -> RMSNorm" -> count
    kept: Counter  # "LlamaMLP (act_fn GELU)" -> count: table classes left as they were
    skipped: str = ""  # why nothing was even tried (the meta device)

    def summary(self) -> str:
        """The INFO line's text; logged for every model, so "nothing fused" is said too."""
        if self.skipped:
            return f"replaced 0 modules with fused layers ({self.skipped})"
        done = ", ".join(f"{n} {what}" for what, n in sorted(self.replaced.items())) or "none"
        text = f"replaced {sum(self.replaced.values())} module(s) with fused layers: {done}"
        if self.kept:
            text += "; kept " + ", ".join(f"{n} {why}" for why, n in sorted(self.kept.items()))
        elif not self.replaced:
            text += " (no module of a class in the fused-layer tables: transformers' own modules run)"
        return text


# ---- the replacement modules -------------------------------------------------------------------
class FusedRMSNorm(RMSNorm):
    """RadixServe's RMSNorm on any leading shape (CPU fp32 kernels want a matrix)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


class FusedGatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) as one [gate | up] GEMM and one activation kernel."""

    def __init__(self, gate_up_proj: nn.Linear, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        return self.down_proj(self.act(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], -1))


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
           kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary as transformers' Llama `apply_rotary_pos_emb`, on q `[b, n, hq * head_dim]` and
    k `[b, n, hkv * head_dim]` with cos/sin `[b, n, head_dim]`; returns rotated `[b, n, heads, head_dim]`.
    `kernel` (default: CUDA tensors with b == 1) uses the one-launch Triton kernel (same roundings)."""
    b, n = q.shape[:2]
    if kernel is None:
        kernel = triton_ops.available(q) and b == 1 and cos.dtype == q.dtype and cos.shape[-1] == head_dim
    if kernel:
        q_rot, k_rot = triton_ops.rotary(q.reshape(n, -1), k.reshape(n, -1), cos.reshape(n, -1), sin.reshape(n, -1),
                                         head_dim, head_dim)
        return q_rot.view(b, n, -1, head_dim), k_rot.view(b, n, -1, head_dim)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)

    def one(x):
        x = x.view(b, n, -1, head_dim)
        half = head_dim // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return one(q), one(k)


class FusedQKVAttention(nn.Module):
    """A Llama-style attention module with q/k/v as one GEMM and rotary as one kernel; it calls
    transformers' attention function (here: RadixServe's) exactly as the replaced module did and
    carries the replaced module's plain attributes (config, scaling, layer_idx, is_causal, ...)."""

    def __init__(self, original: nn.Module, qkv_proj: nn.Linear, sizes: tuple[int, int, int],
                 extra_kwargs: dict) -> None:
        super().__init__()
        for name, value in vars(original).items():
            if not name.startswith("_") and not isinstance(value, (nn.Module, torch.Tensor)):
                setattr(self, name, value)
        self.qkv_proj = qkv_proj
        self.o_proj = original.o_proj
        self.sizes = sizes
        self.head_dim = int(original.head_dim)
        self.extra_kwargs = extra_kwargs
        self.eager = _module_function(original, "eager_attention_forward")

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        input_shape = hidden_states.shape[:-1]
        q, k, v = self.qkv_proj(hidden_states).split(self.sizes, dim=-1)
        cos, sin = position_embeddings
        q, k = rotate(q, k, cos, sin, self.head_dim)
        query, key = q.transpose(1, 2), k.transpose(1, 2)
        value = v.view(*input_shape, -1, self.head_dim).transpose(1, 2)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self.eager)
        out, weights = attend(self, query, key, value, attention_mask,
                              dropout=0.0 if not self.training else self.attention_dropout,
                              scaling=self.scaling, **self.extra_kwargs, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


# ---- building and checking them ----------------------------------------------------------------
def _module_function(module: nn.Module, name: str):
    import sys

    return getattr(sys.modules[type(module).__module__], name, None)


def _fuse_linears(parts: list[nn.Linear]) -> nn.Linear | None:
    """One Linear computing the parts' outputs side by side, or None when they cannot be fused
    (not plain Linear layers, different inputs, dtypes or devices, bias on some only)."""
    if not all(type(p) is nn.Linear for p in parts):
        return None
    first = parts[0].weight
    if any(p.in_features != parts[0].in_features or p.weight.dtype != first.dtype or p.weight.device != first.device
           for p in parts) or len({p.bias is None for p in parts}) != 1:
        return None
    bias = parts[0].bias is not None
    # built on meta, then given the concatenations: one allocation per fused parameter
    fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=bias, device="meta")
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        if bias:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


def _shards_of(prefix: str, names: list[str], parts: list[nn.Linear], target: str) -> dict[str, Shard]:
    out, start = {}, 0
    for name, part in zip(names, parts, strict=True):
        out[f"{prefix}{name}.weight"] = Shard(f"{prefix}{target}.weight", start, part.out_features)
        if part.bias is not None:
            out[f"{prefix}{name}.bias"] = Shard(f"{prefix}{target}.bias", start, part.out_features)
        start += part.out_features
    return out


def _agrees(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    if not isinstance(ours, torch.Tensor) or ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return False
    tol = 1e-4 if ours.dtype == torch.float32 else 3e-2
    scale = float(theirs.float().abs().max()) + 1e-6
    return bool(torch.isfinite(ours).all()) and float((ours.float() - theirs.float()).abs().max()) <= tol * scale


def _sample(module: nn.Module, width: int, tokens: int = 5) -> torch.Tensor:
    p = next(module.parameters())
    gen = torch.Generator(device=p.device).manual_seed(0)
    return torch.randn(1, tokens, width, generator=gen, device=p.device).to(p.dtype)


def _replace_norm(module: nn.Module) -> tuple[nn.Module | None, str]:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float) \
            or getattr(module, "bias", None) is not None:
        return None, "unexpected structure"
    ours = FusedRMSNorm(weight.shape[0], eps)
    ours.weight = weight  # the same Parameter: its name and loading do not change
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.normal_(generator=torch.Generator(device=weight.device).manual_seed(1))
            x = _sample(module, weight.shape[0])
            ok = _agrees(ours(x), module(x))
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    return (ours, "") if ok else (None, "self-check mismatch")


def _replace_mlp(module: nn.Module, prefix: str, shards: dict) -> tuple[nn.Module | None, str]:
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj")]
    down = getattr(module, "down_proj", None)
    act = type(getattr(module, "act_fn", None))
    if not issubclass(act, nn.SiLU) and act.__name__ != "SiLUActivation":  # transformers' "silu"
        return None, f"act_fn {act.__name__}"
    if not isinstance(down, nn.Module) or any(p is None for p in parts):
        return None, "unexpected structure"
    gate_up = _fuse_linears(parts)
    if gate_up is None:
        return None, "projections not fusable"
    ours = FusedGatedMLP(gate_up, down)
    with torch.no_grad():
        x = _sample(module, parts[0].in_features)
        if not _agrees(ours(x), module(x)):
            return None, "self-check mismatch"
    shards.update(_shards_of(prefix, ["gate_proj", "up_proj"], parts, "gate_up_proj"))
    return ours, ""


def _replace_attention(module: nn.Module, prefix: str, shards: dict) -> tuple[nn.Module | None, str]:
    names = ["q_proj", "k_proj", "v_proj"]
    parts = [getattr(module, n, None) for n in names]
    head_dim = getattr(module, "head_dim", None)
    if any(p is None for p in parts) or not isinstance(getattr(module, "o_proj", None), nn.Module) \
            or not isinstance(head_dim, int) or head_dim % 2 or any(p.out_features % head_dim for p in parts if p):
        return None, "unexpected structure"
    qkv = _fuse_linears(parts)
    if qkv is None:
        return None, "projections not fusable"
    extra = LLAMA_ATTENTION_CLASSES[type(module).__name__](module)
    ours = FusedQKVAttention(module, qkv, tuple(p.out_features for p in parts), extra)
    if not _attention_agrees(module, ours, parts[0].in_features, head_dim):
        return None, "self-check mismatch"
    shards.update(_shards_of(prefix, names, parts, "qkv_proj"))
    return ours, ""


_CHECK_IMPLEMENTATION = "radixserve_fusion_check"


def _check_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain softmax attention over every key (a reference both modules run through), recording
    the non-tensor arguments each module passes."""
    module._check_kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    module._check_kwargs["scaling"] = scaling
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    probs = torch.softmax((query.float() @ key.float().transpose(-1, -2)) * (scaling or 1.0), dim=-1)
    return (probs @ value.float()).to(query.dtype).transpose(1, 2), None


def _attention_agrees(original: nn.Module, ours: nn.Module, width: int, head_dim: int) -> bool:
    from transformers import AttentionInterface

    AttentionInterface.register(_CHECK_IMPLEMENTATION, _check_attention)
    config = original.config
    saved = config._attn_implementation
    x = _sample(original, width)
    gen = torch.Generator(device=x.device).manual_seed(2)
    angles = torch.randn(1, x.shape[1], head_dim // 2, generator=gen, device=x.device) * 3
    emb = torch.cat((angles, angles), dim=-1)
    cos_sin = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
    try:
        config._attn_implementation = _CHECK_IMPLEMENTATION
        with torch.no_grad():
            theirs = original(hidden_states=x, position_embeddings=cos_sin, attention_mask=None)[0]
            mine = ours(hidden_states=x, position_embeddings=cos_sin, attention_mask=None)[0]
    except Exception as e:  # a forward that does not take these arguments: keep the original
        logger.debug("fused attention check failed for %s: %r", type(original).__name__, e)
        return False
    finally:
        config._attn_implementation = saved
    same_args = getattr(original, "_check_kwargs", None) == getattr(ours, "_check_kwargs", None)
    for m in (original, ours):
        m.__dict__.pop("_check_kwargs", None)
    return same_args and _agrees(mine, theirs)


def fuse_modules(model: nn.Module) -> FusionReport:
    """Replace the known modules of `model` in place (see the module docstring); return the
    checkpoint-name shards of the fused parameters and what was replaced or kept. A model on the
    meta device (nothing to check numerically) is left as it is."""
    report = FusionReport({}, Counter(), Counter())
    try:
        if next(model.parameters()).device.type == "meta":
            report.skipped = "meta device: no numbers to check a replacement against"
            return report
    except StopIteration:
        report.skipped = "the model has no parameters"
        return report
    # by name, looked up one at a time: a replaced module (and its unfused weights) is freed at once
    for name in [n for n, _ in model.named_modules()]:
        try:
            module = model.get_submodule(name)
        except AttributeError:  # inside a module replaced already
            continue
        cls = type(module).__name__
        prefix = f"{name}." if name else ""
        if cls in RMSNORM_CLASSES:
            replace, kind = (lambda m, _p: _replace_norm(m)), "RMSNorm kernel"
        elif cls in GATED_MLP_CLASSES:
            replace, kind = (lambda m, p: _replace_mlp(m, p, report.shards)), "gate_up GEMM + SiluAndMul"
        elif cls in LLAMA_ATTENTION_CLASSES:
            replace, kind = (lambda m, p: _replace_attention(m, p, report.shards)), "qkv GEMM + rotary kernel"
        else:
            continue
        try:
            ours, why = replace(module, prefix)
        except Exception as e:  # e.g. a kernel that does not build here: the fallback still runs unfused
            ours, why = None, f"self-check failed: {type(e).__name__}"
            logger.warning("fused replacement of %s at %s failed its self-check (%r): kept", cls, name, e)
        if ours is None:
            report.kept[f"{cls} ({why})"] += 1
            if why == "self-check mismatch":
                logger.warning("%s at %s disagrees with its fused replacement on a random input: kept", cls, name)
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, ours)
        del module
        report.replaced[f"{cls} -> {kind}"] += 1
    if report.shards and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the unfused copies' blocks, so the KV pool can size itself on them
    return report
