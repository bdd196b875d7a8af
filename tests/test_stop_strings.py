"""Stop strings end a request inside the scheduler, on the step the string appears.

The toy runner is scripted to produce the real SmolLM2 tokenization of a known text, so stop strings
can span token boundaries and multi-byte characters (byte-level BPE splits Chinese and emoji over
several tokens). The scheduler's outputs then go through the real DetokenizerManager."""

from __future__ import annotations

import pytest
import radixserve.testing.toy_runner as toy
from radixserve.config import Config
from radixserve.model_loader.model_files import load_tokenizer, resolve_model_path
from radixserve.plugins.registry import Registry
from radixserve.runtime.detokenizer import DetokenizerManager
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.scheduler.stop_strings import StopStringMatcher
from radixserve.state import SamplingParams
from radixserve.testing import ToyRunner

TEXT = "The answer is 42.\n\nNext question: 你好，世界🙂🚀 is the greeting. END of the story, and more words after it."
PROMPT = [101, 102, 103, 104, 105, 106]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path(None))


@pytest.fixture
def scripted(tok, monkeypatch):
    """The toy model answers PROMPT with the tokens of TEXT, then repeats a filler token forever."""
    script = tok.encode(TEXT, add_special_tokens=False)
    filler = tok.encode(" and", add_special_tokens=False)[0]

    def next_token(ids, vocab_size):
        ids = [int(t) for t in ids]
        assert ids[: len(PROMPT)] == PROMPT
        k = len(ids) - len(PROMPT)
        return script[k] if k < len(script) else filler

    monkeypatch.setattr(toy, "toy_next_token", next_token)
    return script


def make(tok, overlap=False, **scheduler) -> Scheduler:
    runner = ToyRunner(vocab_size=len(tok))
    config = Config.build({"scheduler": scheduler, "runtime": {"overlap": overlap}})
    return Scheduler.from_config(config, runner, Registry.from_config(config), tokenizer=tok)


def run(sched: Scheduler, detok: DetokenizerManager, stop, stream=False, max_new=400, **sp):
    sched.add_request(
        GenerateRequest(
            rid="r",
            input_ids=PROMPT,
            sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0, stop=stop, logprobs=True, **sp),
            stream=stream,
        )
    )
    token_outs, text_outs = [], []
    for _ in range(10_000):
        if not sched.has_work():
            break
        outs = sched.step()
        token_outs += outs
        text_outs += detok.handle(outs)
    return token_outs, text_outs


def tokens_before(tok, script, position):
    """The most leading tokens of `script` that decode to whole characters ending at or before
    `position` of TEXT."""
    best = 0
    for n in range(1, len(script) + 1):
        text = tok.decode(script[:n])
        if len(text) > position:
            break
        if not text.endswith("\ufffd"):
            best = n
    return best


def completing_token(tok, script, stop):
    """1-based index of the token whose text completes the first occurrence of `stop`."""
    end = TEXT.index(stop) + len(stop)
    for n in range(1, len(script) + 1):
        if len(tok.decode(script[:n]).rstrip("\ufffd")) >= end:
            return n
    raise AssertionError(stop)


STOPS = {
    "across tokens": "\n\nNext",
    "multi-byte": "世界🙂",
    "inside one emoji's bytes and the next": "🙂🚀",
    "later word": "END",
}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("stop", list(STOPS.values()), ids=list(STOPS))
def test_a_stop_string_ends_the_request_in_the_scheduler(tok, scripted, stop, stream, overlap):
    sched, detok = make(tok, overlap=overlap, stream_interval=1), DetokenizerManager(tok)
    token_outs, text_outs = run(sched, detok, [stop, "never appears"], stream=stream)

    final = text_outs[-1]
    assert final.finished_reason == {"type": "stop", "matched": stop}
    text = "".join(o.text_delta for o in text_outs)
    assert text == TEXT[: TEXT.index(stop)]
    ids = [t for o in text_outs for t in o.new_ids]
    logprobs = [lp for o in text_outs for lp in o.token_logprobs or []]
    keep = tokens_before(tok, scripted, TEXT.index(stop))
    assert ids == scripted[:keep]  # no token of the stop string (or after it) is returned
    assert len(logprobs) == len(ids)  # the stop token's logprob is dropped with it

    stats = sched.stats()
    assert stats["finished_requests"] == 1 and stats["aborted_requests"] == 0
    # ended on the step the stop string appeared: no decode after it (overlap: the one in flight)
    assert stats["generated_tokens"] == completing_token(tok, scripted, stop)
    assert len(sched.runner.batches) <= completing_token(tok, scripted, stop) + int(overlap)
    assert stats["running"] == 0 and not sched.meta
    assert sched.flush_cache() and sched.allocator.available_size() == sched.allocator.size


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("stop", list(STOPS.values()), ids=list(STOPS))
def test_no_stop_trim_keeps_the_stop_string_and_its_tokens(tok, scripted, stop, stream):
    """SGLang's no_stop_trim (vLLM's include_stop_str_in_output): the text ends with the matched stop string
    (what its last token holds past the string is still cut), the ids and logprobs include the tokens that made
    it, and the request ends on the same step as without the option."""
    sched, detok = make(tok, stream_interval=1), DetokenizerManager(tok)
    _, text_outs = run(sched, detok, [stop, "never appears"], stream=stream, no_stop_trim=True)
    assert text_outs[-1].finished_reason == {"type": "stop", "matched": stop}
    assert "".join(o.text_delta for o in text_outs) == TEXT[: TEXT.index(stop) + len(stop)]
    ids = [t for o in text_outs for t in o.new_ids]
    assert ids == scripted[: completing_token(tok, scripted, stop)]
    assert len([lp for o in text_outs for lp in o.token_logprobs or []]) == len(ids)
    assert sched.stats()["generated_tokens"] == completing_token(tok, scripted, stop)


def completing_token_at(tok, script, end):
    """1-based index of the token whose text reaches character `end` of TEXT."""
    for n in range(1, len(script) + 1):
        if len(tok.decode(script[:n]).rstrip("\ufffd")) >= end:
            return n
    raise AssertionError(end)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_min_tokens_holds_back_a_stop_string_until_then(tok, scripted, stream, overlap):
    """As vLLM and SGLang (and as EOS): a stop string that ends within the first min_tokens tokens does
    not end the request; the next occurrence, completed by a later token, does."""
    first, second = TEXT.index(" is"), TEXT.index(" is", TEXT.index(" is") + 1)
    held = completing_token_at(tok, scripted, first + 3)
    sched, detok = make(tok, overlap=overlap, stream_interval=1), DetokenizerManager(tok)
    _, text_outs = run(sched, detok, [" is"], stream=stream, min_new_tokens=held)

    assert text_outs[-1].finished_reason == {"type": "stop", "matched": " is"}
    assert "".join(o.text_delta for o in text_outs) == TEXT[:second]
    ids = [t for o in text_outs for t in o.new_ids]
    assert ids == scripted[: tokens_before(tok, scripted, second)]
    assert len([lp for o in text_outs for lp in o.token_logprobs or []]) == len(ids)
    assert sched.stats()["generated_tokens"] == completing_token_at(tok, scripted, second + 3)
    assert sched.stats()["finished_requests"] == 1
    assert sched.flush_cache() and sched.allocator.available_size() == sched.allocator.size

    # one token fewer: the first occurrence now ends past the hold, and ends the request
    sched, detok = make(tok, overlap=overlap, stream_interval=1), DetokenizerManager(tok)
    _, text_outs = run(sched, detok, [" is"], stream=stream, min_new_tokens=held - 1)
    assert "".join(o.text_delta for o in text_outs) == TEXT[:first]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_may_start_inside_the_min_tokens_hold(tok, scripted, stream):
    """Only where a stop string ends counts: one that starts in the held text and ends after it matches."""
    stop = "\n\nNext"
    held = completing_token_at(tok, scripted, TEXT.index(stop) + 2)  # the text up to and with "\n\n"
    assert held < completing_token(tok, scripted, stop)
    sched, detok = make(tok, stream_interval=1), DetokenizerManager(tok)
    _, text_outs = run(sched, detok, [stop], stream=stream, min_new_tokens=held)
    assert text_outs[-1].finished_reason == {"type": "stop", "matched": stop}
    assert "".join(o.text_delta for o in text_outs) == TEXT[: TEXT.index(stop)]
    assert sched.stats()["generated_tokens"] == completing_token(tok, scripted, stop)


def test_stop_matcher_holds_only_leading_tokens(tok):
    ids = tok.encode("stop here, stop there", add_special_tokens=False)
    m = StopStringMatcher(tok, ["stop"])
    assert m.push(ids[0], search=False) is None and m.held == 1  # "stop" itself, held
    with pytest.raises(ValueError, match="leading tokens"):
        m.push(ids[1]) or m.push(ids[2], search=False)
    assert m.matched is None


def test_a_streamed_stop_prefix_is_never_sent_before_it_is_decided(tok, scripted):
    """Streaming one token at a time: nothing of the stop string reaches the client, ids included."""
    stop = "\n\nNext"
    sched, detok = make(tok, stream_interval=1), DetokenizerManager(tok)
    token_outs, text_outs = run(sched, detok, [stop], stream=True)
    keep = tokens_before(tok, scripted, TEXT.index(stop))
    for o in token_outs[:-1]:
        assert o.finished_reason is None and o.num_stop_tokens == 0
    streamed = [t for o in token_outs[:-1] for t in o.new_ids]
    assert streamed == scripted[: len(streamed)] and len(streamed) <= keep
    assert len(text_outs) > 2  # it did stream
    assert all("\n" not in o.text_delta for o in text_outs)


def test_a_stop_prefix_that_does_not_complete_is_streamed_in_the_end(tok, scripted):
    stop = "\n\nNever"  # "\n\n" is held back until "Next" shows it is not this stop string
    sched, detok = make(tok, stream_interval=1), DetokenizerManager(tok)
    _, text_outs = run(sched, detok, [stop], stream=True, max_new=20)
    assert text_outs[-1].finished_reason == {"type": "length"}
    n = sched.stats()["generated_tokens"]
    assert n == 20
    assert "".join(o.text_delta for o in text_outs) == tok.decode(scripted[:20])
    assert [t for o in text_outs for t in o.new_ids] == scripted[:20]


def test_stop_matcher_counts_tokens_around_multibyte_characters(tok):
    ids = tok.encode("ab 🙂🙂 cd", add_special_tokens=False)
    m = StopStringMatcher(tok, ["🙂 c"])
    for i, t in enumerate(ids):
        if m.push(t) is not None:
            break
        assert m.safe <= i + 1
    assert m.matched == "🙂 c"
    assert tok.decode(ids[: m.keep]) == "ab 🙂"  # the second emoji's bytes are part of the stop string
