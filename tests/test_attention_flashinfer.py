"""The flashinfer attention plugin on CPU: everything around FlashInfer's kernels (page-size-1 page
lists from req_to_token rows, prefix/fresh splits, tree custom masks, CUDA-graph buffers, backend
selection and its errors). The kernels themselves are stood in for by flashinfer_reference (pure
torch, FlashInfer's documented semantics); benchmarks/h200/s5_flashinfer.sh runs the real ones."""

from __future__ import annotations

import sys
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from flashinfer_reference import REFERENCE_KERNELS
from radixserve.config import Config
from radixserve.memory.kv_pool import KVPool
from radixserve.memory.req_to_token import ReqToTokenPool
from radixserve.plugins.registry import PluginError, Registry
from radixserve.plugins.stack import resolve_stack
from radixserve.state import ForwardBatch, ForwardMode
from radixserve.testing.attention import check_attention_backend
from radixserve_attention_flashinfer.backend import FlashInferAttentionBackend
from radixserve_attention_flashinfer.kernels import FlashInferUnavailable, load_kernels
from radixserve_attention_flashinfer.planning import (
    DecodeGraphBuffers,
    gather_token_slots,
    indptr_from_lens,
    tree_custom_mask,
)

Backend = partial(FlashInferAttentionBackend, kernels=REFERENCE_KERNELS, workspace_bytes=1024)


# ---- planning --------------------------------------------------------------------------------
def test_indptr_is_the_int32_running_sum_on_the_host():
    ind = indptr_from_lens([3, 0, 5])
    assert ind.dtype == torch.int32 and ind.device.type == "cpu"
    assert ind.tolist() == [0, 3, 3, 8]
    assert indptr_from_lens([]).tolist() == [0]


def test_page_lists_are_each_rows_leading_slots_in_request_order():
    r2t = torch.arange(6 * 10, dtype=torch.int64).view(6, 10) + 100
    rows, lens = torch.tensor([4, 1, 2]), torch.tensor([3, 1, 5])
    slots = gather_token_slots(r2t, rows, lens, total=9)
    expected = [int(r2t[r, p]) for r, n in zip(rows.tolist(), lens.tolist()) for p in range(n)]
    assert slots.dtype == torch.int32 and slots.tolist() == expected
    buf = torch.full((12,), -1, dtype=torch.int32)
    view = gather_token_slots(r2t, rows, lens, total=9, out=buf)
    assert view.data_ptr() == buf.data_ptr() and buf[:9].tolist() == expected and buf[9:].tolist() == [-1] * 3
    with pytest.raises(ValueError, match="holds 4 slots, this batch needs 9"):
        gather_token_slots(r2t, rows, lens, total=9, out=torch.zeros(4, dtype=torch.int32))


def test_tree_custom_mask_puts_every_prefix_column_before_the_tree_block():
    # request 0: prefix 2, tree of 3 (root, two children); request 1: no prefix, chain of 2
    tree0 = [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    tree1 = [[1, 0], [1, 1]]
    flat = torch.tensor([x for row in tree0 for x in row] + [x for row in tree1 for x in row], dtype=torch.bool)
    mask = tree_custom_mask(flat, prefix_lens=[2, 0], extend_lens=[3, 2])
    assert mask.shape == (3 * 5 + 2 * 2,)
    assert mask[:15].view(3, 5).int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]
    assert mask[15:].view(2, 2).int().tolist() == tree1
    with pytest.raises(ValueError, match="tree_mask has 12 entries.*account for 13"):
        tree_custom_mask(flat[:12], [2, 0], [3, 2])


def test_graph_buffers_hand_out_views_per_batch_size_and_refuse_overflow():
    bufs = DecodeGraphBuffers.allocate(max_bs=4, capacity=32, device=torch.device("cpu"))
    indptr, indices, last = bufs.for_batch(2)
    assert indptr.shape == (3,) and last.tolist() == [1, 1] and indices.shape == (32,)
    assert indptr.data_ptr() == bufs.indptr.data_ptr() and indices.data_ptr() == bufs.indices.data_ptr()
    with pytest.raises(ValueError, match="outside the graph buffers' 1..4"):
        bufs.for_batch(5)
    with pytest.raises(ValueError, match="reads 33 KV slots.*max_graph_kv_slots"):
        bufs.check_fits(33)


# ---- the backend through the conformance kit (reference kernels) --------------------------------
def test_conformance_kit_with_reference_kernels():
    """Extend (fresh, cached prefixes, mixed), decode, decode rows sharing a request, and tree verify."""
    check_attention_backend(Backend, dtype=torch.float32, seeds=(0,), tree_steps=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conformance_kit_in_half_precision(dtype):
    check_attention_backend(Backend, dtype=dtype, seeds=(1,), heads=((4, 2, 32),), tree_steps=1)


def _batch(mode, prefix_lens, extend_lens, heads=(4, 2, 16), scaling=None, seed=0):
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = KVPool(sum(seq) + 4, num_layers=1, num_kv_heads=hkv, head_dim=d, dtype=torch.float32, device="cpu")
    r2t = ReqToTokenPool(size=len(seq) + 2, max_context_len=max(seq) + 2, device="cpu")
    slots = (torch.randperm(sum(seq), generator=gen) + 1).tolist()
    rows, out_loc, cur = [], [], 0
    for i, n in enumerate(seq):
        r2t.write(i + 1, 0, torch.tensor(slots[cur: cur + n]))
        rows.append(i + 1)
        out_loc += slots[cur + prefix_lens[i]: cur + n]
        if prefix_lens[i]:
            pre = torch.tensor(slots[cur: cur + prefix_lens[i]])
            pool.set_kv(0, pre, torch.randn(prefix_lens[i], hkv, d, generator=gen),
                        torch.randn(prefix_lens[i], hkv, d, generator=gen))
        cur += n
    t = sum(extend_lens)
    info = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, num_heads=hq, num_kv_heads=hkv,
                           head_dim=d, req_to_token_pool=r2t, kv_pool=pool, max_bs=len(seq) + 2,
                           context_len=max(seq) + 2)
    backend = Backend(info)
    i64 = partial(torch.tensor, dtype=torch.int64)
    batch = ForwardBatch(
        mode=mode, batch_size=len(seq), input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]),
        req_pool_indices=i64(rows), seq_lens=i64(seq), prefix_lens=i64(prefix_lens), extend_lens=i64(extend_lens),
        out_cache_loc=i64(out_loc), req_to_token_pool=r2t, kv_pool=pool, attn_backend=backend,
        seq_lens_cpu=seq, prefix_lens_cpu=list(prefix_lens), extend_lens_cpu=list(extend_lens),
    )
    layer = SimpleNamespace(layer_id=0, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                            scaling=d ** -0.5 if scaling is None else scaling, sliding_window=None, logit_cap=None)
    q, k, v = (torch.randn(t, h * d, generator=gen) for h in (hq, hkv, hkv))
    return backend, batch, layer, (q, k, v)


def _exact(batch, layer, q):
    """Causal attention of each new token over its request's pool KV (after the forward stored it)."""
    k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
    out, start = [], 0
    for row, p, e in zip(batch.req_pool_indices.tolist(), batch.prefix_lens_cpu, batch.extend_lens_cpu):
        slots = batch.req_to_token_pool.req_to_token[row, : p + e]
        qi = q[start: start + e].view(e, layer.num_heads, layer.head_dim)
        g = layer.num_heads // layer.num_kv_heads
        k, v = k_buf[slots].repeat_interleave(g, 1), v_buf[slots].repeat_interleave(g, 1)
        s = torch.einsum("nhd,mhd->hnm", qi, k) * layer.scaling
        s = s.masked_fill(torch.arange(p + e)[None, None] > torch.arange(p, p + e)[None, :, None], float("-inf"))
        out.append(torch.einsum("hnm,mhd->nhd", s.softmax(-1), v).reshape(e, -1))
        start += e
    return torch.cat(out)


def test_fresh_prompts_take_the_ragged_path_and_prefixes_the_paged_one():
    backend, batch, layer, (q, k, v) = _batch(ForwardMode.EXTEND, [0, 0], [5, 3])
    backend.init_forward_metadata(batch)
    assert batch.attn_metadata.path == "ragged" and backend.ragged_wrapper.plans == 1
    torch.testing.assert_close(backend.forward(q, k, v, layer, batch), _exact(batch, layer, q))
    backend, batch, layer, (q, k, v) = _batch(ForwardMode.EXTEND, [0, 4], [5, 3])
    backend.init_forward_metadata(batch)
    assert batch.attn_metadata.path == "paged" and backend.paged_wrapper.plans == 1
    torch.testing.assert_close(backend.forward(q, k, v, layer, batch), _exact(batch, layer, q))


def test_a_layer_scale_other_than_the_planned_one_is_honoured():
    for mode, prefix, extend in ((ForwardMode.EXTEND, [0], [6]), (ForwardMode.EXTEND, [3], [2]),
                                 (ForwardMode.DECODE, [7, 2], [1, 1])):
        backend, batch, layer, (q, k, v) = _batch(mode, prefix, extend, scaling=0.37, seed=3)
        backend.init_forward_metadata(batch)
        torch.testing.assert_close(backend.forward(q, k, v, layer, batch), _exact(batch, layer, q))


def test_graph_decode_plans_into_static_buffers_and_replays_with_new_lengths():
    backend, batch, layer, (q, k, v) = _batch(ForwardMode.DECODE, [2, 6], [1, 1], seed=4)
    backend.init_graph_state(max_bs=4)
    backend.init_forward_metadata_capture(batch)
    wrapper = batch.attn_metadata.wrapper
    assert wrapper.options["use_cuda_graph"] and wrapper is backend.graph_wrapper(2)
    assert wrapper.indices_buf.data_ptr() == backend.graph_buffers.indices.data_ptr()
    torch.testing.assert_close(backend.forward(q, k, v, layer, batch), _exact(batch, layer, q))
    # next step on the same backend and static batch: longer requests, refreshed in place
    _, nxt, _, (q2, k2, v2) = _batch(ForwardMode.DECODE, [5, 9], [1, 1], seed=5)
    backend.req_to_token_pool = nxt.req_to_token_pool
    nxt.attn_backend = backend
    backend.init_forward_metadata_replay(nxt, real_bs=2)
    assert nxt.attn_metadata.wrapper is wrapper and wrapper.plans == 2
    assert backend.graph_buffers.indptr[:3].tolist() == [0, 6, 16]
    torch.testing.assert_close(backend.forward(q2, k2, v2, layer, nxt), _exact(nxt, layer, q2))
    backend.graph_buffers = DecodeGraphBuffers.allocate(4, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="reads 16 KV slots"):
        backend.init_forward_metadata_capture(nxt)


def test_graph_page_list_capacity_is_bounded_by_the_pool():
    backend, *_ = _batch(ForwardMode.DECODE, [2, 6], [1, 1])  # pool of 14 slots, context_len 9
    assert backend.graph_kv_capacity(4) == 4 * 9  # max_bs * context_len is the smaller bound here
    backend.context_len = 10_000
    assert backend.graph_kv_capacity(4) == 4 * backend.kv_pool.num_slots + 4
    backend.max_graph_kv_slots = 100
    assert backend.graph_kv_capacity(4) == 100


def test_graph_runner_pads_and_replays_through_the_backend():
    """The core DecodeGraphRunner's padded replay (dummy rows -> slot 0) through this backend."""
    from radixserve.cuda_graph_runner import DecodeGraphRunner, EagerGraph

    backend, batch, layer, (q, k, v) = _batch(ForwardMode.DECODE, [3, 8, 5], [1, 1, 1], seed=6)
    seen = {}

    class Model:  # one attention layer; logits = the attention output
        def forward(self, input_ids, positions, fb):
            bs = fb.batch_size
            out = fb.attn_backend.forward(q_buf[:bs], k_buf[:bs], v_buf[:bs], layer, fb)
            seen["bs"] = bs
            return out

        def compute_logits(self, hidden):
            return hidden

    q_buf, k_buf, v_buf = (torch.zeros(4, x.shape[1]) for x in (q, k, v))
    dummy = batch.req_to_token_pool.alloc()
    runner = DecodeGraphRunner(Model(), backend, batch.req_to_token_pool, batch.kv_pool, torch.device("cpu"),
                               [1, 2, 4], dummy, graph_factory=EagerGraph)
    assert sorted(backend.graph_wrappers) == [1, 2, 4]
    q_buf[:3], k_buf[:3], v_buf[:3] = q, k, v
    out = runner.run(batch)
    assert seen["bs"] == 4 and out.shape[0] == 3
    torch.testing.assert_close(out, _exact(batch, layer, q))


def test_extend_graph_runner_pads_and_replays_through_the_backend():
    """The core ExtendGraphRunner (plugin API 1.10) through this backend: a mixed batch (a decode row,
    a prompt chunk after a prefix, a fresh prompt) padded to the captured token count replays the
    paged-prefill graph wrapper, planned into the static buffers, with the exact attention."""
    from radixserve.cuda_graph_runner import EagerGraph
    from radixserve.extend_graph_runner import ExtendGraphRunner

    backend, batch, layer, (q, k, v) = _batch(ForwardMode.EXTEND, [10, 4, 0], [1, 3, 5], seed=9)  # rows of 13
    n = batch.num_tokens
    seen = {}

    class Model:  # one attention layer; the "logits" of a request are its last token's attention output
        def forward(self, input_ids, positions, fb):
            t = input_ids.shape[0]
            seen["tokens"], seen["reqs"] = t, fb.batch_size
            return fb.attn_backend.forward(q_buf[:t], k_buf[:t], v_buf[:t], layer, fb)

        def compute_logits(self, hidden):
            return hidden

    q_buf, k_buf, v_buf = (torch.zeros(16, x.shape[1]) for x in (q, k, v))
    dummy = batch.req_to_token_pool.alloc()
    runner = ExtendGraphRunner(Model(), backend, batch.req_to_token_pool, batch.kv_pool, torch.device("cpu"),
                               [12, 13], 5, dummy, graph_factory=EagerGraph)
    assert sorted(backend.extend_graph_wrappers) == [12, 13]
    wrapper = backend.extend_graph_wrappers[12]
    assert wrapper.options["use_cuda_graph"] and wrapper.bufs[0].data_ptr() == backend.extend_graph_buffers.qo_indptr.data_ptr()
    q_buf[:n], k_buf[:n], v_buf[:n] = q, k, v
    out = runner.run(batch)
    assert seen == {"tokens": 12, "reqs": 5} and out.shape[0] == 3
    exact = _exact(batch, layer, q)
    last_rows = [0, 3, 8]  # each request's last new token
    torch.testing.assert_close(out, exact[last_rows])
    with pytest.raises(ValueError, match="5 request slots"):
        backend.init_extend_metadata_capture(batch)  # not padded


# ---- selection and errors ---------------------------------------------------------------------
def test_registered_for_cuda_below_triton_and_listed_by_the_cli():
    from plugin_fixtures import run_cli

    spec = Registry.discover().get("attention", "flashinfer")
    assert spec.distribution == "radixserve-attention-flashinfer" and spec.devices == ("cuda",)
    assert spec.priority < Registry.discover().get("attention", "triton").priority
    assert "tree_mask" in spec.capabilities and "cuda_graph" in spec.capabilities
    r = run_cli(["plugins"])
    assert r.returncode == 0 and "radixserve-attention-flashinfer" in r.stdout


def test_supports_only_cuda_half_precision_and_instantiated_head_sizes():
    assert FlashInferAttentionBackend.supports("cuda", "bfloat16", 128)
    assert FlashInferAttentionBackend.supports("cuda:1", "float16", 64)
    assert not FlashInferAttentionBackend.supports("cpu", "bfloat16", 128)
    assert not FlashInferAttentionBackend.supports("cuda", "float32", 128)
    assert not FlashInferAttentionBackend.supports("cuda", "bfloat16", 96)


def test_selecting_it_on_cpu_is_a_stack_error_naming_its_devices():
    with pytest.raises(PluginError, match="stack.attention='flashinfer'.*does not support device 'cpu'.*cuda"):
        resolve_stack(Config.build({"stack": {"attention": "flashinfer"}}), Registry.discover(), "cpu")


def test_non_cuda_device_names_the_backends_that_would_work():
    with pytest.raises(FlashInferUnavailable, match="CUDA GPUs only.*'cpu'.*torch_native"):
        load_kernels("cpu")
    info = SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(FlashInferUnavailable, match="CUDA GPUs only"):
        FlashInferAttentionBackend(info)


def test_missing_flashinfer_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer.* -> ImportError
    with pytest.raises(FlashInferUnavailable, match="needs the flashinfer-python package.*pip install "
                                                    "radixserve-attention-flashinfer.*triton"):
        load_kernels("cuda")


def test_the_plugin_never_imports_flashinfer_until_the_backend_is_built():
    import subprocess

    code = ("import sys; from radixserve.plugins.registry import Registry; r = Registry.discover(); "
            "r.load('attention', 'flashinfer'); print('flashinfer' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_prefill_kernels_can_be_picked_by_variable_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_FLASHINFER_PREFILL", "fa2")
    backend, *_ = _batch(ForwardMode.EXTEND, [0], [3])
    assert backend.paged_wrapper.options["backend"] == "fa2" and backend.tree_wrapper is backend.paged_wrapper
    monkeypatch.setenv("RADIXSERVE_FLASHINFER_PREFILL", "fa4")
    with pytest.raises(ValueError, match="RADIXSERVE_FLASHINFER_PREFILL.*got 'fa4'"):
        _batch(ForwardMode.EXTEND, [0], [3])
