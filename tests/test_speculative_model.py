"""Speculative decoding with a real (tiny random llama) model on CPU: greedy outputs identical with
speculation on and off (chains and trees, alone and batched, radix cache on), seeded sampling
identical, unseeded sampling equal in distribution (chi-square), and the tree-masked verify
forward equal to plain causal forwards of every root-to-node path."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from radixserve.config import Config
from radixserve.interfaces import Drafter, DraftProposal
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.scheduler.speculative.setup import drafter_info
from radixserve.state import ForwardMode, Req, SamplingParams, ScheduledBatch, SpecVerify
from radixserve.testing import run_to_completion as run
from radixserve.testing.speculative import trees_with_wrong_siblings

VOCAB = 512


@pytest.fixture(scope="module")
def runners(tiny_llama_dir):
    path = tiny_llama_dir("llama")
    built = {}

    def get(attention: str) -> ModelRunner:
        if attention not in built:
            cfg = Config.build({
                "model": {"path": path},
                "stack": {"attention": attention},
                "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
                "scheduler": {"max_total_tokens": 6000, "max_running_requests": 64},
            })
            built[attention] = ModelRunner(cfg, show_progress=False)
        return built[attention]

    return get


class TableDrafter(Drafter):
    """Drafts from a table of known continuations (prompt -> output): `right` proposes them,
    `mixed` spoils a random suffix, `tree` puts a wrong sibling before every right node."""

    def __init__(self, info, table=None, mode="right", tree=False, seed=0, next_of=None):
        super().__init__(info)
        self.table, self.mode, self.tree = table or {}, mode, tree
        self.next_of = next_of  # (prompt, output) -> likely next token, for sampled rows
        self.rng = random.Random(seed)

    def _chain(self, req, k):
        if self.next_of is not None:
            out, chain = list(req.output_ids), []
            for _ in range(k):
                tok = self.next_of(req.origin_input_ids, out)
                if tok is None:
                    break
                chain.append(tok)
                out.append(tok)
            return chain
        cont = self.table.get(tuple(req.origin_input_ids), [])
        n = len(req.output_ids)
        chain = list(cont[n : n + k])
        if self.mode == "mixed" and chain:
            cut = self.rng.randint(0, len(chain))
            chain = chain[:cut] + [self.rng.randrange(VOCAB) for _ in chain[cut:]]
        return chain

    def propose(self, reqs, k):
        chains = [self._chain(r, k) for r in reqs]
        if not self.tree:
            return DraftProposal(chains)
        return trees_with_wrong_siblings(chains, k, VOCAB)


def scheduler(runner, drafter_kwargs=None, num_draft_tokens=4, cache="radix"):
    cfg = Config.build({
        "stack": {"prefix_cache": cache},
        "speculative": {"num_draft_tokens": num_draft_tokens},
        "scheduler": {"max_total_tokens": 6000},
    })
    reg = Registry.discover()
    drafter = None if drafter_kwargs is None else TableDrafter(drafter_info(cfg, runner), **drafter_kwargs)
    cache_obj = reg.load("prefix_cache", cache)(runner.req_to_token_pool, runner.token_allocator)
    return Scheduler(cfg, runner, cache_obj, reg.load("policy", "fcfs")(), drafter=drafter)


def greedy(rid, prompt, n, **kw):
    return GenerateRequest(rid=rid, input_ids=prompt,
                           sampling_params=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw))


def prompts(n, seed=0):
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(12)]
    # half share a prefix (the radix cache serves it), all different tails
    return [(base if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 15))] for i in range(n)]


@pytest.mark.parametrize("attention,tree", [("torch_native", False), ("torch_native", True), ("cpu_batched", False)])
def test_greedy_identical_on_and_off(runners, attention, tree):
    runner = runners(attention)
    ps = prompts(8, seed=1)
    plain = run(scheduler(runner), [greedy(f"r{i}", p, 24) for i, p in enumerate(ps)])
    table = {tuple(p): plain[f"r{i}"] for i, p in enumerate(ps)}
    for mode in ("right", "mixed"):
        # batched
        s = scheduler(runner, {"table": table, "mode": mode, "tree": tree, "seed": 2})
        got = run(s, [greedy(f"r{i}", p, 24) for i, p in enumerate(ps)])
        assert got == plain, mode
        assert s.stats()["spec_verifies"] > 0
        if mode == "right":  # a tree of 4 nodes holds 2 levels (a wrong sibling at each)
            assert s.stats()["spec_accept_length"] > (2.5 if tree else 3.5)
        # alone
        s = scheduler(runner, {"table": table, "mode": mode, "tree": tree, "seed": 3})
        assert run(s, [greedy("r0", ps[0], 24)]) == {"r0": plain["r0"]}


@pytest.mark.parametrize("attention", ["torch_native", "cpu_batched"])
def test_greedy_identical_on_and_off_with_a_sliding_window(tiny_llama_dir, attention):
    """Tree verifies of a windowed model (Mistral, window 5 < every sequence): a draft token's
    window starts from its position (prefix + depth), so greedy outputs equal plain decoding."""
    cfg = Config.build({
        "model": {"path": tiny_llama_dir("mistral", sliding_window=5, head_dim=64)},  # 64: cpu_batched's kernel
        "stack": {"attention": attention},
        "runtime": {"device": "cpu", "dtype": "float32", "num_threads": 1},
        "scheduler": {"max_total_tokens": 6000, "max_running_requests": 64},
    })
    runner = ModelRunner(cfg, show_progress=False)
    ps = prompts(4, seed=6)
    plain = run(scheduler(runner), [greedy(f"r{i}", p, 16) for i, p in enumerate(ps)])
    table = {tuple(p): plain[f"r{i}"] for i, p in enumerate(ps)}
    s = scheduler(runner, {"table": table, "mode": "mixed", "tree": True, "seed": 2})
    assert run(s, [greedy(f"r{i}", p, 16) for i, p in enumerate(ps)]) == plain
    assert s.stats()["spec_verifies"] > 0


def test_greedy_with_penalties_and_logprobs(runners):
    runner = runners("torch_native")
    ps = prompts(4, seed=4)
    kw = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "logprobs": True}
    plain_s = scheduler(runner)
    plain = run(plain_s, [greedy(f"r{i}", p, 16, **kw) for i, p in enumerate(ps)])
    table = {tuple(p): plain[f"r{i}"] for i, p in enumerate(ps)}
    s = scheduler(runner, {"table": table, "mode": "mixed", "seed": 5})
    lps: dict[str, list[float]] = {}
    for i, p in enumerate(ps):
        s.add_request(greedy(f"r{i}", p, 16, **kw))
    got: dict[str, list[int]] = {}
    while s.has_work():
        for out in s.step():
            got.setdefault(out.rid, []).extend(out.new_ids)
            lps.setdefault(out.rid, []).extend(out.token_logprobs or [])
    assert got == plain
    assert s.flush_cache() and s.allocator.available_size() == s.allocator.size
    assert all(len(lps[r]) == 16 and all(lp <= 0 for lp in lps[r]) for r in got)


def _sampled(rid, prompt, n, seed=None):
    sp = SamplingParams(max_new_tokens=n, temperature=1.0, top_k=5, ignore_eos=True, seed=seed)
    return GenerateRequest(rid=rid, input_ids=prompt, sampling_params=sp)


def _likely_next(plain_outputs: list[list[int]]):
    """(prompt, output so far) -> the most frequent next token in plain samples (None if unseen)."""
    counts: dict[tuple, Counter] = {}
    for out in plain_outputs:
        for j in range(len(out)):
            counts.setdefault(tuple(out[:j]), Counter())[out[j]] += 1

    def next_of(prompt, output):
        c = counts.get(tuple(output))
        return c.most_common(1)[0][0] if c else None

    return next_of


def test_seeded_sampling_identical_on_and_off(runners):
    runner = runners("torch_native")
    prompt = prompts(1, seed=6)[0]
    reqs = [_sampled(f"s{i}", prompt, 6, seed=i) for i in range(24)]
    plain = run(scheduler(runner), reqs)
    s = scheduler(runner, {"next_of": _likely_next(list(plain.values()))})
    got = run(s, [_sampled(f"s{i}", prompt, 6, seed=i) for i in range(24)])
    assert got == plain  # token n of a seeded request is drawn with seed (seed, n) either way
    assert s.stats()["spec_accepted_tokens"] > 0


def _chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square homogeneity test; p-value by the Wilson-Hilferty approximation."""
    cats = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for c in cats:
        tot = a[c] + b[c]
        for obs, n in ((a[c], na), (b[c], nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    df = len(cats) - 1
    if df == 0:
        return 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_unseeded_sampling_matches_the_target_distribution(runners, tree):
    runner = runners("torch_native")
    prompt = prompts(1, seed=7)[0]
    n = 600
    n_new = 6 if tree else 3  # a tree of 2 levels needs room for 4 drafts after the first token
    torch.manual_seed(0)
    plain = run(scheduler(runner), [_sampled(f"u{i}", prompt, n_new) for i in range(n)])
    plain2 = run(scheduler(runner), [_sampled(f"u{i}", prompt, n_new) for i in range(n)])
    # a tree of 4 nodes: at each of 2 levels a wrong sibling first, then the likely token
    s = scheduler(runner, {"next_of": _likely_next(list(plain2.values())), "tree": tree},
                  num_draft_tokens=4 if tree else 2)
    spec = run(s, [_sampled(f"u{i}", prompt, n_new) for i in range(n)])
    st = s.stats()
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], "both accepts and rejects must occur"
    for pos in (1, 2):  # tokens decided by a verify (accepted draft, or the target's own draw)
        a = Counter(v[pos] for v in plain.values())
        b = Counter(v[pos] for v in spec.values())
        p = _chi_square_p(a, b)
        assert p > 1e-3, (pos, p, a.most_common(6), b.most_common(6))
    if tree:
        return
    # and the test has power: a distribution that is off by one token's worth of mass fails it
    skewed = Counter(v[1] for v in plain.values())
    top = skewed.most_common(1)[0][0]
    skewed[top] += n // 5
    assert _chi_square_p(Counter(v[1] for v in plain2.values()), skewed) < 1e-3


@pytest.mark.parametrize("attention,parents,graph", [
    ("torch_native", [-1, 0, 0, 1, 1, 3, 2], False),  # a tree of 6 draft tokens under the root: tree mask
    ("torch_native", [-1, 0, 1, 2, 3, 4, 5], False),  # a chain: verified as decode rows sharing a request
    ("torch_native", [-1, 0, 1, 2, 3, 4, 5], True),  # ... replayed through the decode graph bookkeeping
    ("torch_native", [-1, 0, 0, 1, 1, 3, 2], True),  # a tree as decode rows (scratch rows) in the graphs
    ("cpu_batched", [-1, 0, 1, 2, 3, 4, 5], False),  # a chain as an EXTEND batch
], ids=["tree", "chain-decode-rows", "chain-decode-rows-graph", "tree-decode-rows-graph", "chain-extend"])
def test_verify_forward_equals_per_path_causal_forwards(runners, attention, parents, graph):
    runner = runners(attention)
    if graph:  # the CPU stand-in for CUDA graphs (EagerGraph re-runs over the static buffers)
        dummy, scratch = _install_graphs(runner, [4, 16], 15)
    try:
        _check_verify_forward(runner, attention, parents)
        assert runner.last_run_used_cuda_graph is False  # the per-path references are extends
    finally:
        if graph:
            _remove_graphs(runner, dummy, scratch)


def _install_graphs(runner, sizes, num_scratch):
    """What a CUDA runner sets up at start-up, on the CPU: decode graphs (EagerGraph) and the
    scratch rows tree verifies use as decode rows. Returns the pool rows taken (dummy, scratch)."""
    from radixserve.cuda_graph_runner import DecodeGraphRunner, EagerGraph
    from radixserve.tree_decode_rows import TreeDecodeRows

    pool = runner.req_to_token_pool
    dummy = pool.alloc()
    runner.graph_runner = DecodeGraphRunner(runner.model, runner.attn_backend, pool, runner.kv_pool, runner.device,
                                            sizes, dummy, EagerGraph)
    scratch = [pool.alloc() for _ in range(num_scratch)]
    runner.tree_rows = TreeDecodeRows(scratch)
    return dummy, scratch


def _remove_graphs(runner, dummy, scratch):
    runner.graph_runner, runner.tree_rows = None, None
    for row in [dummy, *scratch]:
        runner.req_to_token_pool.free(row)


def _check_verify_forward(runner, attention, parents):
    prompt = [7, 100, 33, 250, 9, 41]
    tokens = [prompt[-1], 11, 22, 33, 44, 55, 66]
    prefix = len(prompt) - 1
    row = runner.req_to_token_pool.alloc()
    slots = runner.token_allocator.alloc(prefix + len(tokens))
    sp = SamplingParams(temperature=0)
    req = Req(rid="t", origin_input_ids=prompt, sampling_params=sp)
    try:
        runner.req_to_token_pool.write(row, 0, slots)
        pre = ScheduledBatch(ForwardMode.EXTEND, [req], prompt[:prefix], [row], [0], [prefix], slots[:prefix], [True])
        runner.forward_logits(pre)
        verify = ScheduledBatch(ForwardMode.EXTEND, [req], tokens, [row], [prefix], [len(tokens)], slots[prefix:],
                                [True], spec=SpecVerify([parents]))
        as_rows = attention == "torch_native" and (not verify.spec.has_tree or runner.graph_runner is not None)
        assert runner._verify_as_decode_rows(verify) == as_rows
        with torch.inference_mode():
            tree_logits = runner._forward(verify, greedy_ids=False)[0]
        assert runner.last_run_used_cuda_graph == (runner.graph_runner is not None)
        for j in range(len(tokens)):
            path, node = [], j
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            ids = prompt[:prefix] + path[::-1]
            r2 = runner.req_to_token_pool.alloc()
            s2 = runner.token_allocator.alloc(len(ids))
            runner.req_to_token_pool.write(r2, 0, s2)
            sb = ScheduledBatch(ForwardMode.EXTEND, [req], ids, [r2], [0], [len(ids)], s2, [True])
            want = runner.forward_logits(sb)[0]
            runner.token_allocator.free(s2)
            runner.req_to_token_pool.free(r2)
            torch.testing.assert_close(tree_logits[j], want, atol=1e-4, rtol=1e-4, msg=f"node {j}")
    finally:
        runner.token_allocator.free(slots)
        runner.req_to_token_pool.free(row)


def test_tree_verify_as_decode_rows_equals_the_tree_mask_extend(runners):
    """A batched verify of three requests with different prefixes (trees branching at several
    depths, and a chain) replayed as decode rows through the graph bookkeeping gives the logits of
    the eager tree-mask extend. Each node off its request's first chain reads a scratch row of its
    own (none shared, none a request's, none taken from or given back to the pool); a batch that
    does not fit the scratch rows or the graphs falls back to the eager extend, same logits. (The
    attention conformance kit checks the same for every backend with decode_rows_share_requests.)"""
    import types

    runner = runners("torch_native")
    pool, alloc = runner.req_to_token_pool, runner.token_allocator
    prompts_ = [[7, 100, 33, 250, 9, 41, 5, 77, 3], [12, 500, 8, 4], [61, 2, 90, 14, 400, 3, 3, 18, 27, 301, 6, 8, 1]]
    trees = [[-1, 0, 0, 1, 1, 2, 4, 4, 6],  # branching at depths 0, 1 and 2; node 2's path leaves the chain at once
             [-1, 0, 1, 2],  # a chain in the same batch: every node on its request's own row
             [-1, 0, 0, 2, 2, 1, 3]]
    rng = random.Random(4)
    tokens = [[p[-1]] + [rng.randrange(VOCAB) for _ in t[1:]] for p, t in zip(prompts_, trees, strict=True)]
    prefix = [len(p) - 1 for p in prompts_]
    req = Req(rid="t", origin_input_ids=[1], sampling_params=SamplingParams(temperature=0))
    rows = [pool.alloc() for _ in prompts_]
    slots = [alloc.alloc(p + len(t)) for p, t in zip(prefix, trees, strict=True)]
    for row, s in zip(rows, slots, strict=True):
        pool.write(row, 0, s)
    pre = ScheduledBatch(ForwardMode.EXTEND, [req] * 3, [x for p in prompts_ for x in p[:-1]], rows, [0] * 3, prefix,
                         torch.cat([s[:p] for s, p in zip(slots, prefix, strict=True)]), [True] * 3)
    verify = ScheduledBatch(ForwardMode.EXTEND, [req] * 3, [x for t in tokens for x in t], rows, prefix,
                            [len(t) for t in trees], torch.cat([s[p:] for s, p in zip(slots, prefix, strict=True)]),
                            [True] * 3, spec=SpecVerify(trees))
    dummy = scratch = None
    try:
        runner.forward_logits(pre)
        with torch.inference_mode():
            assert not runner._verify_as_decode_rows(verify)  # no graphs: the tree-mask extend
            want = runner._forward(verify, greedy_ids=False)[0]
            dummy, scratch = _install_graphs(runner, [8, 32], 13)
            needed = runner.tree_rows.scratch_needed(trees)
            assert needed == 7 + 5  # every node whose depth is not its index
            free_before = pool.available_size()
            assert runner._verify_as_decode_rows(verify)
            got = runner._forward(verify, greedy_ids=False)[0]
            assert runner.last_run_used_cuda_graph
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            plan = runner.tree_rows.plan(rows, prefix, trees)
            used = [r for r in plan.rows if r in scratch]
            assert len(used) == needed and len(set(used)) == needed  # one scratch row per node, none shared
            assert not set(plan.rows) - set(scratch) - set(rows)  # the others read their request's row
            assert pool.available_size() == free_before and not set(scratch) & set(pool._free_rows)
            # too few scratch rows, or more rows than the largest graph: the eager extend, same logits
            runner.tree_rows.scratch_rows = scratch[: needed - 1]
            assert not runner._verify_as_decode_rows(verify)
            torch.testing.assert_close(runner._forward(verify, greedy_ids=False)[0], want, atol=1e-5, rtol=1e-5)
            assert not runner.last_run_used_cuda_graph
            runner.tree_rows.scratch_rows = scratch
            gr, runner.graph_runner = runner.graph_runner, types.SimpleNamespace(max_bs=sum(map(len, trees)) - 1)
            assert not runner._verify_as_decode_rows(verify)
            runner.graph_runner = gr
    finally:
        if scratch is not None:
            _remove_graphs(runner, dummy, scratch)
        for row, s in zip(rows, slots, strict=True):
            pool.free(row)
            alloc.free(s)
