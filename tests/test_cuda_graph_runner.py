"""Decode-graph bookkeeping on the CPU: padding to a captured size, static buffers, dummy rows.

The real CUDA graph cannot run here; `EagerGraph` replays by re-running the captured function
over the same static buffers, so everything around the graph is exercised: padding rows must not
change any real KV slot and the real rows' logits must equal an eager forward."""

from __future__ import annotations

import pytest
import torch
from radixserve.config import Config
from radixserve.cuda_graph_runner import (
    CudaGraph,
    DecodeGraphRunner,
    EagerGraph,
    default_capture_sizes,
    record_buffers,
    write_recorded_rows,
)
from radixserve.model_runner import ModelRunner
from radixserve.state import ForwardMode, ScheduledBatch
from radixserve.static_batch import run_static_batch
from runner_driver import greedy_generate


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    cfg = Config.build(
        {
            "model": {"path": tiny_llama_dir("llama")},
            "runtime": {"device": "cpu", "dtype": "float32"},
            "scheduler": {"max_total_tokens": 1024, "max_running_requests": 8},
        }
    )
    return ModelRunner(cfg, show_progress=False)


def test_capture_sizes_cover_up_to_max():
    sizes = default_capture_sizes(40)
    assert sizes[0] == 1 and sizes[-1] == 32 and sizes == sorted(sizes)


def _decode_batch(runner, prompts, rows, slots_for_step):
    pool = runner.req_to_token_pool
    lens = [len(p) for p in prompts]
    for i, row in enumerate(rows):
        pool.write(row, lens[i], slots_for_step[i : i + 1])
    return ScheduledBatch(
        mode=ForwardMode.DECODE,
        reqs=[None] * len(prompts),
        input_ids=[p[-1] for p in prompts],
        req_pool_indices=rows,
        prefix_lens=lens,
        extend_lens=[1] * len(prompts),
        out_cache_loc=slots_for_step,
    )


def test_padded_replay_matches_eager_and_touches_no_real_slot(runner):
    pool, alloc = runner.req_to_token_pool, runner.token_allocator
    dummy_row = pool.size - 1
    graphs = DecodeGraphRunner(
        runner.model, runner.attn_backend, pool, runner.kv_pool, runner.device,
        capture_sizes=[1, 2, 4], dummy_row=dummy_row, graph_factory=EagerGraph,
    )
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23]]
    rows = [pool.alloc() for _ in prompts]
    owned = []
    # prefill each prompt
    for row, p in zip(rows, prompts):
        loc = alloc.alloc(len(p))
        owned.append(loc)
        pool.write(row, 0, loc)
        runner.forward_logits(ScheduledBatch(ForwardMode.EXTEND, [None], list(p), [row], [0], [len(p)], loc))
    step_slots = alloc.alloc(len(prompts))
    owned.append(step_slots)
    sb = _decode_batch(runner, prompts, rows, step_slots)

    k_before = runner.kv_pool.get_kv(0)[0].clone()
    fb = runner.prepare(sb)
    assert graphs.can_run(fb) and graphs.padded_size(fb.batch_size) == 4
    logits_graph = graphs.run(fb).clone()
    k_after = runner.kv_pool.get_kv(0)[0]
    changed = (k_after != k_before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= set(step_slots.tolist()) | {0}, "padding rows wrote to a real KV slot"
    assert set(step_slots.tolist()) <= set(changed), "real rows did not write their KV"

    logits_eager = runner.forward_logits(sb)
    assert logits_graph.shape == logits_eager.shape
    torch.testing.assert_close(logits_graph, logits_eager[:, : logits_graph.shape[1]], rtol=1e-5, atol=1e-5)
    for row in rows:
        pool.free(row)
    for s in owned:
        alloc.free(s)
    assert alloc.available_size() == alloc.size


def test_graph_runner_rejects_extend_and_oversize(runner):
    graphs = DecodeGraphRunner(
        runner.model, runner.attn_backend, runner.req_to_token_pool, runner.kv_pool, runner.device,
        capture_sizes=[1, 2], dummy_row=runner.req_to_token_pool.size - 1, graph_factory=EagerGraph,
    )
    pool, alloc = runner.req_to_token_pool, runner.token_allocator
    row = pool.alloc()
    loc = alloc.alloc(3)
    pool.write(row, 0, loc)
    fb = runner.prepare(ScheduledBatch(ForwardMode.EXTEND, [None], [1, 2, 3], [row], [0], [3], loc))
    assert not graphs.can_run(fb)
    pool.free(row)
    alloc.free(loc)
    # greedy generation still consistent after the graph runner has been used
    a = greedy_generate(runner, [[3, 4, 5]], 4)
    b = greedy_generate(runner, [[3, 4, 5]], 4)
    assert a[0].tokens == b[0].tokens


# ---- recording the hidden rows a drafter reads ---------------------------------------------------
def test_record_buffers_layout():
    final, aux = record_buffers(4, 3, True, 2, torch.float32, torch.device("cpu"))
    assert final.shape == (4, 3) and aux.shape == (4, 6)
    assert record_buffers(4, 3, False, 0, torch.float32, torch.device("cpu")) == (None, None)
    hidden, a0, a1 = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    write_recorded_rows(final, aux, hidden, [a0, a1])
    assert torch.equal(final[:2], hidden)
    assert torch.equal(aux[:2], torch.cat([a0, a1], dim=-1))  # the eager path's layout: layers in asked order
    assert not final[2:].any() and not aux[2:].any()  # rows past the batch untouched
    with pytest.raises(RuntimeError, match="captured none"):
        write_recorded_rows(None, aux, hidden, None)
    with pytest.raises(RuntimeError, match="3 wide, the record buffer 6"):
        write_recorded_rows(None, aux, hidden, [a0])


@pytest.fixture
def fake_capture(monkeypatch):
    """torch.cuda's capture calls replaced by stand-ins (no GPU here): `graph` enters / exits in
    torch.cuda.graph's order (exit: end the capture, then restore the caller's stream). The dict
    says which stream is current, whether a capture is underway, and whether ending it fails."""
    state = {"stream": "caller", "capturing": False, "invalidated": False}

    class Graph:
        def capture_end(self):
            state["capturing"] = False
            if state["invalidated"]:
                raise RuntimeError("operation failed due to a previous error during capture")

    class GraphContext:
        def __init__(self, graph, pool=None):
            self.graph = graph

        def __enter__(self):
            state["stream"], state["capturing"] = "capture", True

        def __exit__(self, *exc):
            self.graph.capture_end()  # when this raises, the restore below never runs (as in torch)
            state["stream"] = "caller"

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", GraphContext)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: state["stream"])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: state.__setitem__("stream", s))
    return state


def test_a_failed_capture_leaves_the_caller_on_its_stream(fake_capture):
    """torch.cuda.graph skips restoring the caller's stream when ending the capture raises (an
    invalidated capture); CudaGraph.capture restores it, so a drafter that falls back to eager
    after a failed capture queues its work where it did before."""
    fake_capture["invalidated"] = True
    with pytest.raises(RuntimeError, match="previous error during capture"):
        CudaGraph().capture(lambda: torch.zeros(1))
    assert fake_capture["stream"] == "caller"


def test_no_garbage_is_collected_during_a_capture(fake_capture):
    """Python's cyclic GC stays off while a graph is captured: a dropped CUDA graph held in a
    reference cycle (a drafter and its graphs form one) destroyed during another graph's capture
    invalidates that capture ("operation not permitted when stream is capturing", torch's
    CUDAGraph reset; PyTorch stopped collecting before captures in 2.9). The garbage is
    collected later, outside the capture, and GC is back on after it, failed or not."""
    import gc

    finalized_while_capturing = []

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            finalized_while_capturing.append(fake_capture["capturing"])

    def make_garbage_then_allocate():
        Cycle()  # young cyclic garbage: the next automatic (generation 0) collection finalizes it
        return [[i] for i in range(20 * gc.get_threshold()[0])]  # enough allocations to trigger one

    gc.collect()
    assert gc.isenabled()
    CudaGraph().capture(make_garbage_then_allocate)  # warm-ups (outside the capture) and the capture
    gc.collect()
    assert finalized_while_capturing and not any(finalized_while_capturing)
    assert gc.isenabled()
    fake_capture["invalidated"] = True
    with pytest.raises(RuntimeError):
        CudaGraph().capture(lambda: torch.zeros(1))
    assert gc.isenabled()


def test_recording_graphs_hand_the_drafter_the_eager_rows(tiny_llama_dir):
    """With a drafter recording, decode steps still replay the (recaptured) graphs, and the rows
    recorded from the static buffers equal those of an eager forward: real rows only, padding none."""
    runner = ModelRunner(Config.build({
        "model": {"path": tiny_llama_dir("llama", seed=2, num_hidden_layers=3)},
        "runtime": {"device": "cpu", "dtype": "float32"},
        "scheduler": {"max_total_tokens": 1024, "max_running_requests": 8},
    }), show_progress=False)
    gr = DecodeGraphRunner(runner.model, runner.attn_backend, runner.req_to_token_pool, runner.kv_pool, runner.device,
                           capture_sizes=[1, 2, 4], dummy_row=runner.req_to_token_pool.alloc(), graph_factory=EagerGraph)
    runner.graph_runner = gr
    ts = runner.target_states
    assert gr.recording == (False, ()) and gr.buf_aux is None
    ts.request(final=True, aux_layers=(2, 0))
    assert gr.recording == (True, (2, 0)) and gr.buf_aux.shape == (4, 2 * ts.hidden_size)
    assert gr.buf_final.shape == (4, ts.hidden_size)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23]]  # 3 decode rows: padded to 4

    def rows_of_run():
        out = run_static_batch(runner, prompts, max_new_tokens=4).output_ids
        return out, {str(i): ts.take(str(i)) for i in range(len(prompts))}

    out_g, rows_g = rows_of_run()
    assert runner.last_run_used_cuda_graph
    runner.graph_runner = None
    out_e, rows_e = rows_of_run()
    assert out_g == out_e
    for rid, rows in rows_g.items():
        assert [r.positions for r in rows] == [r.positions for r in rows_e[rid]]
        assert [r.token_ids for r in rows] == [r.token_ids for r in rows_e[rid]]
        assert [r.final.shape[0] for r in rows[1:]] == [1, 1, 1]  # one row per decode step
        for g, e in zip(rows, rows_e[rid], strict=True):
            torch.testing.assert_close(g.final, e.final, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(g.aux, e.aux, rtol=1e-5, atol=1e-5)


def test_tree_scratch_rows_are_reserved_only_for_tree_drafts_in_graphs():
    """Scratch rows (tree verifies as decode rows) cost ReqToTokenPool rows of the context length:
    reserved only on CUDA with graphs on and a drafter that may propose trees, at most the largest
    graph batch less one (each request's root reads its own row; graphs are capped by the running requests)."""
    from types import SimpleNamespace

    def scratch(device="cuda", graphs=True, drafter="eagle", topk=4, max_bs=160, running=256):
        cfg = Config.build({"stack": {"speculative": drafter}, "speculative": {"topk": topk},
                            "runtime": {"cuda_graph": graphs, "cuda_graph_max_bs": max_bs},
                            "scheduler": {"max_running_requests": running}})
        return ModelRunner._tree_scratch_rows(SimpleNamespace(config=cfg, device=torch.device(device)))

    assert scratch() == 159  # graphs of up to 160 rows
    assert scratch(max_bs=16) == 15 and scratch(running=12) == 7  # graphs of 1, 2, 4, 8 rows for 12 requests
    assert scratch(device="cpu") == scratch(graphs=False) == scratch(drafter=None) == scratch(topk=1) == 0
