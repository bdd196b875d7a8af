"""Checkpoint formats: an HF directory of safetensors (sharded or not), a file read by a weight
source (a quantization component that declared the file's suffix, e.g. GGUF), or dummy random
weights at the real shapes."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.model_loader.model_files import no_weight_source_message
from radixserve.plugins.registry import BUILTIN_LOAD_FORMATS, PluginCodeError, PluginError

if TYPE_CHECKING:
    from radixserve.config import Config
    from radixserve.interfaces.quantization import WeightSource
    from radixserve.plugins.model_select import ModelChoice
    from radixserve.plugins.registry import Registry

logger = logging.getLogger(__name__)


def detect_format(path: str, load_format: str = "auto", registry: Registry | None = None) -> str:
    """'safetensors' | 'dummy' | the name of the weight source that reads the file (e.g. 'gguf': the
    one `load_format` names, whatever the file's suffix, else found by suffix through `registry`);
    errors name what was found instead."""
    if load_format == "dummy":
        return "dummy"
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if os.path.isfile(path):
        spec = registry.weight_source_reading(path, load_format) if registry is not None else None
        if spec is None:
            raise ValueError(no_weight_source_message(path, registry))
        found = spec.name
    elif load_format not in BUILTIN_LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is a weight source, which reads a file; {path!r} is a directory")
    else:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {path!r} has no config.json")
        if glob.glob(os.path.join(path, "*.safetensors")):
            found = "safetensors"
        elif glob.glob(os.path.join(path, "*.bin")):
            raise ValueError(f"{path!r} holds PyTorch .bin weights; only safetensors are supported: convert them once, "
                             "e.g. AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) with transformers "
                             "(it writes model.safetensors), and copy the tokenizer files beside them")
        else:
            raise ValueError(f"model directory {path!r} has no *.safetensors files")
    if load_format not in ("auto", found):
        raise ValueError(f"load_format={load_format!r} but {path!r} is a {found} checkpoint")
    return found


@dataclass
class ModelSource:
    """Where a model's config and weights come from: an HF safetensors directory, dummy weights,
    or a file read by a weight source (a QuantMethod with the WeightSource role, e.g. GGUF)."""

    path: str
    format: str
    weight_source: WeightSource | None = None
    source_label: str = ""  # how errors name the weight source: "weight source 'gguf' (radixserve-quant-gguf 0.1.0)"

    @contextlib.contextmanager
    def _reading(self, hook: str) -> Iterator[None]:
        """A weight source's `hook` reading the file: its ValueError names the file (the contract's refusal), any
        other exception is one PluginCodeError line naming the source, the file and the hook (weight-source
        audit 34: a corrupt file gave a traceback naming neither)."""
        try:
            yield
        except (ValueError, PluginError):
            raise
        except Exception as e:
            who = self.source_label or f"weight source {type(self.weight_source).__name__}"
            raise PluginCodeError(f"{who} failed reading {self.path!r} ({hook}): {type(e).__name__}: {e}") from e

    def hf_config(self):
        if self.weight_source is not None:
            with self._reading("hf_config"):
                try:
                    return self.weight_source.hf_config(self.path)
                except ValueError as e:  # a plain one names the file (a subclass keeps its own words)
                    if type(e) is not ValueError or os.path.basename(self.path) in str(e):
                        raise
                    raise ValueError(f"{self.path!r}: {e}") from e
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.path, trust_remote_code=False)  # never a checkpoint's own code
        except ValueError as e:  # transformers' advice (upgrade it) is wrong for a plugin's own model_type
            model_type = _unknown_model_type(self.path)
            if model_type is None:
                raise
            note = ("; the checkpoint names its own Python code (config.json auto_map), which RadixServe never runs "
                    "(there is no trust_remote_code)" if _has_auto_map(self.path) else "")
            raise UnknownModelTypeError(self.path, model_type, note) from e

    def num_tensors(self) -> int | None:
        if self.weight_source is not None:
            return self.weight_source.num_tensors(self.path)
        if self.format == "safetensors":
            return count_safetensors(self.path)
        return 0

    def file_of(self, tensor: str) -> str | None:
        """The name of the file holding checkpoint tensor `tensor` (for error messages), or None."""
        if self.weight_source is not None:
            return os.path.basename(self.path)
        if self.format != "safetensors":
            return None
        try:
            return next((os.path.basename(f) for f in safetensors_files(self.path) if tensor in _tensor_names(f)), None)
        except Exception:  # noqa: BLE001 - only an error message's detail: never hide the error itself
            return None

    def named_in_file(self, names: list[str]) -> str:
        """The file's own names of HF tensor names `names` (a weight source's `file_tensor_name`), as a
        message's suffix: " (blk.1.ffn_down.weight in the file)"; "" when the file uses the same names."""
        own = getattr(self.weight_source, "file_tensor_name", None)
        found = [n for n in (own(name) for name in names) if n] if own is not None else []
        return f" ({', '.join(found)} in the file)" if found else ""

    def iter_weights(self, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
        if self.weight_source is not None:
            return self._source_weights(hf_config)
        if self.format == "safetensors":
            return iter_safetensors(self.path)
        raise ValueError("dummy checkpoints have no weights to iterate")

    def _source_weights(self, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
        with self._reading("iter_weights"):
            yield from self.weight_source.iter_weights(self.path, hf_config)


class UnknownModelTypeError(ValueError):
    """config.json names a model_type transformers has no config class for (none registered)."""

    def __init__(self, path: str, model_type: str, note: str = "") -> None:
        import transformers

        self.path, self.model_type, self.note = path, model_type, note
        super().__init__(
            f"{os.path.join(path, 'config.json')}: model_type {model_type!r} is not known to transformers "
            f"{transformers.__version__}. A model plugin that provides this model_type must register its config class "
            f"with transformers: AutoConfig.register({model_type!r}, ItsConfig) in its radixserve_register hook (see "
            "docs/plugin-authoring.md). Check that such a plugin is installed and loaded: `radixserve plugins` lists "
            f"the loaded ones and those skipped (plugins.disable, RADIXSERVE_DISABLE_PLUGINS){note}. If no plugin is "
            "meant to provide it, a newer transformers may know it (pip install --upgrade transformers)")

    def __reduce__(self):  # picklable (its arguments are not the message)
        return type(self), (self.path, self.model_type, self.note)


def _unknown_model_type(path: str) -> str | None:
    """config.json's model_type when transformers has no config class registered for it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if isinstance(model_type, str) and model_type not in CONFIG_MAPPING else None


def _has_auto_map(path: str) -> bool:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("auto_map"))
    except (OSError, ValueError, AttributeError):
        return False


def safetensors_files(path: str) -> list[str]:
    """The shard files, from model.safetensors.index.json when present."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


@contextlib.contextmanager
def _safetensors_file(file: str) -> Iterator:
    """safe_open(file), with a damaged or missing file as one ValueError naming it (the library's own
    error and an OSError were tracebacks from deep inside the loader)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"{file!r} is not a readable safetensors file ({reason}); re-download or re-save the "
                         "checkpoint") from e


def _tensor_names(file: str) -> set[str]:
    with _safetensors_file(file) as f:
        return set(f.keys())


def count_safetensors(path: str) -> int:
    """The checkpoint's tensors, from the files' headers alone (the progress bar's total)."""
    total = 0
    for file in safetensors_files(path):
        with _safetensors_file(file) as f:
            total += len(f.keys())
    return total


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        with _safetensors_file(file) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def open_source(path: str, load_format: str, registry: Registry, options: dict | None = None) -> ModelSource:
    """Detect the checkpoint format; a file gets the weight source `load_format` names, or else the one
    that declared its suffix, built with `options` (`model.weight_source_options`) as keyword arguments."""
    fmt = detect_format(path, load_format, registry)
    source = None
    if os.path.isfile(path):
        spec = registry.weight_source_named(fmt)  # detect_format named it (or raised)
        cls = registry.load("quantization", spec.name)
        label = f"weight source {spec.name!r} ({spec.distribution} {spec.version})".replace(" )", ")")
        source = build_weight_source(cls, spec.name, options or {}, label)
        return ModelSource(path=path, format=fmt, weight_source=source, source_label=label)
    elif options:
        raise ValueError(f"model.weight_source_options {options!r} apply to checkpoint files read by a weight source "
                         f"(e.g. .gguf); {path!r} is a {fmt} checkpoint")
    return ModelSource(path=path, format=fmt, weight_source=source)


def build_weight_source(cls, name: str, options: dict, label: str = "") -> WeightSource:
    """`cls(**options)`, as the core builds a weight source from model.weight_source_options: an option its
    `__init__` does not take, or a ValueError it raises for a value, is one ValueError naming the source; any
    other exception from it a PluginCodeError (it was a TypeError traceback from inside the loader)."""
    _check_options(cls, name, options)
    try:
        return cls(**options)
    except ValueError as e:
        raise ValueError(f"model.weight_source_options for the weight source {name!r}: {e}") from e
    except Exception as e:
        raise PluginCodeError(f"{label or f'weight source {name!r}'} failed to build from model.weight_source_options "
                              f"{options!r}: {type(e).__name__}: {e}") from e


def _check_options(cls, name: str, options: dict) -> None:
    import inspect

    params = inspect.signature(cls.__init__).parameters
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    valid = [p for p, param in params.items() if p != "self" and param.kind in kinds]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"model.weight_source_options: {', '.join(map(repr, unknown))} not accepted by the "
                         f"weight source {name!r} (valid: {', '.join(valid) or 'none'})")


@dataclass
class Checkpoint:
    """The configured checkpoint, opened and matched to an implementation (no weights read)."""

    path: str  # local: a Hub id downloaded, the default model found
    source: ModelSource
    hf_config: object
    choice: ModelChoice


def open_checkpoint(config: Config, registry: Registry) -> Checkpoint:
    """`model.path` resolved, its files checked (one line naming a broken file), opened and its
    architecture's implementation picked by `model.impl`: what ModelRunner loads and what
    `radixserve config show --model` reports."""
    from radixserve.model_loader.model_files import check_model_files, check_tokenizer_path, resolve_model_path
    from radixserve.plugins.model_select import select_model

    check_tokenizer_path(config.model.tokenizer)
    path = resolve_model_path(config.model.path)  # a local path, a Hub id, or the default
    check_model_files(path)
    source = open_source(path, config.model.load_format, registry, config.model.weight_source_options)
    try:
        hf_config = source.hf_config()
    except UnknownModelTypeError as e:
        skipped = "; ".join(f"{p} of {dist} ({why})" for p, (dist, why) in sorted(registry.skipped.items()))
        if not skipped:
            raise
        raise UnknownModelTypeError(e.path, e.model_type, f"{e.note}; installed plugins not loaded now: {skipped}") from e
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch is None:
        raise ValueError(f"{path!r}: config has no `architectures`; cannot pick a model class")
    choice = select_model(registry, arch, config.model.impl)
    if choice.fallback and config.model.impl == "auto":
        _warn_if_a_native_plugin_was_meant(arch, hf_config, registry)
    return Checkpoint(path, source, hf_config, choice)


def _warn_if_a_native_plugin_was_meant(arch: str, hf_config, registry: Registry) -> None:
    """`architectures` naming no class at all (a typo, a plugin's own name) while the class transformers maps
    the `model_type` to has a native plugin: the fallback would run that same class, slower; say how to get
    the native one (audit 30: "LlamaForCausalLMM" moved a Llama checkpoint onto the fallback)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from radixserve.plugins.model_select import native_architectures

    mapped = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", None))
    if hasattr(transformers, arch) or mapped not in native_architectures(registry):
        return
    logger.warning("config.json's architectures names %s, which is neither a transformers class nor claimed by a "
                   "native plugin: the transformers fallback runs it as %s (its model_type %r); %s has the native "
                   "plugin %r: write %s into `architectures` to run it natively", arch, mapped,
                   hf_config.model_type, mapped, registry.get("model", mapped).plugin, mapped)
