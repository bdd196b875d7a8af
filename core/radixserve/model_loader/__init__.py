"""Model loading: detect the checkpoint format, read its HF config, stream weights into a model."""

from radixserve.model_loader.loader import load_model
from radixserve.model_loader.sources import ModelSource, detect_format, open_source

__all__ = ["ModelSource", "detect_format", "load_model", "open_source"]
