"""Incremental detokenization with the real SmolLM2 tokenizer (byte-level BPE: Chinese and emoji are
split across tokens), stop strings, and the DetokenizerManager's request bookkeeping."""

from __future__ import annotations

import random

import pytest
from radixserve.model_loader.model_files import load_tokenizer, resolve_model_path
from radixserve.runtime.detokenizer import DetokenizerManager, IncrementalDetokenizer
from radixserve.runtime.messages import ReqTokenOut


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path(None))


def feed(tok, ids, chunk_sizes, **kw):
    """Push `ids` in chunks of the given sizes; returns (deltas, detokenizer)."""
    d = IncrementalDetokenizer(tok, **kw)
    deltas, i = [], 0
    for n in chunk_sizes:
        if i >= len(ids):
            break
        deltas.append(d.push(ids[i : i + n]))
        i += n
    deltas.append(d.push(ids[i:], final=True))
    return deltas, d


MULTIBYTE = "你好，世界！今天天气很好。🙂🚀👍🏽 naïve café — ok"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multibyte_text_is_never_broken(tok, seed):
    prompt = tok.encode("Say hi:")
    ids = tok.encode(MULTIBYTE)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the text must split characters across tokens"
    rng = random.Random(seed)
    sizes = [1] * len(ids) if seed == 0 else [rng.randint(1, 3) for _ in ids]
    deltas, _ = feed(tok, ids, sizes, context_ids=prompt[-5:])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE
    assert "" in deltas[:-1]  # some token ended mid-character and had to wait


def test_leading_space_survives_with_prompt_context(tok):
    prompt = tok.encode("Hello")
    ids = tok.encode(" world and more")
    deltas, _ = feed(tok, ids, [1] * len(ids), context_ids=prompt)
    assert "".join(deltas) == " world and more"


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_stop_string_is_trimmed_across_chunk_boundaries(tok, chunk):
    text = "The answer is 42. ENDOFTEXT and then more words"
    ids = tok.encode(text)
    deltas, d = feed(tok, ids, [chunk] * len(ids), stop=["ENDOFTEXT", "never"])
    assert d.matched_stop == "ENDOFTEXT"
    assert "".join(deltas) == "The answer is 42. "
    assert not any("END" in x for x in deltas)  # a stop prefix is held back, never shown


def test_a_stop_prefix_that_does_not_complete_is_released(tok):
    text = "I wrote END then ENDING here"
    ids = tok.encode(text)
    deltas, d = feed(tok, ids, [1] * len(ids), stop=["ENDGAME"])
    assert d.matched_stop is None
    assert "".join(deltas) == text


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("alpha beta gamma delta")
    deltas, d = feed(tok, ids, [len(ids)], stop=["delta", "beta"])
    assert d.matched_stop == "beta"
    assert "".join(deltas) == "alpha "


def out(rid, ids, fin=None, stream=True, **kw):
    return ReqTokenOut(rid=rid, new_ids=ids, finished_reason=fin, stream=stream, completion_tokens=0, **kw)


def test_manager_streams_and_finishes(tok):
    m = DetokenizerManager(tok)
    ids = tok.encode(" one two three")
    got = []
    for i, t in enumerate(ids):
        fin = {"type": "length"} if i == len(ids) - 1 else None
        got += m.handle([out("a", [t], fin, prompt_tail=tok.encode("count:") if i == 0 else None)])
    assert "".join(o.text_delta for o in got) == " one two three"
    assert [t for o in got for t in o.new_ids] == ids
    assert got[-1].finished_reason == {"type": "length"}
    assert m.states == {}


def test_manager_buffers_non_streaming_requests_until_the_end(tok):
    m = DetokenizerManager(tok)
    ids = tok.encode("quiet please")
    assert m.handle([out("q", ids[:1], stream=False)]) == []
    [final] = m.handle([out("q", ids[1:], {"type": "length"}, stream=False)])
    assert final.text_delta == "quiet please" and final.new_ids == ids


def test_manager_cuts_the_text_and_ids_of_a_stop_string_the_scheduler_matched(tok):
    """The scheduler ends the request and sends the stop string's tokens last (num_stop_tokens):
    they cut the text but are not returned, and the request is gone from the detokenizer."""
    before, stop_ids = tok.encode("yes "), tok.encode("STOP no")
    fin = {"type": "stop", "matched": "STOP"}
    [o] = DetokenizerManager(tok).handle(
        [out("s", before + stop_ids, fin, stop=["STOP"], num_stop_tokens=len(stop_ids), token_logprobs=[-0.5] * len(before))]
    )
    assert o.finished_reason == fin
    assert o.text_delta == "yes " and o.new_ids == before and o.token_logprobs == [-0.5] * len(before)


def test_manager_does_not_finish_a_request_on_its_own(tok):
    m = DetokenizerManager(tok)
    ids = tok.encode("yes STOP no")
    [first] = m.handle([out("s", ids, stop=["STOP"])])
    assert first.finished_reason is None and first.text_delta == "yes "  # the scheduler decides the end
    [last] = m.handle([out("s", [], {"type": "abort"}, stop=["STOP"])])
    assert last.finished_reason == {"type": "abort"} and m.states == {}


def test_matched_stop_token_is_not_in_the_text(tok):
    m = DetokenizerManager(tok)
    ids = tok.encode("Done.") + [tok.eos_token_id]
    [o] = m.handle([out("e", ids, {"type": "stop", "matched": tok.eos_token_id}, skip_special_tokens=False)])
    assert o.text_delta == "Done." and o.new_ids == ids


def test_scheduler_errors_pass_through(tok):
    m = DetokenizerManager(tok)
    [o] = m.handle([ReqTokenOut(rid="x", new_ids=[], error="too long", error_status=400)])
    assert o.error == "too long" and o.finished_reason["type"] == "abort"
