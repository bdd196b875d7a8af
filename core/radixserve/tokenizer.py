"""Tokenizer loading for HF directories and .gguf files, chat templates, and EOS ids."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

CACHE_ENV = "RADIXSERVE_CACHE_DIR"  # default ~/.cache/radixserve


def load_tokenizer(model_path: str, tokenizer_path: str | None = None):
    """An HF tokenizer: from `tokenizer_path` if given, else from the model (dir or .gguf file)."""
    from transformers import AutoTokenizer

    path = tokenizer_path or model_path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _gguf_tokenizer(os.path.abspath(path))
    if os.path.isfile(path):  # e.g. a plugin weight source's file: transformers would only say "not valid JSON"
        key = "model.tokenizer" if tokenizer_path else "model.path"
        raise ValueError(
            f"{key} {path!r} is a file, and RadixServe reads a tokenizer only from a directory (tokenizer.json "
            "or tokenizer_config.json) or a .gguf file: set model.tokenizer (serve --tokenizer) to the directory "
            "of this model's tokenizer"
        )
    return AutoTokenizer.from_pretrained(path)


def _gguf_cache_dir(path: str) -> str:
    st = os.stat(path)
    key = hashlib.sha1(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")
    return os.path.join(root, "gguf-tokenizers", key)


def tokenizer_json(model_path: str, tokenizer_path: str | None = None) -> str | None:
    """The `tokenizer.json` that `load_tokenizer(model_path, tokenizer_path)` reads (for a .gguf, its
    cached conversion), or None when there is none yet. Lets a process that only decodes use the
    `tokenizers` library without importing transformers."""
    path = tokenizer_path or model_path
    if os.path.isfile(path) and path.endswith(".gguf"):
        path = _gguf_cache_dir(os.path.abspath(path))
    candidate = os.path.join(path, "tokenizer.json")
    return candidate if os.path.isfile(candidate) else None


def _gguf_tokenizer(path: str):
    """transformers converts a GGUF vocabulary in seconds; keep the converted tokenizer in a cache
    directory (keyed by path, size and mtime) so later loads take a fraction of that."""
    from transformers import AutoTokenizer

    cache = _gguf_cache_dir(path)
    if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cache)
        except Exception:  # a corrupt or incompatible cache entry: rebuild it
            shutil.rmtree(cache, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tmp = None
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cache))
        tok.save_pretrained(tmp)
        os.replace(tmp, cache)  # atomic: concurrent loaders never see a half-written entry
    except OSError:
        if tmp is not None:  # read-only home or a lost race (os.replace onto a full dir): no cache
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def apply_chat_template(
    tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template (ready for generation).
    `template_kwargs` reach the template as variables: `tools=[...]` (OpenAI tool definitions),
    `enable_thinking=False`, ..."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    # the template already wrote any BOS / special tokens as text
    return list(tokenizer.encode(text, add_special_tokens=False))


def _as_set(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple, set, frozenset)):
        return {int(v) for v in value}
    return {int(value)}


def eos_token_ids(hf_config, model_path: str | None = None, tokenizer=None) -> frozenset[int]:
    """The union of the config's eos_token_id (int or list), generation_config.json's, and the
    tokenizer's eos token."""
    ids = _as_set(getattr(hf_config, "eos_token_id", None))
    if model_path and os.path.isdir(model_path):
        gen = os.path.join(model_path, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen) as f:
                ids |= _as_set(json.load(f).get("eos_token_id"))
    if tokenizer is not None:
        ids |= _as_set(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)
