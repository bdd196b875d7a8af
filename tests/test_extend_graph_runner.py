"""Extend-graph bookkeeping on the CPU (runtime.cuda_graph_extend_max_tokens): prefill chunks and
mixed prefill + decode batches replayed from a graph captured per token count.

The triton backend runs in Triton's CPU interpreter and `EagerGraph` stands in for the CUDA graph
(replay re-runs the captured function over the same static buffers), so everything around the
graph is exercised: a padded replay must give each request the logits of the eager forward and
write the KV of its real tokens only, whatever lengths the captured batch had; the extend kernel's
work table must cover every query block once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from triton_interpret import use_interpreter_without_gpu

ON_GPU, _restore_interpret = use_interpreter_without_gpu()  # before any Triton kernel is decorated
_restore_triton_interpret = pytest.fixture(autouse=True, scope="module")(_restore_interpret)

from radixserve.config import Config  # noqa: E402
from radixserve.cuda_graph_runner import EagerGraph  # noqa: E402
from radixserve.extend_graph_runner import ExtendGraphRunner, default_extend_token_sizes  # noqa: E402
from radixserve.model_runner import ModelRunner  # noqa: E402
from radixserve.state import ForwardMode, ScheduledBatch  # noqa: E402
from radixserve_attention_triton.backend import TritonAttentionBackend  # noqa: E402
from radixserve_attention_triton.extend_kernel import plan_extend_blocks  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
# float32 on both: the GPU runs the same checks with real CUDA graphs (the capture of every size,
# replays of other lengths), the CPU with the EagerGraph stand-in
TOL = {"rtol": 5e-3, "atol": 5e-3} if ON_GPU else {"rtol": 1e-4, "atol": 1e-4}


def test_token_sizes_pad_by_little_and_end_at_the_maximum():
    sizes = default_extend_token_sizes(1100)
    assert sizes[0] == 64 and sizes[-1] == 1100 and sizes == sorted(set(sizes))
    assert all(b - a <= 128 for a, b in zip(sizes, sizes[1:], strict=False))
    assert default_extend_token_sizes(40) == [40]


@pytest.mark.parametrize("pack", [True, False], ids=["packed-single-tokens", "blocks-only"])
@pytest.mark.parametrize("prefix, ext", [([0], [1]), ([5, 0, 300], [1, 70, 1]), ([0, 0, 10], [16, 33, 0])])
def test_plan_covers_every_block_once_costliest_first(prefix, ext, pack):
    reqs, starts = plan_extend_blocks(prefix, ext, 16, pack_single_tokens=pack)
    blocks = sorted(zip(reqs, starts, strict=True))
    # a one-token request is one packed item (first token -1) unless packing is off (tree masks)
    expected = sorted((b, -1) if (e == 1 and pack) else (b, m) for b, e in enumerate(ext) for m in range(0, e, 16))
    assert blocks == expected
    cost = [prefix[b] + min(max(m, 0) + 16, ext[b]) for b, m in zip(reqs, starts, strict=True)]
    assert cost == sorted(cost, reverse=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny random Llama checkpoint (built here, not by conftest: the GPU runs this module with
    --noconftest)."""
    from radixserve.testing import tiny_checkpoint

    return tiny_checkpoint("llama", str(tmp_path_factory.mktemp("tiny-llama")), 0)


def _checkpoint(kind: str, tmp_path_factory) -> str:
    """The checkpoint a graph is checked on: a dense Llama, a sparse MoE (its experts' kernels under
    the graph), and int4 / fp8 decoder linears (the quantized GEMMs at extend sizes)."""
    import quant_fixtures as qf
    from family_cases import MOE_CASES
    from radixserve.testing import tiny_checkpoint

    root = tmp_path_factory.mktemp(kind)
    if kind == "qwen3-moe":
        model_type, overrides = MOE_CASES["Qwen3MoeForCausalLM"]
        return tiny_checkpoint(model_type, str(root / "ckpt"), 0, **overrides)
    src = tiny_checkpoint("llama", str(root / "float"), 0, tie_word_embeddings=False, **qf.TINY_QUANT_CONFIG)
    fmt, group = {"awq-g64": ("awq", 64), "fp8-block": ("fp8_block", 128)}[kind]
    qf.write_quantized_checkpoint(src, str(root / "quant"), str(root / "ref"), fmt, group)
    return str(root / "quant")


def _torch_native_runner(path: str, max_total_tokens: int, max_running_requests: int,
                         dtype: str = "float32") -> ModelRunner:
    return ModelRunner(Config.build({
        "model": {"path": path},
        "runtime": {"device": DEVICE, "dtype": dtype, "cuda_graph": False},
        "stack": {"attention": "torch_native"},
        "scheduler": {"max_total_tokens": max_total_tokens, "max_running_requests": max_running_requests},
    }), show_progress=False)


# the quantized GEMMs take bf16 activations on CUDA; graph and eager then differ by bf16 rounding
# of the padded shapes' different GEMM tilings at most
MODELS = {"llama": "float32", "qwen3-moe": "float32", "awq-g64": "bfloat16", "fp8-block": "bfloat16"}


@pytest.fixture(scope="module", params=list(MODELS))
def runner(request, tiny_llama, tmp_path_factory):
    """A runner whose attention is the triton backend (the registry offers it for CUDA only)."""
    kind = request.param
    path = tiny_llama if kind == "llama" else _checkpoint(kind, tmp_path_factory)
    dtype = MODELS[kind] if ON_GPU else "float32"
    r = _torch_native_runner(path, 1024, 8, dtype)
    _, kv_heads, head_dim = r._kv_shape()
    r.attn_backend = TritonAttentionBackend(SimpleNamespace(
        device=r.device, dtype=r.dtype, num_heads=r._num_heads(), num_kv_heads=kv_heads, head_dim=head_dim,
        req_to_token_pool=r.req_to_token_pool, kv_pool=r.kv_pool, max_bs=r.req_to_token_pool.size))
    r.attn_backend_name = "triton"
    return r


@pytest.fixture
def tol(runner) -> dict:
    return {"rtol": 3e-2, "atol": 3e-2} if runner.dtype == torch.bfloat16 else TOL


def _graphs(runner, sizes=(16, 48, 96), max_reqs=6) -> ExtendGraphRunner:
    pool = runner.req_to_token_pool
    return ExtendGraphRunner(runner.model, runner.attn_backend, pool, runner.kv_pool, runner.device,
                             list(sizes), max_reqs, dummy_row=pool.size - 1,
                             graph_factory=None if ON_GPU else EagerGraph)


class _Requests:
    """Requests with KV rows and slots in the runner's pools, freed at the end."""

    def __init__(self, runner):
        self.runner, self.rows, self.slots = runner, [], []

    def extend(self, ids_per_req: list[list[int]], prefix_lens: list[int], rows: list[int] | None = None,
               sample: bool = True) -> ScheduledBatch:
        pool, alloc = self.runner.req_to_token_pool, self.runner.token_allocator
        if rows is None:
            rows = [pool.alloc() for _ in ids_per_req]
            self.rows += rows
        loc = alloc.alloc(sum(len(ids) for ids in ids_per_req))
        self.slots.append(loc)
        at = 0
        for row, p, ids in zip(rows, prefix_lens, ids_per_req, strict=True):
            pool.write(row, p, loc[at : at + len(ids)])
            at += len(ids)
        return ScheduledBatch(ForwardMode.EXTEND, [None] * len(rows), [t for ids in ids_per_req for t in ids], rows,
                              list(prefix_lens), [len(ids) for ids in ids_per_req], loc)

    def free(self):
        for row in self.rows:
            self.runner.req_to_token_pool.free(row)
        for loc in self.slots:
            self.runner.token_allocator.free(loc)
        assert self.runner.token_allocator.available_size() == self.runner.token_allocator.size


def test_mixed_batch_replays_with_the_eager_logits_and_writes_only_its_slots(runner, tol):
    graphs = _graphs(runner)
    reqs = _Requests(runner)
    try:
        # two requests prefilled eagerly; then one step: both decode a token, a third brings a
        # 20-token prompt and a fourth a 9-token chunk after a 7-token cached prefix
        first = reqs.extend([[5, 6, 7, 8, 9], [11, 12, 13]], [0, 0])
        runner.forward_logits(first)
        chunk = reqs.extend([[40, 41, 42, 43, 44, 45, 46]], [0])
        runner.forward_logits(chunk)
        rows = first.req_pool_indices + chunk.req_pool_indices
        fresh_row = runner.req_to_token_pool.alloc()
        reqs.rows.append(fresh_row)
        prompt = list(range(60, 80))
        sb = reqs.extend([[21], [22], prompt, list(range(90, 99))], [5, 3, 0, 7], rows=rows[:2] + [fresh_row, rows[2]])

        k_before = runner.kv_pool.get_kv(0)[0].clone()
        logits_eager = runner.forward_logits(sb)
        k_eager = runner.kv_pool.get_kv(0)[0].clone()

        runner.kv_pool.get_kv(0)[0].copy_(k_before)
        fb = runner.prepare(sb)
        assert fb.num_tokens == 31 and graphs.can_run(fb) and graphs.padded_size(31) == 48
        logits_graph = graphs.run(fb).clone()
        k_graph = runner.kv_pool.get_kv(0)[0]

        real = set(sb.out_cache_loc.tolist())
        changed = set((k_graph != k_before).flatten(1).any(dim=1).nonzero().flatten().tolist())
        assert changed <= real | {0}, "padding tokens wrote to a real KV slot"
        assert real <= changed, "real tokens did not write their KV"
        slots = sorted(real)
        torch.testing.assert_close(k_graph[slots], k_eager[slots], **tol)
        assert logits_graph.shape[0] == 4
        torch.testing.assert_close(logits_graph, logits_eager[:, : logits_graph.shape[1]], **tol)

        # the same graph replays a batch of other lengths (one 40-token prompt): new host plan, same capture
        lone = reqs.extend([list(range(100, 140))], [0])
        logits_lone_eager = runner.forward_logits(lone)
        logits_lone_graph = graphs.run(runner.prepare(lone))
        torch.testing.assert_close(logits_lone_graph, logits_lone_eager[:, : logits_lone_graph.shape[1]],
                                   **tol)
    finally:
        reqs.free()


def test_batches_that_do_not_fit_run_eagerly(runner):
    graphs = _graphs(runner, sizes=(16, 32), max_reqs=3)
    reqs = _Requests(runner)
    try:
        too_long = runner.prepare(reqs.extend([list(range(1, 34))], [0]))
        assert not graphs.can_run(too_long)  # 33 tokens > 32
        three = runner.prepare(reqs.extend([[1], [2], [3]], [0, 0, 0]))
        assert not graphs.can_run(three)  # 3 requests leave no slot for the padding request
        two = runner.prepare(reqs.extend([[1], [2]], [0, 0]))
        assert graphs.can_run(two)
        decode = runner.prepare(ScheduledBatch(ForwardMode.DECODE, [None], [1], two.req_pool_indices.tolist()[:1],
                                               [1], [1], reqs.slots[-1][:1]))
        assert not graphs.can_run(decode)
    finally:
        reqs.free()


def test_the_runner_replays_extend_batches_when_configured(runner, tol):
    """ModelRunner._forward takes the extend graph for a batch that fits (and reports it), not for
    one that does not; greedy tokens are those of the eager path."""
    reqs = _Requests(runner)
    try:
        sb = reqs.extend([[7, 8, 9, 10, 11, 12]], [0])
        eager = runner.forward_logits(sb)
        assert not runner.last_run_used_cuda_graph
        runner.extend_graph_runner = _graphs(runner, sizes=(16,), max_reqs=4)
        graphed = runner.forward_logits(sb)
        assert runner.last_run_used_cuda_graph
        torch.testing.assert_close(graphed, eager, **tol)
        long = reqs.extend([list(range(1, 20))], [0])
        runner.forward_logits(long)
        assert not runner.last_run_used_cuda_graph  # 19 tokens > the one graph's 16
    finally:
        runner.extend_graph_runner = None
        reqs.free()


def test_a_backend_without_extend_graphs_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="no extend CUDA-graph support"):
        _graphs(_torch_native_runner(tiny_llama, 256, 2))


@pytest.mark.skipif(ON_GPU, reason="the CPU's message: on CUDA the option captures graphs")
def test_the_option_off_cuda_says_it_has_no_effect(tiny_llama, caplog):
    with caplog.at_level("INFO", logger="radixserve.model_runner"):
        r = ModelRunner(Config.build({
            "model": {"path": tiny_llama}, "runtime": {"cuda_graph_extend_max_tokens": 256},
            "scheduler": {"max_total_tokens": 256, "max_running_requests": 2},
        }), show_progress=False)
    assert r.extend_graph_runner is None
    assert "cuda_graph_extend_max_tokens=256 has no effect" in caplog.text
