"""The tokenizer of the serving processes (the TokenizerManager's process, i.e. the HTTP front end
or the Engine's, and the detokenizer): the `tokenizers` library and jinja2, without transformers
(~50 MB of imports) or torch (~300 MB), over a directory prepared once per tokenizer by
transformers (`radixserve.tokenizer.prepare_serving_tokenizer`, run in a short-lived process).

It encodes, decodes and renders chat templates as the transformers tokenizer it was prepared from:
the backend pipeline is the one transformers' class configured (saved as tokenizer.json), and the
template runs in the environment transformers gives it (sandboxed, trim_blocks / lstrip_blocks,
its `tojson`, `raise_exception`, `strftime_now`, `{% generation %}` and loop controls; the special
tokens as variables). tests/test_serving_tokenizer.py holds it to transformers' output."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from typing import Any, TypeVar

from radixserve.heap import release_free_heap
from radixserve.model_loader.model_files import check_tokenizer_present
from radixserve.tokenizer import (
    SERVING_META_FILE,
    SERVING_TOKENIZER_FILE,
    is_local_source,
    is_prepared,
    serving_tokenizer_dir,
)

PREPARE_TIMEOUT_S = 900  # a Hub download of the tokenizer files may run inside
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message
# apply_chat_template arguments that only shape transformers' tokenized output (ignored here, as
# transformers ignores them with tokenize=False)
_TOKENIZE_ONLY = ("padding", "truncation", "max_length", "return_tensors", "return_dict",
                  "return_assistant_tokens_mask", "tokenizer_kwargs")


T = TypeVar("T")

# Tokenizing a long prompt off the event loop. The HTTP front end (and the Engine's TokenizerManager) run every
# request on one asyncio loop: a 4 MB prompt took ~2 s to tokenize inline, and /health, every stream and every
# other request waited that long (an operator's audit, session 26; a liveness probe times out at 1 s). Above
# LONG_TEXT_CHARS the work runs in a thread, and `ServingTokenizer.encode` of such a text releases the GIL.
LONG_TEXT_CHARS = 65536  # ~16k tokens: tens of milliseconds inline; beyond, off the loop


async def off_the_loop(size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, in a worker thread when `size` (characters of the text it tokenizes) is
    above LONG_TEXT_CHARS, else inline (a thread hop costs more than a short encode)."""
    if size > LONG_TEXT_CHARS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


class ServingTokenizer:
    """encode / decode / apply_chat_template of a prepared tokenizer directory, with the
    transformers signatures the serving code uses."""

    def __init__(self, directory: str) -> None:
        from tokenizers import Tokenizer

        with open(os.path.join(directory, SERVING_META_FILE)) as f:
            meta = json.load(f)
        self.directory = directory
        self._tokenizer = Tokenizer.from_file(os.path.join(directory, SERVING_TOKENIZER_FILE))
        # transformers encodes without the file's truncation / padding, special tokens kept whole
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._tokenizer.encode_special_tokens = bool(meta["split_special_tokens"])
        self.special_tokens_map: dict[str, str] = dict(meta["special_tokens_map"])
        self.chat_template: str | dict[str, str] | None = meta["chat_template"]
        self.clean_up_tokenization_spaces: bool = bool(meta["clean_up_tokenization_spaces"])
        self.all_special_ids: list[int] = list(meta["all_special_ids"])
        self.eos_token_id: int | None = meta["eos_token_id"]
        self.bos_token_id: int | None = meta["bos_token_id"]
        self.tokenizer_class: str = meta["tokenizer_class"]
        self._len = int(meta["vocab_size"])
        self._token_bytes: TokenBytes | None = None
        for name, token in self.special_tokens_map.items():  # eos_token, bos_token, ...
            setattr(self, name, token)
        release_free_heap()  # the parse of tokenizer.json leaves ~14 MB free in the heap

    def __len__(self) -> int:
        return self._len

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > LONG_TEXT_CHARS:  # the batch call releases the GIL (the single one holds it throughout)
            return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and self.clean_up_tokenization_spaces:  # False: a BPE model, where transformers skips it too
            text = _clean_up_tokenization(text)
        return text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tokenizer.id_to_token(i) for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to decoded text, read from the vocabulary through the decoder
        pipeline: a byte-level BPE piece (`ðŁ`) or a byte-fallback token (`<0xF0>`) may be part of a
        UTF-8 character, which `decode([token_id])` can only show as U+FFFD. Joined in order, the
        bytes of the tokens of an output are the UTF-8 of its text (a leading space that the
        decoder strips from the start of a whole text is kept: the token adds it after context)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self._tokenizer)
        return self._token_bytes(token_id)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        """The conversation rendered by the chat template (`tokenize`: its token ids, special
        tokens only as the template wrote them). Extra keyword arguments reach the template as
        variables, after the special tokens (`bos_token`, ...), which they override."""
        for name in _TOKENIZE_ONLY:
            kwargs.pop(name, None)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible: use "
                             "continue_final_message to continue the final message, add_generation_prompt to open a new one")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        template = self._template(chat_template, tools)
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ValueError("tools must be JSON schemas (dicts)")
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        messages = conversation
        final = None
        if continue_final_message:
            messages, final = _mark_final_message(messages, continue_final_message, template)
        text = _compiled(template).render(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )
        if final is not None:
            text = _cut_at_continue_tag(text, final)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, name: str | None, tools: list | None) -> str:
        """transformers' choice: a named template of a dict, the tool_use one when tools are given,
        else the default one; a string argument is a template itself."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if name is not None and name in templates:
                return templates[name]
            if name is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError("This model has multiple chat templates with no default specified; available "
                                 f"template names are {sorted(templates)}")
            return name
        if name is not None:
            return name
        if templates is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
        return templates


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-to-character table of byte-level BPE, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenBytes:
    """`token_bytes` of a `tokenizers.Tokenizer`: the decoder pipeline (its JSON) applied to one
    token without the steps that only concern a whole text (`Strip`, Metaspace's first space).
    Pipelines of other kinds (WordPiece, CTC, ...) fall back to `decode([id])` as UTF-8."""

    _BYTE_LEVEL = _byte_level_chars()

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = tokenizer.decoder
        spec = json.loads(decoder.__getstate__()) if decoder is not None else None
        steps = (spec.get("decoders") or []) if spec and spec.get("type") == "Sequence" else [spec] if spec else []
        self._steps: list[dict] | None = []
        for step in steps:
            kind = step.get("type")
            if kind in ("ByteLevel", "ByteFallback", "Fuse", "Strip", "Metaspace"):
                self._steps.append(step)
            elif kind == "Replace" and "String" in (step.get("pattern") or {}):
                self._steps.append(step)
            else:
                self._steps = None  # a step this reader does not know: decode() decides
                break
        if not steps:
            self._steps = None
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        raw = self._cache.get(token_id)
        if raw is None:
            raw = self._cache[token_id] = self._read(token_id)
        return raw

    def _read(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None or self._steps is None:
            return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
        text: str = piece
        for step in self._steps:
            kind = step["type"]
            if kind == "ByteLevel":
                table = self._BYTE_LEVEL
                return b"".join(bytes([table[c]]) if c in table else c.encode() for c in text)
            if kind == "ByteFallback":
                m = _BYTE_TOKEN.fullmatch(text)
                if m:
                    return bytes([int(m.group(1), 16)])
            elif kind == "Replace":
                text = text.replace(step["pattern"]["String"], step["content"])
            elif kind == "Metaspace":
                text = text.replace(step.get("replacement", "\u2581"), " ")
            # Fuse joins tokens, Strip trims a whole text's ends: nothing to do for one token
        return text.encode()


def load_serving_tokenizer(model_path: str, tokenizer_path: str | None = None) -> ServingTokenizer:
    """The serving tokenizer of a model (dir or .gguf) or tokenizer directory; the first time, its
    directory is prepared by `python -m radixserve.tokenizer` (transformers and torch are imported
    in that process, which exits, not in this one)."""
    check_tokenizer_present(model_path, tokenizer_path)
    directory = serving_tokenizer_dir(model_path, tokenizer_path)
    local = is_local_source(model_path, tokenizer_path)
    if not local or not is_prepared(directory):
        cmd = [sys.executable, "-m", "radixserve.tokenizer", model_path, tokenizer_path or ""] + ([] if local else ["--again"])
        # this process's import path, as the runtime's children get it (an Engine's script may extend it)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=PREPARE_TIMEOUT_S, env=env)
        if out.returncode != 0 or not is_prepared(directory):
            lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
            raise RuntimeError(f"cannot load the tokenizer of {tokenizer_path or model_path!r}: "
                               f"{lines[-1] if lines else f'exit code {out.returncode}'}")
    return ServingTokenizer(directory)


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (spaces a word-piece decode leaves before punctuation)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _mark_final_message(messages: list[dict], key: bool | str, template: str) -> tuple[list[dict], str]:
    """The conversation with transformers' continue tag after the final message's text, and that text."""
    key = key if isinstance(key, str) else "content"
    messages = copy.deepcopy(messages)
    final = messages[-1].get(key)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{key}" to continue!')
    if key not in template:
        raise ValueError(f'continue_final_message is set to "{key}" but this is not an accepted field in the chat_template')
    if isinstance(final, list | tuple):
        for block in reversed(final):
            if "text" in block:
                final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                break
        else:
            raise ValueError("continue_final_message is set but we could not find any text to continue in the final message!")
    else:
        messages[-1][key] = final + _CONTINUE_TAG
    return messages, final


def _cut_at_continue_tag(text: str, final: str) -> str:
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template")
    at = text.rindex(_CONTINUE_TAG.strip())
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


@lru_cache(maxsize=16)
def _compiled(template: str):
    return _environment().from_string(template)


def template_texts(chat_template: Any) -> list[str]:
    """The text of each of a tokenizer's chat templates: a string, or a dict of named ones (`default`,
    `tool_use`: transformers picks one per call); none when it has no template."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return [t for t in templates if isinstance(t, str)]


def template_reads_content_parts(template: str) -> bool:
    """Whether a chat template loops over a message's `content` (`{% for part in message['content'] %}`,
    Gemma 3's, Llama 4's): it takes OpenAI's list of `{"type": "text", ...}` parts itself, where a
    template that only writes `content` needs one string (vLLM's "openai" vs "string" content format).
    A template that does not parse reads none."""
    import jinja2
    import jinja2.nodes

    try:
        tree = _environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False

    def names_content(node) -> bool:
        return (isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == "content") or (isinstance(node, jinja2.nodes.Getattr) and node.attr == "content")

    return any(names_content(loop.iter) for loop in tree.find_all(jinja2.nodes.For))


@lru_cache(maxsize=1)
def _environment():
    """The sandboxed Jinja environment chat templates render in (transformers' settings and helpers)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (marks assistant tokens for training): the body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not jinja's: no HTML escaping, and the options templates pass
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
