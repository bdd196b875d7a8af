"""`grammar_after`: a constraint that starts once the output contains a marker (the end of a
reasoning section). Before it the output is the model's own (here the toy runner's greedy tokens),
after it the grammar holds; the chat layer sets it for response_format with a reasoning parser."""

from __future__ import annotations

import re

import pytest
from radixserve.config import Config
from radixserve.plugins.registry import Registry
from radixserve.scheduler import Scheduler
from radixserve.scheduler.grammar import GrammarService
from radixserve.state import SamplingParams
from radixserve.testing import ToyRunner, tiny_tokenizer, toy_reference
from radixserve_grammar_xgrammar.backend import XGrammarBackend
from test_grammar import EOS, add, run, text

VOCAB = 297  # the tiny tokenizer's size: every toy token decodes to text

PROMPT = [3, 4, 5]
REGEX = r"(yes|no)! [a-c]{3}"


@pytest.fixture(scope="module")
def tok():
    t = tiny_tokenizer()
    assert len(t) == VOCAB
    return t


def make_scheduler(tok, overlap: bool = False) -> Scheduler:
    runner = ToyRunner(vocab_size=VOCAB, eos_token_ids=(EOS,))
    service = GrammarService("xgrammar", lambda: XGrammarBackend(tok, VOCAB, [EOS]))
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    config = Config.build({"runtime": {"overlap": overlap}})
    return Scheduler(config, runner, cache, reg.load("policy", "fcfs")(), tok, grammar=service)


def free_marker(tok) -> tuple[str, int]:
    """A marker the toy writes by itself: the text of its first k greedy tokens (k: the first
    count whose text has 2+ characters), and k."""
    ref = toy_reference(PROMPT, 40, VOCAB, frozenset({EOS}))
    for k in range(1, len(ref)):
        marker = tok.decode(ref[:k])
        if len(marker.strip("\x00 ")) >= 2 and EOS not in ref[:k] and "\ufffd" not in marker:
            return marker, k
    raise AssertionError("the toy's output has no usable marker")


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_grammar_starts_after_the_marker(tok, overlap):
    marker, k = free_marker(tok)
    s = make_scheduler(tok, overlap)
    add(s, "r", PROMPT, max_new=60, regex=REGEX, grammar_after=marker)
    add(s, "plain", [7, 30, 40, 5], max_new=20)
    got = run(s)
    ids = got["r"]["ids"]
    assert ids[:k] == toy_reference(PROMPT, k, VOCAB, frozenset({EOS}))  # the "reasoning": unconstrained
    assert re.fullmatch(REGEX, text(tok, ids[k:])), text(tok, ids)  # the answer: constrained
    assert got["r"]["finish"]["type"] == "stop"
    assert got["plain"]["ids"] == toy_reference([7, 30, 40, 5], 20, VOCAB, frozenset({EOS}))


def test_without_the_marker_the_output_stays_unconstrained(tok):
    s = make_scheduler(tok)
    add(s, "r", PROMPT, max_new=12, regex=REGEX, grammar_after="<never written>")
    got = run(s)
    assert got["r"]["ids"] == toy_reference(PROMPT, 12, VOCAB, frozenset({EOS}))


def test_grammar_after_needs_a_constraint():
    with pytest.raises(ValueError, match="grammar_after needs a constraint"):
        SamplingParams(grammar_after="</think>").validate()
    with pytest.raises(ValueError, match="grammar_after must be a non-empty string"):
        SamplingParams(regex="a", grammar_after="").validate()
