"""Per-parameter weight loaders (nano-vllm style): each parameter carries `weight_loader`, so one
generic loop can load any model: `param.weight_loader(param, tensor[, shard_id])`;
`load_stacked_weights` is that loop for a decoder-only model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loader attributes to a parameter, e.g. `set_weight_attrs(w, {"output_dim": 0, "input_dim": 1,
    "weight_loader": layer.weight_loader})`: what the layers' loaders read (`weight_loader`, `output_dim`,
    `input_dim`, `packed_dim` + `pack_factor`, MoE's `moe_fused_dim`; docs/contracts.md section 6).
    Raises AttributeError for an attribute the parameter already has (a typo or a second call would
    otherwise silently replace it)."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


class CheckpointTensorError(ValueError):
    """A checkpoint the model cannot take: a tensor with no parameter, a shape a parameter's loader
    refuses, a fused parameter missing a shard. `tensor`: the checkpoint tensor to blame, or None;
    `load_model` adds the checkpoint path and the file holding that tensor."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor

    def __str__(self) -> str:  # not KeyError's repr() of the message (the subclass below)
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):  # picklable with its tensor
        return type(self), (str(self), self.tensor)


class UnknownCheckpointTensorError(CheckpointTensorError, KeyError):
    """A checkpoint tensor that maps to no parameter; also a KeyError, the type the Model contract
    named for it first."""


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole tensor into `param`; shapes must match exactly (no silent broadcasting)."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not fused; got shard_id={shard_id!r}")
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(loaded.to(param.dtype))


class CheckpointDtypeError(CheckpointTensorError):
    """A floating-point checkpoint tensor for an integer parameter (quantized codes: int8, AWQ/GPTQ's
    int32 `qweight`): the loaders' cast would truncate it into wrong codes without a word."""


def load_into(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None, *, name: str | None = None,
              target: str | None = None, expert_id: int | None = None) -> None:
    """Call the parameter's own loader (or the default one): the one place a parameter's
    `weight_loader` is called. `name` and `target` (the checkpoint tensor's and the parameter's
    names) are for the messages; `expert_id` goes to FusedMoE's loaders. Whatever the loader raises
    about the tensor (its own ValueError, or torch's RuntimeError from a narrow or copy that does not
    fit) becomes a CheckpointTensorError naming the checkpoint tensor and the parameter with their
    shapes. A
    floating-point tensor for an integer parameter is refused first (CheckpointDtypeError naming both
    dtypes); integers into float parameters, and floats into floats of another width, are cast."""
    what = f"checkpoint tensor {name!r}" if name else "a checkpoint tensor"
    param_name = f" {target!r}" if target else ""
    if loaded.dtype.is_floating_point and not (param.dtype.is_floating_point or param.dtype.is_complex):
        raise CheckpointDtypeError(
            f"{what} is {loaded.dtype}, but the model's parameter{param_name} {tuple(param.shape)} is {param.dtype}: "
            "a floating-point tensor is never cast into integer (quantized) codes; the checkpoint must store this "
            "tensor as the quantization method registered it (is it quantized as its quantization_config declares?)",
            tensor=name)
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        if expert_id is not None:
            loader(param, loaded, shard_id, expert_id=expert_id)
        elif shard_id is None:
            loader(param, loaded)
        else:
            loader(param, loaded, shard_id)
    except torch.cuda.OutOfMemoryError:  # not the checkpoint's fault
        raise
    except (ValueError, RuntimeError, IndexError) as e:
        part = "" if shard_id is None else f" as shard {shard_id!r}"
        part += "" if expert_id is None else f" of expert {expert_id}"
        raise CheckpointTensorError(
            f"{what} has shape {tuple(loaded.shape)}, which the model's parameter{param_name} "
            f"{tuple(param.shape)} cannot take{part}: {e}", tensor=name) from e


# ---- the load_weights loop of a decoder-only model ----------------------------------------------

STACKED_QKV_GATE_UP: tuple[tuple[str, str, Any], ...] = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
"""The HF Llama-style split projections and where they go in the fused layers: (checkpoint name
piece, parameter name piece, shard id) for a `QKVParallelLinear` named `qkv_proj` and a
`MergedColumnParallelLinear` named `gate_up_proj`. Added in plugin API 1.4."""

RECOMPUTED_BUFFERS: tuple[str, ...] = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
"""Name suffixes of rotary buffers some checkpoints carry and every model recomputes: skipped.
Added in plugin API 1.4."""


def load_stacked_weights(
    model: torch.nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_mapping: Iterable[tuple[str, str, Any]] = STACKED_QKV_GATE_UP,
    *,
    skip_suffixes: tuple[str, ...] = RECOMPUTED_BUFFERS,
    tied_lm_head: bool | None = None,
    rename: Callable[[str], str] | None = None,
    expert_names: tuple[str, str, str] | None = None,
) -> set[str]:
    """The usual `Model.load_weights`: map each HF checkpoint name to a parameter of `model` and
    load it through that parameter's `weight_loader` (so TP shards and fused layouts are handled).

    :param model: the model; its `named_parameters()` names are the targets.
    :param weights: (HF checkpoint name, full tensor) pairs.
    :param stacked_mapping: (checkpoint piece, parameter piece, shard id) triples; the first whose
        checkpoint piece is in a name replaces it and passes the shard id (default: q/k/v into
        `qkv_proj`, gate/up into `gate_up_proj`). `()` for checkpoints already fused (Phi-3).
    :param skip_suffixes: names ending so are skipped (default: recomputed rotary buffers).
    :param tied_lm_head: skip `lm_head.weight` (the head shares the embedding's parameter);
        None reads `model.tie_word_embeddings` (False when absent).
    :param rename: applied to each checkpoint name first (e.g. Mixtral's transformers 5 `.mlp.`
        back to `.block_sparse_moe.`).
    :param expert_names: for models with `FusedMoE` layers, the checkpoint names of an expert's
        (gate, up, down) projections (`("gate_proj", "up_proj", "down_proj")`, Mixtral
        `("w1", "w3", "w2")`); expert tensors are mapped with `FusedMoE.map_checkpoint_name`, and
        the parameters of any `FusedMoE` some expert has not reached are left out of the result.
    :return: the names of the parameters loaded (what `Model.load_weights` returns). A fused
        parameter is in it once every shard the mapping sends to it arrived.
    :raises UnknownCheckpointTensorError: (a ValueError and a KeyError) naming a checkpoint tensor
        that maps to no parameter.
    :raises CheckpointTensorError: (a ValueError) naming the checkpoint tensor, its shape and the
        parameter when the parameter's loader refuses it; or naming each fused parameter (and
        stacked expert parameter) some but not all of whose shards arrived, and the missing shards.

    Added in plugin API 1.4.
    """
    from radixserve.layers.moe import FusedMoE  # the MoE layer imports this module

    if tied_lm_head is None:
        tied_lm_head = bool(getattr(model, "tie_word_embeddings", False))
    stacked_mapping = tuple(stacked_mapping)
    shards_of: dict[str, dict[Any, str]] = {}  # parameter piece -> {shard id: checkpoint piece}
    for hf_piece, our_piece, sid in stacked_mapping:
        shards_of.setdefault(our_piece, {}).setdefault(sid, hf_piece)
    owner = type(model).__name__
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    arrived: dict[str, tuple[str, set]] = {}  # fused parameter -> (its piece, shard ids loaded)
    for name, tensor in weights:
        if name.endswith(skip_suffixes) or (tied_lm_head and name == "lm_head.weight"):
            continue
        original = name
        if rename is not None:
            name = rename(name)
        expert = None if expert_names is None else FusedMoE.map_checkpoint_name(name, *expert_names)
        if expert is not None:
            target, expert_id, shard_id = expert
            param = params.get(target)
            if param is None:
                raise UnknownCheckpointTensorError(_no_expert_param(original, target, owner, params), tensor=original)
            load_into(param, tensor, shard_id, name=original, target=target, expert_id=expert_id)
            loaded.add(target)
            continue
        target, shard_id, piece = name, None, None
        for hf_piece, our_piece, sid in stacked_mapping:
            if hf_piece in name:
                target, shard_id, piece = name.replace(hf_piece, our_piece), sid, our_piece
                break
        param = params.get(target)
        if param is None:
            raise UnknownCheckpointTensorError(_no_param(original, target, owner, model, expert_names), tensor=original)
        load_into(param, tensor, shard_id, name=original, target=target)
        if piece is None:
            loaded.add(target)
        else:  # loaded once every shard arrived (checked below)
            arrived.setdefault(target, (piece, set()))[1].add(shard_id)
    problems = []
    for target, (piece, got) in arrived.items():
        missing = {sid: hf for sid, hf in shards_of[piece].items() if sid not in got}
        if missing and target not in loaded:  # (a whole fused tensor may have come too)
            problems.append(f"{target}: " + ", ".join(
                f"shard {sid!r} never loaded (no checkpoint tensor {target.replace(piece, hf)!r})"
                for sid, hf in missing.items()))
        else:
            loaded.add(target)
    for module_name, module in model.named_modules():  # an expert missing from the checkpoint: unloaded
        if isinstance(module, FusedMoE):
            loaded.difference_update(f"{module_name}.{p}" for p in module.incomplete_params())
            problems += _missing_expert_parts(module_name, module, expert_names)
    if problems:
        shown = "; ".join(problems[:8]) + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else "")
        raise CheckpointTensorError(f"{len(problems)} fused parameter(s) of {owner} not fully loaded: {shown}")
    return loaded


def _no_param(original: str, target: str, owner: str, model, expert_names) -> str:
    """Why a checkpoint tensor has nowhere to go, with what it was looked up as when the model's rename hook
    or the stacked mapping changed its name, and the missing `expert_names` when an expert tensor reached a
    model with FusedMoE layers but none (audit 31: the message pointed nowhere near that cause)."""
    from radixserve.layers.moe import FusedMoE

    text = f"checkpoint tensor {original!r} has no matching parameter in {owner}"
    if target != original:
        text += f" (looked up as {target!r})"
    if expert_names is None and ".experts" in target and any(isinstance(m, FusedMoE) for m in model.modules()):
        text += ("; the model has FusedMoE layers but no `expert_names`, so no checkpoint tensor is mapped to "
                 "their stacked expert parameters (set expert_names to the (gate, up, down) projection names)")
    return text


def _no_expert_param(original: str, target: str, owner: str, params: dict[str, Any]) -> str:
    """Why a per-expert checkpoint tensor has nowhere to go: the layer is dense here, or its
    QuantMethod registered no `w13_<suffix>` / `w2_<suffix>` for that tensor's suffix."""
    layer = target.rpartition(".")[0] + "."
    has = sorted(p[len(layer):] for p in params if p.startswith(layer))
    if not has:
        return f"checkpoint expert tensor {original!r} has no matching parameter in {owner} (is that layer dense here?)"
    return (f"checkpoint expert tensor {original!r} has no matching parameter in {owner}: it would load into "
            f"{target.rpartition('.')[2]!r}, but the layer's expert parameters are {', '.join(has)} (a per-expert "
            "'<proj>.<suffix>' tensor loads into the 'w13_<suffix>' / 'w2_<suffix>' parameter its quantization "
            "method registers)")


def _missing_expert_parts(module_name: str, module, expert_names: tuple[str, str, str] | None) -> list[str]:
    """One line per stacked expert parameter of `module` that some expert tensor reached but not
    all: the parameter and the first missing (expert, shard) parts, as checkpoint names."""
    gate, up, down = expert_names or ("gate_proj", "up_proj", "down_proj")
    proj = {"gate": gate, "up": up, None: down}
    out = []
    for param, parts in module.partly_loaded_parts().items():
        suffix = param.split("_", 1)[1]  # w13_weight -> weight
        names = [f"{module_name}.{e}.{proj[half]}.{suffix}" for e, half in parts]
        shown = ", ".join(repr(n) for n in names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
        out.append(f"{module_name}.{param}: {len(parts)} expert shard(s) never loaded (no checkpoint tensor {shown})")
    return out
