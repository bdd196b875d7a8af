"""Incremental detokenization (multi-byte safe, stop strings) and the detokenizer process.

Why offsets: decoding only the new ids loses context (leading spaces of sentencepiece/BPE pieces,
multi-byte characters split over tokens). Each step decodes a small window twice, from
`prefix_offset` to `read_offset` and from `prefix_offset` to the end, and emits the difference,
but only when it does not end in U+FFFD (an incomplete UTF-8 sequence): the bytes wait for the
next token instead of reaching the client as a broken character.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from radixserve.runtime.messages import BatchTextOut, ReqTextOut, ReqTokenOut

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class IncrementalDetokenizer:
    """Text of one request, grown token by token.

    Contract: `push(ids)` returns the text that may be shown now. Concatenating every return value
    (and `finish()`) gives the final text, which never contains a broken character that a later
    token completes, never contains a stop string or anything after it, and never shows a prefix
    of a stop string that later turns out to be one (held back until it is decided)."""

    tokenizer: Any
    context_ids: list[int] = field(default_factory=list)  # prompt tail: decode context, never emitted
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    ids: list[int] = field(init=False)
    prefix_offset: int = field(init=False)
    read_offset: int = field(init=False)
    text: str = field(init=False, default="")  # decoded text, cut at a matched stop string
    sent: int = field(init=False, default=0)  # chars of `text` already returned
    matched_stop: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.ids = list(self.context_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in self.stop if s]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if final:
            new_text = new_text.rstrip(REPLACEMENT_CHAR)  # an unfinished character never completes
        elif new_text.endswith(REPLACEMENT_CHAR):
            return ""
        if len(new_text) <= len(prefix_text):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add ids; return the newly showable text. `final`: no more ids will come."""
        if self.matched_stop is not None:
            return ""
        self.ids.extend(new_ids)
        before = len(self.text)
        self.text += self._advance(final)
        if self.stop:
            self._check_stop(before)
        return self._take(final or self.matched_stop is not None)

    def _check_stop(self, before: int) -> None:
        longest = max(len(s) for s in self.stop)
        start = max(0, before - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.matched_stop = best[1]

    def _held_back(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._held_back()
        if end <= self.sent:
            return ""
        out = self.text[self.sent : end]
        self.sent = end
        return out


@dataclass
class _ReqState:
    detok: IncrementalDetokenizer
    stream: bool
    pending_ids: list[int] = field(default_factory=list)
    pending_text: list[str] = field(default_factory=list)
    pending_logprobs: list[float] | None = None
    pending_top: list[Any] | None = None
    done: bool = False  # finished here (stop string) while the scheduler may still run it


class DetokenizerManager:
    """Turns the scheduler's token batches into text batches for the TokenizerManager.

    A request finished here by a stop string is reported with finish_reason
    {"type": "stop", "matched": <string>}; its later token outputs are dropped until the
    scheduler's own final output (the TokenizerManager aborts it there) clears the entry."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _ReqState] = {}

    def handle(self, batch: list[ReqTokenOut]) -> list[ReqTextOut]:
        outs: list[ReqTextOut] = []
        for item in batch:
            out = self._handle_one(item)
            if out is not None:
                outs.append(out)
        return outs

    def _handle_one(self, item: ReqTokenOut) -> ReqTextOut | None:
        if item.error is not None:
            self.states.pop(item.rid, None)
            return ReqTextOut(
                rid=item.rid,
                text_delta="",
                new_ids=[],
                error=item.error,
                error_status=item.error_status,
                finished_reason={"type": "abort", "message": item.error},
                prompt_tokens=item.prompt_tokens,
            )
        st = self.states.get(item.rid)
        if st is None:
            st = _ReqState(
                detok=IncrementalDetokenizer(
                    self.tokenizer, list(item.prompt_tail or []), list(item.stop), item.skip_special_tokens
                ),
                stream=item.stream,
            )
            self.states[item.rid] = st
        if st.done:
            if item.finished_reason is not None:
                del self.states[item.rid]
            return None
        fin = item.finished_reason
        abort_in_scheduler = False
        ids_for_text = item.new_ids
        if fin is not None and fin.get("type") == "stop" and isinstance(fin.get("matched"), int) and ids_for_text:
            ids_for_text = ids_for_text[:-1]  # a matched stop token is not part of the text
        delta = st.detok.push(ids_for_text, final=fin is not None)
        st.pending_ids.extend(item.new_ids)
        st.pending_text.append(delta)
        if item.token_logprobs is not None:
            st.pending_logprobs = (st.pending_logprobs or []) + list(item.token_logprobs)
        if item.top_logprobs is not None:
            st.pending_top = (st.pending_top or []) + list(item.top_logprobs)
        if st.detok.matched_stop is not None:
            abort_in_scheduler = fin is None
            if fin is None:
                st.done = True  # keep the entry as a tombstone until the scheduler's final output
            else:
                del self.states[item.rid]
            fin = {"type": "stop", "matched": st.detok.matched_stop}
        elif fin is not None:
            del self.states[item.rid]
        if fin is None and not st.stream:
            return None
        if fin is None and not st.pending_ids and not "".join(st.pending_text):
            return None
        out = ReqTextOut(
            rid=item.rid,
            text_delta="".join(st.pending_text),
            new_ids=st.pending_ids,
            finished_reason=fin,
            prompt_tokens=item.prompt_tokens,
            completion_tokens=item.completion_tokens,
            cached_tokens=item.cached_tokens,
            token_logprobs=st.pending_logprobs,
            top_logprobs=st.pending_top,
            abort_in_scheduler=abort_in_scheduler,
        )
        st.pending_ids, st.pending_text, st.pending_logprobs, st.pending_top = [], [], None, None
        return out

    def to_message(self, outs: list[ReqTextOut]) -> BatchTextOut:
        return BatchTextOut(outs)


class TokenizersDecoder:
    """`decode` straight from a tokenizer.json with the `tokenizers` library: all the detokenizer
    needs, without importing transformers and torch (several CPU-seconds of start-up on a small
    machine, taken from the scheduler loading the model next to it). For a fast tokenizer,
    transformers' decode with clean_up_tokenization_spaces=False is this same call."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(path)

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
    ) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_decoder(model_path: str, tokenizer_path: str | None = None) -> Any:
    """What the detokenizer decodes with: a TokenizersDecoder when a tokenizer.json exists,
    else the transformers tokenizer."""
    from radixserve.tokenizer import load_tokenizer, tokenizer_json

    path = tokenizer_json(model_path, tokenizer_path)
    return TokenizersDecoder(path) if path is not None else load_tokenizer(model_path, tokenizer_path)


def run_detokenizer_process(config_dict: dict, ports: Any, tokenizer_path: str, parent_pid: int) -> None:
    """Entry point of the detokenizer process (spawned by the TokenizerManager)."""
    import zmq

    from radixserve.runtime.ipc import install_parent_watchdog
    from radixserve.runtime.messages import (
        BatchTokenOut,
        ChildFailed,
        ReadyMessage,
        ShutdownRequest,
        detokenizer_decoder,
        make_encoder,
    )

    install_parent_watchdog(parent_pid)
    ctx = zmq.Context(1)
    recv = ctx.socket(zmq.PULL)
    recv.bind(ports.detokenizer_input)
    send = ctx.socket(zmq.PUSH)
    send.connect(ports.manager_input)
    enc, dec = make_encoder(), detokenizer_decoder()
    try:
        manager = DetokenizerManager(load_decoder(tokenizer_path))
    except Exception as e:
        send.send(enc.encode(ChildFailed(process="detokenizer", error=repr(e))))
        raise
    send.send(enc.encode(ReadyMessage(process="detokenizer")))
    while True:
        msg = dec.decode(recv.recv())
        if isinstance(msg, ShutdownRequest):
            break
        if isinstance(msg, BatchTokenOut):
            outs = manager.handle(msg.outs)
            if outs:
                send.send(enc.encode(BatchTextOut(outs)))
    recv.close(0)
    send.close(0)
    ctx.term()
