"""The EAGLE drafter's CUDA-graph path and the target's recording decode graphs, on the CPU.

Real CUDA graphs cannot run here; `EagerGraph` replays by re-running the captured function over
the same static buffers, so the bookkeeping around the graphs is what is tested: the shape
buckets, the padding of requests / rows / KV columns, the static buffers filled before a replay
and read after it, the target's verify steps replaying its decode graphs with recording on, and
the drafts and greedy outputs equal to the eager path."""

from __future__ import annotations

import pytest
import torch
from eagle_checkpoints import target_config, write_eagle2, write_eagle3
from radixserve.config import Config
from radixserve.cuda_graph_runner import DecodeGraphRunner, EagerGraph
from radixserve.model_runner import ModelRunner
from radixserve.testing import run_to_completion as _run
from radixserve.testing import tiny_checkpoint
from radixserve.testing.speculative import RecordingDrafter, shared_prefix_prompts, speculative_scheduler, target_runner
from radixserve.testing.speculative import assert_drafter_released as _assert_released
from radixserve.testing.speculative import greedy_request as _greedy
from radixserve.tree_decode_rows import TreeDecodeRows
from radixserve_spec_eagle import graphs
from radixserve_spec_eagle.drafter import EagleDrafter

VOCAB = 512


def test_buckets():
    assert graphs.bucket(3, graphs.BATCH_BUCKETS) == 4 and graphs.bucket(1, graphs.BATCH_BUCKETS) == 1
    assert graphs.bucket(33, graphs.BATCH_BUCKETS) is None
    assert graphs.width_bucket(1) == 256 and graphs.width_bucket(256) == 256 and graphs.width_bucket(257) == 512
    assert graphs.width_bucket(graphs.MAX_WIDTH + 1) is None
    # chains: batch bucket, room for the longest request's cached rows plus the steps
    assert graphs.chain_key([10, 300, 7], 4) == (4, 512, 4)
    assert graphs.chain_key([253], 3) == (1, 256, 3) and graphs.chain_key([254], 3) == (1, 512, 3)
    assert graphs.chain_key([10] * 33, 4) is None  # more requests than the largest bucket
    assert graphs.chain_key([8000] * 8, 4) is None  # B * W past the memory bound
    # verified rows: row bucket, then room for the cached rows plus the padded new rows
    assert graphs.pending_key(100, 3) == (4, 256) and graphs.pending_key(253, 3) == (4, 512)
    assert graphs.pending_key(100, 17) is None  # a prefill's rows run eagerly
    # trees: room for the cached rows (the levels' rows have a buffer of their own)
    assert graphs.tree_key(300, 4, 4, 100) == (512, 4, 4, 100) and graphs.tree_key(graphs.MAX_WIDTH + 1, 4, 4, 100) is None


class GraphEagle(RecordingDrafter, EagleDrafter):
    graph_factory = EagerGraph

    def __init__(self, info):
        super().__init__(info, cuda_graph=True)


class EagerEagle(RecordingDrafter, EagleDrafter):
    def __init__(self, info):
        super().__init__(info, cuda_graph=False)


def _runner(path: str, graph_sizes: list[int] | None) -> ModelRunner:
    runner = target_runner(path, max_total_tokens=4000, max_running_requests=16)
    if graph_sizes:  # the decode graphs a CUDA runner would capture, replayed eagerly
        runner.graph_runner = DecodeGraphRunner(
            runner.model, runner.attn_backend, runner.req_to_token_pool, runner.kv_pool, runner.device,
            graph_sizes, runner.req_to_token_pool.alloc(), graph_factory=EagerGraph,
        )
        # and the scratch rows tree verifies take as decode rows (start-up reserves max size - 1)
        runner.tree_rows = TreeDecodeRows([runner.req_to_token_pool.alloc() for _ in range(max(graph_sizes) - 1)])
    return runner


def _config(draft: str, topk: int) -> Config:
    return Config.build({
        "stack": {"prefix_cache": "radix", "speculative": "eagle"},
        "speculative": {"num_draft_tokens": 6 if topk > 1 else 4, "topk": topk, "num_steps": 3 if topk > 1 else None,
                        "draft_model_path": draft, "adaptive_batch_size": 0},
        "scheduler": {"max_total_tokens": 4000},
    })


def _requests(ps):  # the first request outlives the others: its last steps draft alone (batch-1 chain graphs)
    return [_greedy(f"r{i}", p, 10 if i else 13) for i, p in enumerate(ps)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tiny_checkpoint("llama", str(tmp_path_factory.mktemp("target")), seed=3, num_hidden_layers=3)
    cfg = target_config(path)
    drafts = {"eagle2": write_eagle2(tmp_path_factory.mktemp("e2"), cfg, seed=1),
              "eagle3": write_eagle3(tmp_path_factory.mktemp("e3"), cfg, seed=2)}
    ps = shared_prefix_prompts(3, VOCAB, seed=5)
    plain = _run(speculative_scheduler(_runner(path, None), None, None), _requests(ps))
    return path, drafts, ps, plain


@pytest.mark.parametrize("draft,topk", [("eagle3", 1), ("eagle2", 1), ("eagle3", 2), ("eagle2", 3)])
def test_graph_path_drafts_as_the_eager_path(setup, draft, topk):
    """Graphs on both sides (the target's recording decode graphs, the draft's own) give the same
    drafts as the all-eager path, and greedy outputs equal to decoding without speculation."""
    path, drafts, ps, plain = setup
    results = {}
    for name, cls, sizes in (("graph", GraphEagle, [1, 2, 4, 8, 16]), ("eager", EagerEagle, None)):
        runner = _runner(path, sizes)
        sched = speculative_scheduler(runner, _config(drafts[draft], topk), lambda info, cfg, cls=cls: cls(info))
        gr = runner.graph_runner
        verify_rows = []
        pool = runner.req_to_token_pool
        free_rows = pool.available_size()
        if gr is not None:
            # the drafter asked for hidden states: the graphs were recaptured to record them
            ts = runner.target_states
            assert gr.recording == (ts.final, ts.aux_layers) and ts.recording
            inner = gr.run

            def run(fb, inner=inner, verify_rows=verify_rows):
                verify_rows.append(fb.batch_size)
                return inner(fb)

            gr.run = run
            plan, tree_plans = runner.tree_rows.plan, []
            runner.tree_rows.plan = lambda *a, plan=plan, tree_plans=tree_plans: tree_plans.append(a) or plan(*a)
        out = _run(sched, _requests(ps))
        assert out == plain, name
        assert pool.available_size() == free_rows  # no request row leaked, no scratch row handed out
        d = sched.drafter
        results[name] = [p.tokens for _, _, p in d.proposals]
        if name == "graph":
            assert d.graphs.pendings, "the verified rows never went through a graph"
            assert bool(d.graphs.chains) == (topk == 1) and bool(d.graphs.trees) == (topk > 1)
            if topk == 1:
                assert any(k[0] == 4 for k in d.graphs.chains), "3 requests were not padded to the bucket of 4"
                alone = [inp for k, (_, inp) in d.graphs.chains.items() if k[0] == 1]
                heads = d.head.layers[0].num_heads
                assert alone and all(inp.keys[0].shape[2] == heads for inp in alone), "batch 1: keys per query head"
                # chain verifies (1 + 3 drafts per request) replayed the recording decode graphs
                assert max(verify_rows) > len(ps)
            else:
                assert all(k[1:3] == (topk, 3) for k in d.graphs.trees)
                # tree verifies (1 + 6 nodes per request) replayed the graphs as decode rows; 3 requests'
                # 21 rows do not fit the largest graph (16): those verified eagerly, same outputs
                assert tree_plans and max(verify_rows) > len(ps)
                assert not set(runner.tree_rows.scratch_rows) & set(pool._free_rows)
        else:
            assert d.graphs is None
        _assert_released(d)
    assert results["graph"] == results["eager"]


def test_graph_pending_rows_match_eager(setup):
    """One request's verified rows through the pending graph (padded rows, stale KV columns left
    by a bigger earlier replay) write the same draft KV and give the same root as the eager step."""
    path, drafts, _, _ = setup
    runner = _runner(path, None)
    from radixserve.scheduler.speculative.setup import drafter_info

    cfg = _config(drafts["eagle3"], 1)
    g, e = GraphEagle(drafter_info(cfg, runner)), EagerEagle(drafter_info(cfg, runner))
    gen = torch.Generator().manual_seed(0)
    feat_w = 3 * runner.target_states.hidden_size
    n0 = 20
    first = dict(pos=list(range(n0)), tok=[int(t) for t in torch.randint(0, VOCAB, (n0,), generator=gen)],
                 feats=[torch.randn(n0, feat_w, generator=gen)])
    for d in (g, e):  # 20 rows: eager on both (past the row buckets)
        st = d._state("a")
        st.pending_pos, st.pending_tok, st.pending_feats = list(first["pos"]), list(first["tok"]), list(first["feats"])
        st.last_pos = n0 - 1
        d._run_pending(st)
    assert g.graphs.pendings == {}
    for rows in (3, 1, 4):  # bucket 4 (one padded row), bucket 1, bucket 4 again over stale columns
        feats = torch.randn(rows, feat_w, generator=gen)
        toks = [int(t) for t in torch.randint(0, VOCAB, (rows,), generator=gen)]
        for d in (g, e):
            st = d.states["a"]
            start = st.last_pos + 1
            st.pending_pos, st.pending_tok, st.pending_feats = list(range(start, start + rows)), list(toks), [feats]
            st.last_pos = start + rows - 1
            d._run_pending(st)
        sg, se = g.states["a"], e.states["a"]
        assert sg.root[0] == se.root[0]
        torch.testing.assert_close(sg.root[1], se.root[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sg.root[2], se.root[2], rtol=1e-5, atol=1e-5)
        for layer in range(len(g.head.layers)):
            torch.testing.assert_close(g.pool.k[layer][sg.slots], e.pool.k[layer][se.slots], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(g.pool.v[layer][sg.slots], e.pool.v[layer][se.slots], rtol=1e-5, atol=1e-5)
    assert sorted(g.graphs.pendings) == [(1, 256, feat_w), (4, 256, feat_w)]
    heads = g.head.layers[0].num_heads  # the one-row graph keeps its keys per query head
    assert [inp.keys[0].shape[1] for _, inp in (g.graphs.pendings[k] for k in sorted(g.graphs.pendings))] == [
        heads, g.pool.shape[0]]


def test_graph_cache_drops_the_least_recently_used(monkeypatch):
    captured = []
    dg = graphs.DraftGraphs(1, (1, 2), 4, torch.float32, torch.device("cpu"), None, None, EagerGraph)
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 3)

    def capture(*key):
        captured.append(key)
        return key

    for key in [(1,), (2,), (3,), (1,), (4,)]:  # (1,) used again: (2,) is the oldest when (4,) comes
        dg._get(dg.chains, key, capture)
    assert list(dg.chains) == [(3,), (1,), (4,)] and captured == [(1,), (2,), (3,), (4,)]
    dg._get(dg.pendings, (9,), capture)  # a pending graph makes room by dropping a chain graph
    assert list(dg.chains) == [(1,), (4,)] and list(dg.pendings) == [(9,)]


def test_grouped_attention_is_attention_over_repeated_keys():
    """The draft's GQA without repeated keys (query heads grouped per KV head) equals attention
    over keys repeated to every query head: the tree / pending form (rows with their own masks)
    and the chain's one row per request."""
    import torch.nn.functional as F
    from radixserve_spec_eagle.drafter import grouped_attention

    g = torch.Generator().manual_seed(0)
    r, h, kv, d, t = 3, 6, 2, 4, 7
    q, keys, values = torch.randn(r, h, d, generator=g), torch.randn(t, kv, d, generator=g), torch.randn(t, kv, d, generator=g)
    mask = torch.rand(r, t, generator=g) > 0.4
    mask[:, 0] = True
    rep = lambda x, dim: x.repeat_interleave(h // kv, dim)  # noqa: E731
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), rep(keys, 1).transpose(0, 1), rep(values, 1).transpose(0, 1),
                                         attn_mask=mask).transpose(0, 1).reshape(r, -1)
    torch.testing.assert_close(grouped_attention(q, keys, values, mask), ref)
    torch.testing.assert_close(grouped_attention(q, rep(keys, 1), rep(values, 1), mask), ref)  # keys per query head
    qb, kb, vb = torch.randn(2, h, d, generator=g), torch.randn(2, t, kv, d, generator=g), torch.randn(2, t, kv, d, generator=g)
    mb = (torch.arange(t)[None, :] <= torch.tensor([2, 5])[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(qb.unsqueeze(2), rep(kb, 2).transpose(1, 2), rep(vb, 2).transpose(1, 2),
                                         attn_mask=mb).reshape(2, -1)
    torch.testing.assert_close(EagleDrafter._attention_padded(None, qb, kb, vb, mb), ref)
    # keys already repeated per query head (batch-1 chain graphs)
    torch.testing.assert_close(EagleDrafter._attention_padded(None, qb, rep(kb, 2), rep(vb, 2), mb), ref)
    buf = torch.zeros(2, t, h, d)
    graphs.grouped_view(buf, kv)[:] = kb.unsqueeze(-2)  # KV rows stored per query head
    assert torch.equal(buf, rep(kb, 2)) and torch.equal(graphs.per_kv_head(buf, kv), kb)


def test_static_keys_copy_only_a_requests_new_rows():
    """A request drafting again copies only its new rows into a graph's static keys; another
    request (or no owner) on the same buffer row reloads all of them, and a padded row (where
    the chain writes scratch rows) is reloaded when a request comes back to it."""
    class Owner:  # stands for a request's draft state
        pass

    pool_k = [torch.arange(16 * 2, dtype=torch.float32).view(16, 1, 2)]
    pool_v = [-pool_k[0]]
    dg = graphs.DraftGraphs(1, (1, 2), 4, torch.float32, torch.device("cpu"),
                            lambda inp, steps: torch.zeros(inp.lens.shape[0], steps, dtype=torch.int64), None, EagerGraph)
    a, b = Owner(), Owner()

    def chain(slots, owners):
        n = len(slots)
        dg.chain(pool_k, pool_v, [torch.tensor(s) for s in slots], [0] * n, torch.zeros(n, 4),
                 torch.zeros(n, dtype=torch.int64), 2, owners)
        return dg.chains[graphs.chain_key([len(s) for s in slots], 2)][1]

    inp = chain([[0, 1, 2]], [a])
    assert torch.equal(inp.keys[0][0, :3], pool_k[0][:3]) and torch.equal(inp.values[0][0, :3], pool_v[0][:3])
    before = inp.keys[0][0, :3].clone()
    pool_k[0] += 100  # (a live request's rows never change: this shows which rows were copied)
    inp = chain([[0, 1, 2, 5]], [a])
    assert torch.equal(inp.keys[0][0, :3], before) and torch.equal(inp.keys[0][0, 3], pool_k[0][5])
    inp = chain([[0, 1, 2, 5]], [b])
    assert torch.equal(inp.keys[0][0, :4], pool_k[0][[0, 1, 2, 5]])
    pool_k[0] += 100
    inp = chain([[0, 1, 2, 5]], None)
    assert torch.equal(inp.keys[0][0, :4], pool_k[0][[0, 1, 2, 5]])
    c, e = Owner(), Owner()
    inp = chain([[0, 1], [3, 4], [6, 7], [8, 9]], [a, b, c, e])  # bucket 4
    inp = chain([[0, 1], [3, 4], [6, 7]], [a, b, c])  # bucket 4 again: row 3 padded
    assert inp.loaded[3] is None
    inp.keys[0][3, :2] = -1  # the chain's scratch rows of a padded request
    inp = chain([[0, 1], [3, 4], [6, 7], [8, 9]], [a, b, c, e])
    assert torch.equal(inp.keys[0][3, :2], pool_k[0][[8, 9]])
    # batch-1 chain graphs store the rows repeated to every query head (2 here), filled the same way
    dg.num_heads = 2
    dg.chains.clear()
    inp = chain([[0, 1, 2]], [a])
    assert inp.keys[0].shape == (1, 256, 2, 2)
    assert torch.equal(inp.keys[0][0, :3], pool_k[0][:3].repeat_interleave(2, 1))
    pool_k[0] += 100
    inp = chain([[0, 1, 2, 5]], [a])
    assert torch.equal(inp.keys[0][0, 3], pool_k[0][5].repeat_interleave(2, 0))
    assert torch.equal(inp.values[0][0, :4], pool_v[0][[0, 1, 2, 5]].repeat_interleave(2, 1))


def test_a_failed_capture_falls_back_to_eager():
    dg = graphs.DraftGraphs(1, (1, 2), 4, torch.float32, torch.device("cpu"), None, None, EagerGraph)

    def broken(*key):
        raise RuntimeError("operation not permitted when stream is capturing")

    assert dg.failure is None
    assert dg._get(dg.chains, (1, 256, 4), broken) is None and dg.failed
    assert dg._get(dg.chains, (1, 256, 4), lambda *k: k) is None  # no more attempts
    # what failed is kept for reports (session 8's log lost it)
    assert dg.failure == "(1, 256, 4): RuntimeError('operation not permitted when stream is capturing')"
