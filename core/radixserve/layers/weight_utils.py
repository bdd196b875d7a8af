"""Per-parameter weight loaders (nano-vllm style): each parameter carries `weight_loader`, so one
generic loop can load any model: `param.weight_loader(param, tensor[, shard_id])`;
`load_stacked_weights` is that loop for a decoder-only model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole tensor into `param`; shapes must match exactly (no silent broadcasting)."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not fused; got shard_id={shard_id!r}")
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded.to(param.dtype))


def load_into(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Call the parameter's own loader (or the default one)."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    if shard_id is None:
        loader(param, loaded)
    else:
        loader(param, loaded, shard_id)


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
    :return: the names of the parameters loaded (what `Model.load_weights` returns).
    :raises KeyError: naming a checkpoint tensor that maps to no parameter.

    Added in plugin API 1.4.
    """
    from radixserve.layers.moe import FusedMoE  # the MoE layer imports this module

    if tied_lm_head is None:
        tied_lm_head = bool(getattr(model, "tie_word_embeddings", False))
    stacked_mapping = tuple(stacked_mapping)
    owner = type(model).__name__
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(skip_suffixes) or (tied_lm_head and name == "lm_head.weight"):
            continue
        if rename is not None:
            name = rename(name)
        expert = None if expert_names is None else FusedMoE.map_checkpoint_name(name, *expert_names)
        if expert is not None:
            target, expert_id, shard_id = expert
            param = params.get(target)
            if param is None:
                raise KeyError(f"checkpoint expert tensor {name!r} has no matching parameter in {owner} "
                               "(is that layer dense here?)")
            param.weight_loader(param, tensor, shard_id, expert_id=expert_id)
            loaded.add(target)
            continue
        target, shard_id = name, None
        for hf_piece, our_piece, sid in stacked_mapping:
            if hf_piece in name:
                target, shard_id = name.replace(hf_piece, our_piece), sid
                break
        param = params.get(target)
        if param is None:
            raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {owner}")
        load_into(param, tensor, shard_id)
        loaded.add(target)
    for module_name, module in model.named_modules():  # an expert missing from the checkpoint: unloaded
        if isinstance(module, FusedMoE):
            loaded.difference_update(f"{module_name}.{p}" for p in module.incomplete_params())
    return loaded
