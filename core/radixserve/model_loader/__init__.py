"""Model loading: detect the checkpoint format, read its HF config, stream weights into a model.

The loader (torch) is imported on first use of its names, so that `model_loader.model_files`
(model paths, served names: the HTTP front end's needs) imports without torch."""

import importlib

_LAZY = {
    "load_model": "radixserve.model_loader.loader",
    "ModelSource": "radixserve.model_loader.sources",
    "detect_format": "radixserve.model_loader.sources",
    "open_source": "radixserve.model_loader.sources",
}

__all__ = ["ModelSource", "detect_format", "load_model", "open_source"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
