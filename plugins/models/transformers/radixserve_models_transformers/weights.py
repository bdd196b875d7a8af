"""Load (HF name, tensor) pairs into an HF module tree, the loader's `Model.load_weights` contract.

Most checkpoints name their tensors exactly as the module's parameters: those are copied in as
they stream past. The rest (checkpoints in an older layout: per-expert MoE weights that transformers
5 stacks, renamed keys) go through transformers' own conversion rules
(`get_model_conversion_mapping` + `convert_and_load_state_dict_in_model`), once, at the end."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from radixserve.layers.weight_utils import CheckpointTensorError, UnknownCheckpointTensorError

if TYPE_CHECKING:
    from radixserve_models_transformers.fused import Shard

# buffers some checkpoints carry that every model recomputes
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached", ".masked_bias")


def load_hf_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    shards: Mapping[str, Shard] | None = None) -> set[str]:
    """Fill `model`'s parameters; return the names (as in `model.named_parameters()`) loaded.
    `shards`: checkpoint names that fill rows of a fused parameter (fused.py); a fused parameter
    counts as loaded once every shard of it arrived.

    Raises UnknownCheckpointTensorError (a ValueError and a KeyError) naming checkpoint tensors
    that match nothing, CheckpointTensorError (a ValueError) on a shape mismatch."""
    params = dict(model.named_parameters())
    aliases = _tied_aliases(model)
    buffers = dict(model.named_buffers())
    shards = shards or {}
    pending = {}  # fused parameter -> checkpoint names still to come
    for source, shard in shards.items():
        pending.setdefault(shard.target, set()).add(source)
    loaded: set[str] = set()
    rest: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in weights:
            target = aliases.get(name, name)
            param = params.get(target)
            shard = shards.get(name) if param is None else None
            if shard is not None:
                rows = params[shard.target].narrow(0, shard.start, shard.size)
                if tuple(rows.shape) != tuple(tensor.shape):
                    raise CheckpointTensorError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, its rows "
                                                f"of the fused parameter {shard.target!r} {tuple(rows.shape)}",
                                                tensor=name)
                rows.copy_(tensor)
                pending[shard.target].discard(name)
                if not pending[shard.target]:
                    loaded.add(shard.target)
            elif param is not None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise CheckpointTensorError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the "
                                                f"model's parameter {target!r} {tuple(param.shape)}", tensor=name)
                param.copy_(tensor)
                loaded.add(target)
            elif name in buffers and tuple(buffers[name].shape) == tuple(tensor.shape):
                buffers[name].copy_(tensor)
            elif not name.endswith(_IGNORED_SUFFIXES):
                rest[name] = tensor
    if rest:
        loaded |= _load_converted(model, rest)
    return loaded


def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Second names of shared parameters (a tied LM head) -> the name `named_parameters()` uses."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _load_converted(model, state: dict[str, torch.Tensor]) -> set[str]:
    """Load what did not match by name through transformers' conversion rules; return the
    parameters it filled. Raises UnknownCheckpointTensorError naming any tensor it could not place either."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    before = {name: p for name, p in model.named_parameters()}
    device = next(iter(before.values())).device
    dtype = next(iter(before.values())).dtype
    config = LoadStateDictConfig(
        dtype=dtype, device_map={"": device}, weight_mapping=get_model_conversion_mapping(model, None, None)
    )
    info, _ = convert_and_load_state_dict_in_model(model, state, config)
    ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    unexpected = sorted(k for k in info.unexpected_keys if not any(re.search(p, k) for p in ignored))
    if info.mismatched_keys and not unexpected:
        raise _shape_mismatch(model, sorted(info.mismatched_keys, key=lambda m: m[0]), state)
    if unexpected or info.conversion_errors:
        problems = unexpected or sorted(info.conversion_errors)
        raise UnknownCheckpointTensorError(
            f"checkpoint tensor(s) with no matching parameter in {type(model).__name__}: "
            f"{', '.join(map(str, problems[:8]))}" + (" ..." if len(problems) > 8 else ""),
            tensor=unexpected[0] if unexpected else None)
    params = dict(model.named_parameters())
    # loaded = what the conversion did not report missing (it starts from every model key)
    return {name for name in params if name not in info.missing_keys}


def _shape_mismatch(model, mismatched: list, state: dict[str, torch.Tensor]) -> CheckpointTensorError:
    """transformers' (name, checkpoint shape, parameter shape) triples as the native path says a wrong shape.
    The names are transformers' after its conversion of the checkpoint's layout; the checkpoint's own tensor
    (for its file) is the one of that shape whose name shares the longest prefix with it, when there is one."""
    name, got, want = mismatched[0]
    same_shape = [k for k, t in state.items() if tuple(t.shape) == tuple(got)]
    source = max(same_shape, key=lambda k: len(os.path.commonprefix([k, name])), default=None)
    called = f"checkpoint tensor {source!r} (loaded as {name!r})" if source not in (None, name) else \
        f"checkpoint tensor {name!r}"
    more = f" (and {len(mismatched) - 1} more: {', '.join(m[0] for m in mismatched[1:4])}" \
        f"{' ...' if len(mismatched) > 4 else ''})" if len(mismatched) > 1 else ""
    return CheckpointTensorError(f"{called} has shape {tuple(got)}, the parameter of {type(model).__name__} "
                                 f"{tuple(want)}{more}", tensor=source)
