"""Conformance kit for weight sources: a quantization component in the `WeightSource` role, which
reads a checkpoint file format (`registry.register(..., weight_file_suffixes=(".ext",))`).

`check_weight_source(MySource, "model.ext", reference="hf_dir")` checks what the loader relies on
(a config naming the architecture, unique `(name, tensor)` pairs, `num_tensors` matching them), then
loads the model from the file through the source, as the core does, and runs it against
transformers on `reference`, an HF directory of the same model (`check_model_parity`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from radixserve.interfaces.quantization import QuantMethod, WeightSource


def check_weight_source(
    source: type | Callable[[], Any],
    path: str,
    reference: str,
    *,
    options: dict[str, Any] | None = None,
    model_cls: type | None = None,
    prompt_lens: Sequence[int] = (5, 13, 2),
    new_tokens: int = 8,
    logits_atol: float = 1e-3,
) -> None:
    """Raise AssertionError naming the first broken rule of the WeightSource contract.

    :param source: the component class, built as the core builds it (`options` as keyword
        arguments: `model.weight_source_options`), or a callable returning an instance.
    :param path: a checkpoint file in the source's format.
    :param reference: an HF directory (config.json + safetensors) holding the same model, which
        transformers runs; for a source that quantizes or dequantizes, the weights as the source
        gives them to the model (raise `logits_atol` for a lossy format).
    :param model_cls: the model class to load (default: the installed one registered under the
        config's `architectures[0]`).

    Added in plugin API 1.12.
    """
    if isinstance(source, type):  # built as the core builds it, with the core's errors for a refused option
        from radixserve.model_loader.sources import build_weight_source

        ws = build_weight_source(source, source.__name__, dict(options or {}))
    else:
        ws = source()
    name = type(ws).__name__
    assert isinstance(ws, WeightSource) and isinstance(ws, QuantMethod), (
        f"{name} must subclass both radixserve.interfaces.quantization.WeightSource and QuantMethod (the file's "
        "reader is also its layers' QuantMethod)")
    config = ws.hf_config(path)
    arch = (getattr(config, "architectures", None) or [None])[0]
    assert isinstance(arch, str), f"{name}.hf_config({path!r}) has no `architectures`: the core cannot pick a model"
    counts: Counter[str] = Counter()
    for pair in ws.iter_weights(path, config):
        assert isinstance(pair, tuple) and len(pair) == 2, f"{name}.iter_weights yielded {pair!r}, not (name, tensor)"
        key, tensor = pair
        assert isinstance(key, str) and isinstance(tensor, torch.Tensor), (
            f"{name}.iter_weights yielded ({type(key).__name__}, {type(tensor).__name__}), not (str, torch.Tensor)")
        counts[key] += 1
    repeated = sorted(k for k, n in counts.items() if n > 1)
    assert not repeated, f"{name}.iter_weights yielded these names more than once: {repeated[:5]}"
    expected = ws.num_tensors(path)
    assert expected is None or expected == sum(counts.values()), (
        f"{name}.num_tensors({path!r}) = {expected}, but iter_weights yielded {sum(counts.values())} tensors")
    if model_cls is None:
        from radixserve.plugins.registry import Registry

        model_cls = Registry.discover().load("model", arch)
    from radixserve.testing.model import check_model_parity

    check_model_parity(model_cls, path, weight_source=ws, reference=reference, prompt_lens=prompt_lens,
                       new_tokens=new_tokens, logits_atol=logits_atol)
