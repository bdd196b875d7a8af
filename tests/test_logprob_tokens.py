"""Logprobs' `token`, `bytes`, `top_logprobs` and `text_offset` with a real byte-level BPE vocabulary
(the embedded SmolLM2's serving tokenizer) and a byte-fallback one: a token that holds part of a
UTF-8 character has its own bytes (not U+FFFD's) and a distinct `bytes:\\xNN` string; the bytes of
an output's tokens join to its text; the token that ended the generation (EOS, a stop token id)
is left out of chat logprobs (its text is not part of the content), and kept in text completions'
(one entry per generated token, which lm-evaluation-harness counts on). Through the HTTP app with a
scripted runtime that detokenizes as the real one does (no model run)."""

from __future__ import annotations

import asyncio

import pytest
from fake_runtime import HealthyRuntime, openai_client
from radixserve.runtime.detokenizer import IncrementalDetokenizer
from radixserve.serving_tokenizer import TokenBytes, load_serving_tokenizer
from radixserve.validation import ModelLimits

MODEL = "scripted"
PARTY = "🎉"  # F0 9F 8E 89: three byte-level tokens in SmolLM2's vocabulary


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path):
    return load_serving_tokenizer(smollm2_gguf_path)


# ---- the tokenizer's bytes of one token ---------------------------------------------------------


def test_byte_level_tokens_have_their_own_bytes(tok):
    ids = tok.encode(PARTY)
    assert [tok.decode([i]) for i in ids] == ["\ufffd"] * len(ids)  # what a per-token decode shows
    assert b"".join(tok.token_bytes(i) for i in ids) == PARTY.encode()
    assert all(tok.token_bytes(i) for i in ids)
    text = "Reply 🎉 with héllo, 日本語 and\n\ttabs <|im_end|>"
    assert b"".join(tok.token_bytes(i) for i in tok.encode(text)).decode() == text
    # every token whose bytes are a whole text on their own decodes to exactly that text
    for i in range(len(tok)):
        raw = tok.token_bytes(i)
        try:
            alone = raw.decode()
        except UnicodeDecodeError:
            continue
        assert alone == tok.decode([i]), i


@pytest.mark.parametrize("pipeline", ["sentencepiece", "metaspace"])
def test_byte_fallback_tokens_have_their_own_bytes(pipeline):
    """Llama / Mistral style: `▁` for a space, `<0xNN>` for bytes the vocabulary lacks, the first
    space of a whole text stripped by the decoder (a token keeps its own)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "b": 5, "▁a": 6, "ab": 7, "▁ab": 8}
    vocab.update({f"<0x{i:02X}>": 9 + i for i in range(256)})
    bpe = models.BPE(vocab=vocab, merges=[("▁", "a"), ("a", "b"), ("▁a", "b")], byte_fallback=True, unk_token="<unk>")
    t = Tokenizer(bpe)
    if pipeline == "sentencepiece":
        t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        t.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        t.pre_tokenizer = pre_tokenizers.Metaspace()
        t.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    read = TokenBytes(t)
    ids = t.encode("ab 🎉 ab").ids
    assert [read(i) for i in ids if 9 <= i < 9 + 256] == [bytes([b]) for b in PARTY.encode()]
    joined = b"".join(read(i) for i in ids).decode()
    assert joined == " ab 🎉 ab" and joined[1:] == t.decode(ids)


# ---- through the HTTP app -----------------------------------------------------------------------


class ScriptedTM(HealthyRuntime):
    """A runtime whose model writes `script` (ids of the real tokenizer), one token per step, then
    EOS (unless `eos` is False: the output ends by max_tokens). Token k has logprob -(k+1)/8 and
    its alternatives are `alts(k, sampled)` (the sampled token first). The text is detokenized as
    the runtime's detokenizer does it: multi-byte safe, the matched EOS left out."""

    def __init__(self, tok, script: list[int], eos: bool = True, alts=None) -> None:
        self.tokenizer = tok
        self.model_name = MODEL
        self.context_len = 2048
        self.script = script
        self.eos = eos
        self.alts = alts or (lambda k, sampled: [sampled])

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(vocab_size=len(self.tokenizer), context_len=self.context_len)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    async def generate(self, inp):
        sp = inp.sampling_params
        ids = list(self.script[: sp.max_new_tokens])
        if self.eos and len(ids) < sp.max_new_tokens:
            ids.append(self.tokenizer.eos_token_id)
        detok = IncrementalDetokenizer(self.tokenizer, list(inp.input_ids[-5:]), [], sp.skip_special_tokens)
        text, out_ids, lps, tops = "", [], [], []
        for k, t in enumerate(ids):
            last = k == len(ids) - 1
            finish = None
            if last:
                stop = t == self.tokenizer.eos_token_id
                finish = {"type": "stop", "matched": t} if stop else {"type": "length"}
            text += detok.push([] if finish and finish["type"] == "stop" else [t], final=last)
            out_ids.append(t)
            lps.append((-(k + 1) / 8, t))
            tops.append([(-(k + 1) / 8 - j / 4, a) for j, a in enumerate(self.alts(k, t)[: sp.top_logprobs])])
            if inp.stream or last:
                meta = {
                    "id": inp.rid, "prompt_tokens": len(inp.input_ids), "completion_tokens": len(out_ids),
                    "cached_tokens": 0, "finish_reason": finish,
                    "output_token_logprobs": list(lps) if inp.return_logprob else [],
                    "output_top_logprobs": list(tops) if inp.return_logprob else []}
                if sp.prompt_logprobs is not None:  # prompt token i has logprob -i/16 (the first none)
                    prompt = list(inp.input_ids)
                    meta["input_token_logprobs"] = [(None, prompt[0])] + [(-i / 16, t) for i, t in enumerate(prompt) if i]
                    meta["input_top_logprobs"] = [None] + [[(-i / 16, t)] for i, t in enumerate(prompt) if i]
                yield {"text": text, "output_ids": list(out_ids), "meta_info": meta}
            await asyncio.sleep(0)


def _alternatives(tok):
    """Five alternatives at every step, four of them byte-level pieces of emoji (all U+FFFD when
    decoded alone) and a newline."""
    partial = [i for i in dict.fromkeys(tok.encode("🎉🙂😀")) if tok.decode([i]) == "\ufffd"]
    pieces = partial[:4] + tok.encode("\n")
    assert len(set(pieces)) == 5 and len(partial) >= 4

    def alts(k, sampled):
        return [sampled] + [p for p in pieces if p != sampled][:4]

    return alts


def _chat_stream(oai, **kw) -> tuple[str, list]:
    content, logprobs = "", []
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            logprobs += ch.logprobs.content if ch.logprobs and ch.logprobs.content else []
    return content, logprobs


def test_chat_logprobs_of_partial_characters_carry_their_bytes(tok):
    tm = ScriptedTM(tok, tok.encode(PARTY + " " + PARTY), alts=_alternatives(tok))
    oai = openai_client(tm)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": f"Reply with only this emoji: {PARTY}"}],
              max_tokens=16, temperature=0, logprobs=True, top_logprobs=5)
    r = oai.chat.completions.create(**kw)
    msg, content = r.choices[0].message, r.choices[0].logprobs.content
    assert msg.content == PARTY + " " + PARTY and r.choices[0].finish_reason == "stop"
    assert b"".join(bytes(c.bytes) for c in content) == msg.content.encode()
    assert content[0].token == "bytes:\\xf0\\x9f" and content[0].bytes == [0xF0, 0x9F]
    assert all("\ufffd" not in c.token for c in content)
    for c in content:
        assert len(c.top_logprobs) == 5 and len({t.token for t in c.top_logprobs}) == 5
        assert (c.top_logprobs[0].token, c.top_logprobs[0].bytes) == (c.token, c.bytes)
        for t in c.top_logprobs:  # a string and its bytes always agree
            assert t.token == (bytes(t.bytes).decode() if not t.token.startswith("bytes:") else t.token)
    streamed, streamed_lp = _chat_stream(oai, **kw)
    assert streamed == msg.content
    assert [(c.token, c.bytes, c.logprob) for c in streamed_lp] == [(c.token, c.bytes, c.logprob) for c in content]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_leave_out_the_end_of_sequence_token(tok, stream):
    answer = "Hello there! How can I assist you today?"
    oai = openai_client(ScriptedTM(tok, tok.encode(answer)))
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20, temperature=0, logprobs=True)
    if stream:
        content, logprobs = _chat_stream(oai, **kw)
    else:
        r = oai.chat.completions.create(**kw)
        content, logprobs = r.choices[0].message.content, r.choices[0].logprobs.content
    assert content == answer
    assert "".join(c.token for c in logprobs) == answer and len(logprobs) == len(tok.encode(answer))
    assert all(c.token != "<|im_end|>" for c in logprobs)
    # an output cut by max_tokens keeps every token
    oai = openai_client(ScriptedTM(tok, tok.encode(answer), eos=False))
    r = oai.chat.completions.create(**{**kw, "max_tokens": 3})
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].logprobs.content) == 3


def _completion_stream(oai, **kw) -> tuple[str, dict]:
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in oai.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.text
            for key in lp:
                lp[key] += getattr(ch.logprobs, key) if ch.logprobs else []
    return text, lp


def test_completions_top_logprobs_keep_every_alternative_and_offsets_follow_the_text(tok):
    script = tok.encode(PARTY + PARTY + "\n") + tok.encode("ok")
    oai = openai_client(ScriptedTM(tok, script, alts=_alternatives(tok)))
    kw = dict(model=MODEL, prompt=PARTY * 3, max_tokens=16, temperature=0, logprobs=5)
    r = oai.completions.create(**kw)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text == PARTY + PARTY + "\nok"
    # the script's tokens, then the EOS that ended the output (not in the text: at its end)
    assert [len(top) for top in lp.top_logprobs] == [5] * (len(script) + 1)  # distinct keys: none overwritten
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value == max(top.values())  # the sampled token's own logprob
    assert lp.tokens[:3] == ["bytes:\\xf0\\x9f", "bytes:\\x8e", "bytes:\\x89"]
    # each token is at the character its text starts or continues
    assert lp.text_offset == [0, 0, 0, 1, 1, 1, 2, 3, len(text)]
    for off, token in zip(lp.text_offset[:-1], lp.tokens):
        assert off <= len(text)
        if not token.startswith("bytes:"):
            assert text[off:].startswith(token)
    assert _completion_stream(oai, **kw) == (text, lp.model_dump(include={"tokens", "token_logprobs", "top_logprobs",
                                                                         "text_offset"}))


def test_completions_logprobs_report_the_end_of_sequence_token(tok):
    oai = openai_client(ScriptedTM(tok, tok.encode(" Paris.")))
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    n = len(tok.encode(" Paris."))
    assert r.choices[0].text == " Paris." and "".join(lp.tokens[:n]) == " Paris."
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 1, "one entry per token"
    assert lp.tokens[-1] == tok.decode([tok.eos_token_id]) and lp.text_offset[-1] == len(" Paris.")
    text, streamed = _completion_stream(oai, model=MODEL, prompt="The capital of France is", max_tokens=8,
                                        temperature=0, logprobs=1)
    assert text == " Paris." and streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset


@pytest.mark.parametrize("stream", [False, True])
def test_echo_scoring_when_the_model_would_stop(tok, stream):
    """lm-evaluation-harness's loglikelihood request: `echo`, `logprobs: 1`, `max_tokens: 1`; it reads
    `token_logprobs[ctxlen:-1]`, so the one generated token must have its entry even when it is EOS."""
    oai = openai_client(ScriptedTM(tok, []))  # the model's first token is EOS
    prompt = tok.encode("The capital of France is Paris")
    kw = dict(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    if stream:
        text, lp = _completion_stream(oai, **kw)
    else:
        r = oai.completions.create(**kw)
        text, lp = r.choices[0].text, r.choices[0].logprobs.model_dump()
    assert text == tok.decode(prompt)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(prompt) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:-1] == [-i / 16 for i in range(1, len(prompt))]
    assert lp["tokens"][-1] == tok.decode([tok.eos_token_id]) and lp["text_offset"][-1] == len(text)
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
