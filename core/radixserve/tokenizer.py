"""Tokenizer loading for HF directories and .gguf files (transformers), chat templates, EOS ids,
and the prepared directory that the serving processes' torch-free tokenizer reads
(`radixserve.serving_tokenizer`): `python -m radixserve.tokenizer MODEL [TOKENIZER]` writes it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from typing import Any

from radixserve.config import cache_dir

SERVING_TOKENIZER_FILE = "tokenizer.json"  # the backend pipeline, as transformers' class configured it
SERVING_META_FILE = "radixserve-tokenizer.json"  # what the serving tokenizer needs besides (written last)
SERVING_META_FORMAT = 1
# transformers' first import is not thread-safe: two threads importing AutoTokenizer at once can get
# "cannot import name 'AutoTokenizer'" (chaos audit 32: a scheduler's first stop-string request and its
# first grammar backend loaded the tokenizer together; the request failed with a 500)
_LOAD_LOCK = threading.Lock()
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".onnx", ".h5", ".msgpack", ".ckpt")


def tokenizer_source(model_path: str, tokenizer_path: str | None = None) -> str:
    """Where the tokenizer is read from: `tokenizer_path` if given, else the model (dir or .gguf
    file). Raises ValueError for another file (e.g. a plugin weight source's file: transformers
    would only say "not valid JSON")."""
    path = tokenizer_path or model_path
    if os.path.isfile(path) and not path.endswith(".gguf"):
        key = "model.tokenizer" if tokenizer_path else "model.path"
        raise ValueError(
            f"{key} {path!r} is a file, and RadixServe reads a tokenizer only from a directory (tokenizer.json "
            "or tokenizer_config.json) or a .gguf file: set model.tokenizer (serve or generate --tokenizer) to the directory "
            "of this model's tokenizer"
        )
    return path


def load_tokenizer(model_path: str, tokenizer_path: str | None = None):
    """An HF tokenizer: from `tokenizer_path` if given, else from the model (dir or .gguf file).
    Thread-safe: loads run one at a time in a process (see _LOAD_LOCK)."""
    path = tokenizer_source(model_path, tokenizer_path)
    with _LOAD_LOCK:
        from transformers import AutoTokenizer

        if os.path.isfile(path):
            return _gguf_tokenizer(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # never a checkpoint's own code


def _gguf_key(path: str) -> str:
    st = os.stat(path)
    return hashlib.sha1(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _gguf_cache_dir(path: str) -> str:
    return os.path.join(cache_dir(), "gguf-tokenizers", _gguf_key(path))


def _directory_key(path: str) -> str:
    """A digest of the files transformers may read for a tokenizer directory (every file but
    weights, and `additional_chat_templates/`), by content: a test's fresh copy of the same
    tokenizer, or a Hub snapshot under another path, hits the same entry; an edited template does not."""
    digest = hashlib.sha1()
    names = sorted(n for n in os.listdir(path) if not n.endswith(WEIGHT_SUFFIXES))
    extra = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra):
        names += sorted(os.path.join("additional_chat_templates", n) for n in os.listdir(extra))
    for name in names:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            continue
        digest.update(name.encode() + b"\0")
        with open(full, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def serving_tokenizer_dir(model_path: str, tokenizer_path: str | None = None) -> str:
    """The prepared directory of this tokenizer (it may not exist yet): keyed by the .gguf file's
    path, size and mtime, or by the directory's tokenizer files; for a source that is not local
    (a Hub id given as model.tokenizer), by its name (see `is_local_source`). Torch-free."""
    path = tokenizer_source(model_path, tokenizer_path)
    if os.path.isfile(path):
        key = "gguf-" + _gguf_key(os.path.abspath(path))
    elif os.path.isdir(path):
        key = "dir-" + _directory_key(path)
    else:
        key = "name-" + hashlib.sha1(path.encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), "serving-tokenizers", key)


def is_local_source(model_path: str, tokenizer_path: str | None = None) -> bool:
    """Whether the tokenizer is read from a local file or directory (else transformers resolves the
    name, e.g. a Hub id: its prepared directory is rewritten on every start, as it may have changed)."""
    return os.path.exists(tokenizer_source(model_path, tokenizer_path))


def is_prepared(directory: str) -> bool:
    try:
        with open(os.path.join(directory, SERVING_META_FILE)) as f:
            return json.load(f).get("format") == SERVING_META_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def prepare_serving_tokenizer(model_path: str, tokenizer_path: str | None = None, again: bool = False) -> str:
    """Load the tokenizer with transformers (`load_tokenizer`: the class AutoTokenizer picks) and
    write what the serving tokenizer reads: its backend pipeline (tokenizer.json) and
    radixserve-tokenizer.json (special tokens, chat templates, decode clean-up, special ids).
    Returns the directory; an existing one is kept unless `again`."""
    directory = serving_tokenizer_dir(model_path, tokenizer_path)
    if is_prepared(directory) and not again:
        return directory
    tok = load_tokenizer(model_path, tokenizer_path)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"the tokenizer of {tokenizer_path or model_path!r} ({type(tok).__name__}) has no "
                         "`tokenizers` backend, which the serving processes need")
    clean_up = bool(tok.clean_up_tokenization_spaces)
    force = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    if clean_up and type(backend.model).__name__ == "BPE" and hasattr(tok, force):
        clean_up = bool(getattr(tok, force))  # transformers 5 skips it for BPE (it would corrupt the text)
    meta = {
        "format": SERVING_META_FORMAT,
        "source": os.path.abspath(tokenizer_source(model_path, tokenizer_path)),
        "tokenizer_class": type(tok).__name__,
        "special_tokens_map": {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)},
        "chat_template": tok.chat_template,
        "clean_up_tokenization_spaces": clean_up,
        "split_special_tokens": bool(getattr(tok, "split_special_tokens", False)),
        "all_special_ids": [int(i) for i in tok.all_special_ids],
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "vocab_size": len(tok),
    }
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    shutil.rmtree(directory, ignore_errors=True)  # an entry of an older format
    tmp = tempfile.mkdtemp(dir=os.path.dirname(directory))
    try:
        backend.save(os.path.join(tmp, SERVING_TOKENIZER_FILE))
        with open(os.path.join(tmp, SERVING_META_FILE), "w") as f:
            json.dump(meta, f, ensure_ascii=False)
        os.replace(tmp, directory)  # atomic: concurrent preparers never leave a half-written entry
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_prepared(directory):  # not a lost race
            raise
    return directory


def _gguf_tokenizer(path: str):
    """transformers converts a GGUF vocabulary in seconds; keep the converted tokenizer in a cache
    directory (keyed by path, size and mtime) so later loads take a fraction of that."""
    from transformers import AutoTokenizer

    cache = _gguf_cache_dir(path)
    if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cache, trust_remote_code=False)
        except Exception:  # a corrupt or incompatible cache entry: rebuild it
            shutil.rmtree(cache, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                            trust_remote_code=False)
    except ValueError as e:  # e.g. no tokenizer.ggml.model: transformers' words name neither the file nor the way out
        raise ValueError(f"{path}: the GGUF file's tokenizer cannot be read ({e}); give the model's tokenizer "
                         "directory with --tokenizer DIR (model.tokenizer)") from e
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
        raise ValueError("this tokenizer has no chat template: send a plain prompt instead (/v1/completions, or /generate's "
                         "text), or serve with a tokenizer that has one (model.tokenizer / --tokenizer: a directory "
                         "with chat_template.jinja or a chat_template in tokenizer_config.json)")
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


if __name__ == "__main__":  # the serving processes prepare their tokenizer here: transformers and torch stay out of them
    import sys

    model, tokenizer = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None
    print(prepare_serving_tokenizer(model, tokenizer, again="--again" in sys.argv[3:]))
