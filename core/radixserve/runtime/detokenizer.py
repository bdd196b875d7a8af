"""Incremental detokenization (multi-byte safe, stop strings cut and held back) and the detokenizer
process. The decoding itself (`IncrementalDecoder`) is shared with the scheduler, which ends a
request on the step a stop string appears; this side cuts the text there and keeps a possible
stop-string prefix from being streamed before it is decided.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from radixserve.runtime.messages import BatchTextOut, ReqTextOut, ReqTokenOut
from radixserve.scheduler.stop_strings import IncrementalDecoder, find_stop, stop_prefix_len

logger = logging.getLogger(__name__)


@dataclass
class IncrementalDetokenizer:
    """Text of one request, grown token by token.

    Contract: `push(ids)` returns the text that may be shown now. Concatenating every return value
    (the last push with final=True) gives the final text, which never contains a broken character that a later
    token completes, never contains a stop string (with `keep_stop`: ends with the first one it matched) or
    anything after it, and never shows a prefix of a stop string before it is decided (held back)."""

    tokenizer: Any
    context_ids: list[int] = field(default_factory=list)  # prompt tail: decode context, never emitted
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    keep_stop: bool = False  # SamplingParams.no_stop_trim: cut after the matched stop string, not before it
    text: str = field(init=False, default="")  # decoded text, cut at a matched stop string
    sent: int = field(init=False, default=0)  # chars of `text` already returned
    matched_stop: str | None = field(init=False, default=None)
    pushed: int = field(init=False, default=0)  # ids pushed so far

    def __post_init__(self) -> None:
        self.stop = [s for s in self.stop if s]
        self._decoder = IncrementalDecoder(self.tokenizer, self.context_ids, self.skip_special_tokens)

    def push(self, new_ids: list[int], final: bool = False, stop_hold: int = 0) -> str:
        """Add ids; return the newly showable text. `final`: no more ids will come. `stop_hold`: how many
        leading ids of the whole output a stop string may not end in (ReqTokenOut.stop_hold: the
        scheduler's min_new_tokens hold; its StopStringMatcher makes the same cut)."""
        if self.matched_stop is not None:
            return ""
        held = min(max(stop_hold - self.pushed, 0), len(new_ids))
        self.pushed += len(new_ids)
        if held:
            self.text += self._decoder.push(new_ids[:held]) or ""
        before = len(self.text)
        self.text += self._decoder.push(new_ids[held:], final) or ""
        if self.stop:
            hit = find_stop(self.text, self.stop, before)
            if hit is not None:
                self.text = self.text[: hit[0] + (len(hit[1]) if self.keep_stop else 0)]
                self.matched_stop = hit[1]
        done = final or self.matched_stop is not None
        end = len(self.text) if done else len(self.text) - stop_prefix_len(self.text, self.stop)
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
    pending_prompt: tuple[list[float], list[Any] | None] | None = None  # prompt logprobs, sent once


class DetokenizerManager:
    """Turns the scheduler's token batches into text batches for the TokenizerManager.

    The scheduler decides when a request ends (a stop string included); this side turns ids into
    text, cuts it before a matched stop string or stop token, and leaves out of the returned ids
    the trailing `num_stop_tokens` ids that belong to a matched stop string."""

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
            )
        st = self.states.get(item.rid)
        if st is None:
            st = _ReqState(
                detok=IncrementalDetokenizer(
                    self.tokenizer, list(item.prompt_tail or []), list(item.stop), item.skip_special_tokens,
                    keep_stop=item.no_stop_trim,
                ),
                stream=item.stream,
            )
            self.states[item.rid] = st
        fin = item.finished_reason
        ids_for_text = item.new_ids
        if fin is not None and fin.get("type") == "stop" and isinstance(fin.get("matched"), int) and ids_for_text:
            ids_for_text = ids_for_text[:-1]  # a matched stop token is not part of the text
        delta = st.detok.push(ids_for_text, final=fin is not None, stop_hold=item.stop_hold)
        returned = item.new_ids[: len(item.new_ids) - item.num_stop_tokens]
        st.pending_ids.extend(returned)
        st.pending_text.append(delta)
        if item.token_logprobs is not None:
            st.pending_logprobs = (st.pending_logprobs or []) + list(item.token_logprobs)
        if item.top_logprobs is not None:
            st.pending_top = (st.pending_top or []) + list(item.top_logprobs)
        if item.prompt_token_logprobs is not None:
            st.pending_prompt = (item.prompt_token_logprobs, item.prompt_token_ranks, item.prompt_top_logprobs)
        if fin is not None:
            del self.states[item.rid]
        elif not st.stream:
            return None
        elif not st.pending_ids and not "".join(st.pending_text):
            return None
        out = ReqTextOut(
            rid=item.rid,
            text_delta="".join(st.pending_text),
            new_ids=st.pending_ids,
            finished_reason=fin,
            completion_tokens=item.completion_tokens,
            cached_tokens=item.cached_tokens,
            spec_verify_ct=item.spec_verify_ct,
            spec_accepted_drafts=item.spec_accepted_drafts,
            token_logprobs=st.pending_logprobs,
            top_logprobs=st.pending_top,
        )
        if st.pending_prompt is not None:
            out.prompt_token_logprobs, out.prompt_token_ranks, out.prompt_top_logprobs = st.pending_prompt
        st.pending_ids, st.pending_text, st.pending_logprobs, st.pending_top = [], [], None, None
        st.pending_prompt = None
        return out

    def to_message(self, outs: list[ReqTextOut]) -> BatchTextOut:
        return BatchTextOut(outs)


def run_detokenizer_process(config_dict: dict, ports: Any, tokenizer_path: str, parent_pid: int) -> None:
    """Entry point of the detokenizer process (spawned by the TokenizerManager). `tokenizer_path`:
    the prepared serving-tokenizer directory (the TokenizerManager's `tokenizer.directory`), read
    with the `tokenizers` library: no transformers or torch import next to the scheduler loading the model."""
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
    from radixserve.serving_tokenizer import ServingTokenizer

    install_parent_watchdog(parent_pid)
    ctx = zmq.Context(1)
    recv = ctx.socket(zmq.PULL)
    recv.bind(ports.detokenizer_input)
    send = ctx.socket(zmq.PUSH)
    send.connect(ports.manager_input)
    enc, dec = make_encoder(), detokenizer_decoder()
    try:
        manager = DetokenizerManager(ServingTokenizer(tokenizer_path))
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
