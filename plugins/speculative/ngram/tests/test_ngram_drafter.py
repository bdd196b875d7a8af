"""The n-gram drafter: what it proposes on copy-heavy text, its bounded memory, tree shapes, and
that finished requests leave nothing behind (plus the drafter conformance kit)."""

from __future__ import annotations

import random
import time

import pytest
from radixserve.plugins.registry import Registry
from radixserve.state import Req, SamplingParams
from radixserve.testing import check_drafter, drafter_info
from radixserve_spec_ngram.drafter import NgramDrafter
from radixserve_spec_ngram.trie import NgramTrie

VOCAB = 5000


def _req(rid: str, prompt: list[int], output: list[int] | None = None) -> Req:
    r = Req(rid, list(prompt), SamplingParams(temperature=0.0))
    r.output_ids = list(output or [])
    return r


def _text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _accept(drafter: NgramDrafter, req: Req, tokens: list[int]) -> None:
    req.output_ids.extend(tokens)
    drafter.on_accepted(req, tokens)


def test_conformance_kit():
    check_drafter(NgramDrafter, options={"capacity": 4096}, min_acceptance=1.0)
    check_drafter(NgramDrafter, options={"min_match_window": 2, "max_match_window": 4, "rank": "recency"},
                  topk=(1, 2), num_draft_tokens=8, min_acceptance=1.0)


def test_registered_as_the_ngram_drafter():
    registry = Registry.discover()
    assert registry.load("drafter", "ngram") is NgramDrafter
    assert registry.get("drafter", "ngram").supports_device("cpu")
    assert registry.get("drafter", "ngram").supports_device("cuda")


def test_a_copy_of_the_prompt_is_drafted_token_for_token():
    rng = random.Random(0)
    passage = _text(rng, 300)
    prompt = _text(rng, 20) + passage + _text(rng, 10)  # "rewrite this passage: ..."
    drafter = NgramDrafter(drafter_info(vocab_size=VOCAB, num_draft_tokens=6))
    req = _req("copy", prompt)
    _accept(drafter, req, passage[:3])  # the answer starts quoting the passage
    for pos in range(3, 200, 7):
        proposal = drafter.propose([req], 6)
        assert proposal.parents is None  # chains unless trees were asked for
        assert proposal.tokens == [passage[pos : pos + 6]], f"at passage position {pos}"
        _accept(drafter, req, passage[pos : pos + 7])  # 6 accepted drafts + the target's token


def test_no_draft_without_a_match_and_none_for_unseen_text():
    rng = random.Random(1)
    drafter = NgramDrafter(drafter_info(vocab_size=VOCAB))
    req = _req("fresh", _text(rng, 50), _text(rng, 1))
    assert drafter.propose([req], 4).tokens == [[]]


def test_min_match_window_refuses_short_matches():
    drafter = NgramDrafter(drafter_info(vocab_size=VOCAB), min_match_window=3)
    req = _req("r", [1, 2, 3, 4, 9, 9, 9, 3], [4])  # "3 4" was seen (followed by 9): only a 2-token match
    assert drafter.propose([req], 4).tokens == [[]]
    loose = NgramDrafter(drafter_info(vocab_size=VOCAB), min_match_window=1)
    assert loose.propose([_req("r", [1, 2, 3, 4, 9, 9, 9, 3], [4])], 4).tokens[0][:1] == [9]


def test_the_index_is_shared_across_requests():
    rng = random.Random(2)
    doc = _text(rng, 100)
    drafter = NgramDrafter(drafter_info(vocab_size=VOCAB))
    first = _req("a", doc)
    drafter.propose([first], 4)  # feeds the first request's prompt
    other = _req("b", _text(rng, 30), doc[40:45])  # another request starts quoting the same document
    drafter.on_accepted(other, doc[40:45])
    assert drafter.propose([other], 4).tokens == [doc[45:49]]


def test_frequency_and_recency_ranking():
    # "5 6" was followed by 7 twice and then by 8 once (most recently)
    history = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 8, 3, 5]
    freq = NgramDrafter(drafter_info(vocab_size=VOCAB), max_match_window=2)
    assert freq.propose([_req("r", history, [6])], 1).tokens == [[7]]
    recent = NgramDrafter(drafter_info(vocab_size=VOCAB), max_match_window=2, rank="recency")
    assert recent.propose([_req("r", history, [6])], 1).tokens == [[8]]


def test_tree_drafts_are_well_formed_and_start_with_the_chain():
    rng = random.Random(3)
    words = [_text(rng, 4) for _ in range(6)]
    history = []
    for _ in range(60):  # a phrase followed by several different continuations
        history += [11, 12] + rng.choice(words)
    seen = [history[i + 2] for i in range(len(history) - 2) if history[i : i + 2] == [11, 12]]
    by_frequency = sorted(set(seen), key=lambda t: (seen.count(t), max(i for i, s in enumerate(seen) if s == t)),
                          reverse=True)
    for k in (1, 3, 8, 16):
        # a 2-token window: the match is "11 12" itself, followed by all six words
        tree_drafter = NgramDrafter(drafter_info(vocab_size=VOCAB, num_draft_tokens=k, topk=3), max_match_window=2)
        chain_drafter = NgramDrafter(drafter_info(vocab_size=VOCAB, num_draft_tokens=k, topk=1), max_match_window=2)
        tree = tree_drafter.propose([_req("t", history, [11, 12])], k)
        chain = chain_drafter.propose([_req("t", history, [11, 12])], k)
        tokens, parents = tree.tokens[0], tree.parents[0]
        assert 1 <= len(tokens) <= k and len(parents) == len(tokens)
        assert all(-1 <= p < j for j, p in enumerate(parents)), parents
        siblings = [(p, t) for p, t in zip(parents, tokens)]
        assert len(set(siblings)) == len(siblings), "two children of one node with the same token"
        assert all(sum(1 for p in parents if p == j) <= 3 for j in range(-1, len(tokens))), "more than topk children"
        # best first: the root's branches are the most frequent words' first tokens, most frequent first
        roots = [t for t, p in zip(tokens, parents) if p == -1]
        assert roots == by_frequency[: len(roots)], (roots, by_frequency)
        if k == 16:
            assert len(roots) == 3, "each node offers its three best continuations"
        # following the first child at each level (what a core without tree support keeps) is the chain
        path, node = [], -1
        while (child := next((j for j, p in enumerate(parents) if p == node), None)) is not None:
            path.append(tokens[child])
            node = child
        assert path == chain.tokens[0][: len(path)] and path, (path, chain.tokens[0])


def test_trees_only_when_the_backend_verifies_them():
    history = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1]
    no_tree = NgramDrafter(drafter_info(vocab_size=VOCAB, topk=3, supports_tree=False))
    proposal = no_tree.propose([_req("r", history, [2])], 4)
    assert proposal.parents is None and len(proposal.tokens[0]) >= 1


def test_capacity_bounds_the_trie_and_evicts_the_least_recently_used():
    rng = random.Random(4)
    drafter = NgramDrafter(drafter_info(vocab_size=VOCAB), capacity=2000, max_match_window=4)
    old = _text(rng, 200)
    drafter.propose([_req("old", old)], 4)
    drafter.on_finished(_req("old", old))
    for i in range(20):  # a stream of other requests' text
        req = _req(f"r{i}", _text(rng, 150))
        drafter.propose([req], 4)
        drafter.on_finished(req)
        assert len(drafter.trie) <= 2000
    assert drafter.trie.evicted > 0
    # the old document was evicted: quoting it no longer drafts; the latest text still does
    assert drafter.propose([_req("q1", [7], old[50:54])], 4).tokens == [[]]
    recent = req.origin_input_ids
    assert drafter.propose([_req("q2", [7], recent[50:54])], 4).tokens == [recent[54:58]]


def test_a_request_survives_eviction_of_its_own_suffix_nodes():
    rng = random.Random(5)
    drafter = NgramDrafter(drafter_info(vocab_size=VOCAB), capacity=200, max_match_window=4)
    slow = _req("slow", _text(rng, 30))
    drafter.propose([slow], 4)
    for i in range(10):  # other requests push the slow one's nodes out
        drafter.propose([_req(f"x{i}", _text(rng, 100))], 4)
    tail = slow.origin_input_ids[-3:]
    _accept(drafter, slow, tail)  # now quoting its own (evicted, then re-fed) prompt tail
    proposal = drafter.propose([slow], 4)
    assert len(proposal.tokens[0]) <= 4 and len(drafter.trie) <= 200


def test_finished_requests_leave_no_state():
    rng = random.Random(6)
    drafter = NgramDrafter(drafter_info(vocab_size=VOCAB))
    reqs = [_req(f"r{i}", _text(rng, 40), _text(rng, 1)) for i in range(5)]
    drafter.propose(reqs, 4)
    assert drafter.tracked_requests == 5
    for r in reqs:
        drafter.on_finished(r)
    assert drafter.tracked_requests == 0
    assert len(drafter.trie) > 0  # the shared statistics stay: that is the point of sharing


def test_a_reused_rid_starts_over():
    drafter = NgramDrafter(drafter_info(vocab_size=VOCAB))
    drafter.propose([_req("same", [1, 2, 3, 4, 1, 2], [3])], 4)
    # the same rid with another history (e.g. a client reusing ids after a missed on_finished)
    assert drafter.propose([_req("same", [9, 8, 7, 9, 8], [7])], 2).tokens == [[9, 8]]


def test_untracked_requests_are_capped():
    drafter = NgramDrafter(drafter_info(vocab_size=VOCAB), max_tracked_requests=3)
    for i in range(10):
        drafter.propose([_req(f"r{i}", [1, 2, 3], [4])], 4)
    assert drafter.tracked_requests == 3


@pytest.mark.parametrize("options, message", [
    ({"min_match_window": 0}, "min_match_window"),
    ({"min_match_window": 5, "max_match_window": 3}, "min_match_window"),
    ({"capacity": 10}, "capacity"),
    ({"rank": "best"}, "rank"),
    ({"max_match_window": 2.5}, "max_match_window"),
])
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=f"speculative.options.{message}"):
        NgramDrafter(drafter_info(vocab_size=VOCAB), **options)


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError):
        NgramDrafter(drafter_info(vocab_size=VOCAB), window=3)


def test_trie_rejects_bad_sizes():
    with pytest.raises(ValueError):
        NgramTrie(1, 100)
    with pytest.raises(ValueError):
        NgramTrie(8, 10)


def test_propose_cost_per_request_is_small():
    """A decode step must not wait long on the drafter: measure propose() per request on long
    copy-heavy histories (the bound is loose for a loaded CI machine; typical is ~30 us)."""
    rng = random.Random(7)
    docs = [_text(rng, 2000) for _ in range(8)]
    drafter = NgramDrafter(drafter_info(vocab_size=VOCAB, num_draft_tokens=8))
    reqs = [_req(f"r{i}", doc, doc[100:104]) for i, doc in enumerate(docs)]
    drafter.propose(reqs, 8)  # feeds the prompts (a one-off cost per request)
    start = time.perf_counter()
    steps = 20
    for _ in range(steps):
        proposal = drafter.propose(reqs, 8)
        for r, draft in zip(reqs, proposal.tokens):
            _accept(drafter, r, draft[:4] + [rng.randrange(VOCAB)])
    per_request = (time.perf_counter() - start) / (steps * len(reqs))
    assert per_request < 2e-3, f"propose + on_accepted took {per_request * 1e6:.0f} us per request"
