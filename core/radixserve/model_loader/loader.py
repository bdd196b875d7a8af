"""Build a model of the right class on the target device/dtype and fill every parameter."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from radixserve import native
from radixserve.layers import cpu_gemm, flat_decoder
from radixserve.layers.embedding import ParallelLMHead
from radixserve.layers.linear import LinearBase
from radixserve.layers.moe import FusedMoE
from radixserve.memory.fp8_kv import KVScaleCollector
from radixserve.model_loader.quant_select import quant_hook_failure, quant_hooks_named
from radixserve.model_loader.sources import ModelSource
from radixserve.plugins.registry import PluginCodeError, PluginError

logger = logging.getLogger(__name__)


class _default_dtype:
    """Context manager: parameters created inside get `dtype`."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __enter__(self):
        self.old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.old)


def _fill_dummy(model: torch.nn.Module, seed: int) -> set[str]:
    """Random weights at the real shapes (norms at 1) for benchmarks without a checkpoint."""
    gens: dict[torch.device, torch.Generator] = {}
    names = set()
    for name, p in model.named_parameters():
        # drawn on the parameter's own device: an 8B model fills in seconds instead of minutes
        gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif not p.dtype.is_floating_point:  # packed quantized codes (int32): random bits
            p.data.random_(generator=gen)
        elif p.element_size() == 1:  # fp8 weights: normal_ has no 8-bit kernel
            p.data.copy_(torch.empty(p.shape, device=p.device).normal_(0.0, 0.02, generator=gen))
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
        names.add(name)
    return names


def _process_after_loading(model: torch.nn.Module, lowbit_gemv: bool) -> int:
    """Each layer's method prepares its loaded weights (and, `lowbit_gemv`, the low-bit GEMVs);
    returns the number of layers that took the GEMVs."""
    lowbit_layers = 0
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        # quantized linears may have no `weight` (qweight, ...); other modules need one, as before
        if isinstance(module, FusedMoE):
            qm.process_moe_weights_after_loading(module)
        elif qm is not None and (isinstance(module, LinearBase) or hasattr(module, "weight")):
            qm.process_weights_after_loading(module)
            if lowbit_gemv and isinstance(module, LinearBase):
                lowbit_layers += bool(qm.enable_lowbit_gemv(module))
        if isinstance(module, ParallelLMHead):
            module.pack_for_cpu()
    return lowbit_layers


def _load_error(source: ModelSource, e: Exception) -> str:
    """A load failure as one line: the checkpoint, the file holding the tensor to blame (when the
    error names one, e.g. a `CheckpointTensorError`), then the model's own message."""
    text = str(e.args[0]) if isinstance(e, KeyError) and len(e.args) == 1 else str(e)  # not KeyError's repr
    tensor = getattr(e, "tensor", None)
    file = source.file_of(tensor) if tensor else None
    own = source.named_in_file([tensor]) if tensor else ""
    return f"checkpoint {source.path!r}" + (f" (file {file})" if file else "") + f": {text}{own}"


def _build_model(model_cls: type, hf_config: Any, quant_method: Any, tp_group: Any, label: str | None) -> Any:
    """`model_cls(hf_config, quant_method[, tp_group=])`. A ValueError is the contract's refusal of the config
    and goes on as it is; any other exception is the model's bug (a config field its code reads that this
    config lacks, say: audit 34's raw 34-line AttributeError), reported as one line naming the model, the
    original as `__cause__` (a quantization method's hooks are named by quant_hooks_named instead)."""
    try:
        return model_cls(hf_config, quant_method) if tp_group is None else model_cls(
            hf_config, quant_method, tp_group=tp_group)
    except (ValueError, PluginError, torch.cuda.OutOfMemoryError):
        raise
    except Exception as e:
        if quant_hook_failure(e, quant_method, None, None, "") is not None:
            raise
        who = label or f"model class {model_cls.__module__}.{model_cls.__name__}"
        raise PluginCodeError(f"{who} failed while building the model: {type(e).__name__}: {e}") from e


def load_model(
    source: ModelSource,
    hf_config,
    model_cls,
    device: torch.device,
    dtype: torch.dtype,
    quant_method=None,
    seed: int = 0,
    show_progress: bool = True,
    tp_group=None,
    kv_scales=None,
    lowbit_gemv: bool = False,
    cpu_matmul_precision: str = "highest",
    quant_label: str | None = None,
    check_built: Callable[[torch.nn.Module], None] | None = None,
    model_label: str | None = None,
) -> torch.nn.Module:
    """Instantiate `model_cls(hf_config, quant_method)` on `device` in `dtype` and load its weights.
    `check_built(model)` runs once the model is built, before any weight is read (a refusal that
    needs the model's layers, e.g. an attention option the backend lacks, costs no load).
    `tp_group` (tensor parallelism, a TPGroup of size > 1) is passed on as `tp_group=`: the model
    then holds and loads this rank's shard only.

    The checkpoint's KV-cache scales (`self_attn.k_scale` / `v_scale`, see radixserve.memory.fp8_kv)
    are not model parameters: they go to `kv_scales` (a KVScaleCollector) when given, else are dropped.
    `lowbit_gemv` (runtime.lowbit_gemv resolved for this device): each quantized linear's method is
    asked to prepare the layer for the small-batch low-bit GEMVs (`QuantMethod.enable_lowbit_gemv`).
    `cpu_matmul_precision` (runtime.cpu_matmul_precision): "medium" turns a CPU model's packed fp32
    GEMM weights into bf16 ones (`cpu_gemm.lower_precision`).

    Raises ValueError naming the parameters no checkpoint tensor reached (never silent); an error
    of `model.load_weights` (a ValueError, or a KeyError naming an unknown tensor) comes back as a
    ValueError that starts with the checkpoint path and the file of the tensor it names, the
    original as its `__cause__`. An exception out of `quant_method`'s hooks (`create_weights` while the
    model is built, `process_weights_after_loading` after the load) comes back as a PluginError naming
    `quant_label` (e.g. "quantization method 'int8' (radixserve-quant-int8)"), the hook and the layer,
    the original as its `__cause__` (`quant_select.quant_hooks_named`). Any other exception of the model's
    constructor but a ValueError (its refusal of the config) is a PluginCodeError naming `model_label`."""
    start = time.perf_counter()
    with quant_hooks_named(quant_method, quant_label), torch.device(device), _default_dtype(dtype):
        model = _build_model(model_cls, hf_config, quant_method, tp_group, model_label)
    if check_built is not None:
        check_built(model)
    prepare = getattr(source.weight_source, "prepare_model", None)
    if prepare is not None:  # e.g. GGUF keeping the embedding's blocks: swaps modules before loading
        model = prepare(model) or model
    if source.format == "dummy":
        loaded = _fill_dummy(model, seed)
    else:
        weights = tqdm(
            (kv_scales if kv_scales is not None else KVScaleCollector()).filter(source.iter_weights(hf_config)),
            total=source.num_tensors(),
            desc=f"loading {source.format} weights",
            unit="tensor",
            disable=not show_progress or not sys.stderr.isatty(),  # no bar in a log file or journald
        )
        try:
            loaded = model.load_weights(weights)
        except (ValueError, KeyError) as e:  # a KeyError: what the Model contract named for an unknown tensor
            raise ValueError(_load_error(source, e)) from e
    missing = sorted(set(dict(model.named_parameters())) - set(loaded))
    if missing:
        shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
        raise ValueError(f"checkpoint {source.path!r} left {len(missing)} parameter(s) unloaded: {shown}"
                         + source.named_in_file(missing[:10]))
    loaded_at = time.perf_counter()
    compiled = native.compiled_since(start)  # a first start's kernel builds share the cores with the load
    logger.info("weights of %s (%s) loaded in %.1f s%s", type(model).__name__, source.format, loaded_at - start,
                f" (while {compiled} native kernel(s) compiled beside it)" if compiled else "")
    # packing for the device; may compile native kernels on first use (native.py logs those apart)
    with quant_hooks_named(quant_method, quant_label, model):
        lowbit_layers = _process_after_loading(model, lowbit_gemv)
    if device.type == "cpu" and cpu_matmul_precision == "medium":
        converted = cpu_gemm.lower_precision(model)
        if converted:
            logger.info("runtime.cpu_matmul_precision=medium: %d weight(s) kept in bf16 for their CPU GEMMs; %s", converted,
                        cpu_gemm.bf16_product_description())
        elif cpu_gemm.bf16_available():  # (without the native GEMM lower_precision has warned)
            logger.info("runtime.cpu_matmul_precision=medium: the model has no packed fp32 GEMM weights (quantized "
                        "or not fp32): nothing changed")
    if device.type == "cpu":  # plain Llama layers over packed fp32 weights: one flat function each (issue 12)
        flat_decoder.install_fp32(model)
    model.eval()
    if lowbit_layers:
        logger.info("runtime.lowbit_gemv: %d linear layer(s) run batches of <= 4 rows on the low-bit GEMVs", lowbit_layers)
    logger.info("weights prepared for %s in %.1f s", device.type, time.perf_counter() - loaded_at)
    return model
