"""The mla_triton latent-attention backend against a float64 DECOMPRESSED torch reference.

The backend works absorbed (queries moved into latent space, attention over the pool's latent rows);
the reference here computes each head's keys `[c_kv @ W_UK[h].T, k_pe]` and values `c_kv @ W_UV[h].T`
explicitly, so agreement checks the absorption algebra as well as the kernels. Without a GPU the
kernels run in Triton's CPU interpreter (float32, tiny shapes); with one, the same tests run in
bf16 at DeepSeek-V2-Lite's attention shape, plus a real CUDA-graph capture and replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from triton_interpret import use_interpreter_without_gpu

ON_GPU, _restore_interpret = use_interpreter_without_gpu()  # must precede the kernels' @triton.jit decoration
_restore_triton_interpret = pytest.fixture(autouse=True, scope="module")(_restore_interpret)

from radixserve.interfaces.attention import AttentionRunnerInfo  # noqa: E402
from radixserve.interfaces.latent_attention import LatentAttentionDims  # noqa: E402
from radixserve.layers.latent_attention import RadixLatentAttention  # noqa: E402
from radixserve.memory import LatentKVPool, ReqToTokenPool  # noqa: E402
from radixserve.state import ForwardBatch, ForwardMode, tree_block  # noqa: E402
from radixserve_attention_mla_triton.backend import MlaTritonBackend  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOL = 3e-2 if ON_GPU else 1e-4
# (heads, kv_lora_rank, rope, nope, v): tiny in the interpreter, DeepSeek-V2-Lite on a GPU
SHAPE = (16, 512, 64, 128, 128) if ON_GPU else (4, 64, 16, 32, 24)


@dataclass
class Problem:
    backend: MlaTritonBackend
    batch: ForwardBatch
    layer: RadixLatentAttention
    q_nope: torch.Tensor  # [T, H, nope]
    q_pe: torch.Tensor  # [T, H, rope]
    c_new: torch.Tensor  # [T, lora]
    pe_new: torch.Tensor  # [T, rope]
    rows_full: list[torch.Tensor]  # per request [seq, lora + rope]: every token's latent row
    pool_before: torch.Tensor
    blocks: list[torch.Tensor] | None = None  # per request [e, e] bool tree blocks


def make_problem(prefix_lens, extend_lens, mode=ForwardMode.EXTEND, seed=0, trees=None, shape=SHAPE,
                 dtype=DTYPE, num_slots=None, max_context=None, **backend_kwargs) -> Problem:
    heads, lora, rope, nope, v = shape
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    num_slots = num_slots or sum(seq_lens) + 9  # spare slots that must stay untouched
    max_ctx = max_context or max(seq_lens) + 5
    pool = LatentKVPool(num_slots, 2, lora, rope, dtype, DEVICE)
    for layer_id in range(2):  # the pool starts with noise: a kernel reading a wrong slot shows
        pool.get_latent(layer_id).copy_(torch.randn(num_slots + 1, lora + rope, generator=gen).to(dtype))
    r2t = ReqToTokenPool(bs + 3, max_ctx, DEVICE)
    garbage = torch.randint(1, num_slots + 1, (bs + 3, max_ctx), generator=gen)
    for row in range(bs + 3):  # entries past each request's length: stale slots never to be read
        r2t.write(row, 0, garbage[row])
    perm = (torch.randperm(num_slots, generator=gen) + 1).tolist()
    rows = torch.randperm(bs + 3, generator=gen)[:bs].tolist()

    def rand(*s: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*s, generator=gen) * scale).to(dtype).to(DEVICE)

    kv_b = torch.nn.Linear(lora, heads * (nope + v), bias=False).to(DEVICE, dtype)
    with torch.no_grad():
        kv_b.weight.copy_(rand(heads * (nope + v), lora, scale=lora**-0.5))
    layer = RadixLatentAttention(1, heads, lora, nope, rope, v, 1.3 * (nope + rope) ** -0.5, kv_b)
    rows_full, out_loc, cursor = [], [], 0
    for i in range(bs):
        slots = torch.tensor(perm[cursor: cursor + seq_lens[i]], dtype=torch.int64)
        cursor += seq_lens[i]
        r2t.write(rows[i], 0, slots)
        full = rand(seq_lens[i], lora + rope)
        rows_full.append(full)
        if prefix_lens[i]:
            pool.set_latent(1, slots[: prefix_lens[i]].to(DEVICE), full[: prefix_lens[i], :lora],
                            full[: prefix_lens[i], lora:])
        out_loc.append(slots[prefix_lens[i]:])
    new = torch.cat([f[p:] for f, p in zip(rows_full, prefix_lens, strict=True)])
    num_tokens = sum(extend_lens)
    dims = LatentAttentionDims(2, heads, lora, nope, rope, v)
    info = AttentionRunnerInfo(
        device=torch.device(DEVICE), dtype=dtype, num_layers=2, num_heads=heads, num_kv_heads=1,
        head_dim=lora + rope, req_to_token_pool=r2t, kv_pool=pool, max_bs=bs + 3, context_len=max_ctx, latent=dims,
    )
    backend = MlaTritonBackend(info, **backend_kwargs)

    def dev(xs) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64, device=DEVICE)

    blocks = [tree_block(p) for p in trees] if trees is not None else None
    batch = ForwardBatch(
        mode=mode, batch_size=bs, input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens, strict=True)]).to(DEVICE),
        req_pool_indices=dev(rows), seq_lens=dev(seq_lens), prefix_lens=dev(prefix_lens),
        extend_lens=dev(extend_lens), out_cache_loc=torch.cat(out_loc).to(DEVICE), req_to_token_pool=r2t,
        kv_pool=pool, attn_backend=backend, seq_lens_cpu=list(seq_lens), prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens),
        tree_mask=None if blocks is None else torch.tensor(
            [x for blk in blocks for r in blk for x in r], dtype=torch.bool, device=DEVICE),
        tree_mask_cpu=blocks,
    )
    return Problem(backend, batch, layer, rand(num_tokens, heads, nope), rand(num_tokens, heads, rope),
                   new[:, :lora].contiguous(), new[:, lora:].contiguous(), rows_full,
                   pool.get_latent(1).clone(),
                   None if blocks is None else [torch.tensor(b, device=DEVICE) for b in blocks])


def reference(p: Problem) -> torch.Tensor:
    """Decompressed attention in float64: explicit per-head keys and values from the latent rows."""
    layer, b = p.layer, p.batch
    lora = layer.kv_lora_rank
    w_uk, w_uv = layer.w_uk.double(), layer.w_uv.double()  # [H, nope, L], [H, v, L]
    outs, start = [], 0
    for i, full in enumerate(p.rows_full):
        ext, seq = b.extend_lens_cpu[i], b.seq_lens_cpu[i]
        c, pe = full[:, :lora].double(), full[:, lora:].double()
        k_nope = torch.einsum("sl,hnl->shn", c, w_uk)
        values = torch.einsum("sl,hvl->shv", c, w_uv)
        qn, qp = p.q_nope[start: start + ext].double(), p.q_pe[start: start + ext].double()
        scores = (torch.einsum("thn,shn->hts", qn, k_nope) + torch.einsum("thr,sr->hts", qp, pe)) * layer.scaling
        hidden = torch.arange(seq, device=c.device)[None, :] > torch.arange(seq - ext, seq, device=c.device)[:, None]
        if p.blocks is not None:
            hidden = hidden.clone()
            hidden[:, seq - ext:] = ~p.blocks[i]
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hts,shv->thv", scores.softmax(-1), values).reshape(ext, -1))
        start += ext
    return torch.cat(outs)


def run(p: Problem) -> torch.Tensor:
    p.backend.init_forward_metadata(p.batch)
    return p.batch.attn_backend.forward_latent(p.q_nope, p.q_pe, p.c_new, p.pe_new, p.layer, p.batch)


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    assert out.dtype == DTYPE and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: NaN/inf in the output"
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < TOL, f"{what}: relative error {rel:.2e} >= {TOL:.0e}"


def assert_pool_written(p: Problem) -> None:
    """The new rows are at out_cache_loc (c_kv then k_pe); every other slot and layer is unchanged."""
    buf = p.batch.kv_pool.get_latent(1)
    loc = p.batch.out_cache_loc
    assert torch.equal(buf[loc], torch.cat([p.c_new, p.pe_new], 1))
    others = torch.ones(buf.shape[0], dtype=torch.bool, device=buf.device)
    others[loc] = False
    assert torch.equal(buf[others], p.pool_before[others])


EXTEND_CASES = [([0, 5, 19], [7, 1, 12]), ([3, 0], [20, 2])] if not ON_GPU else [
    ([0, 300, 0, 1000], [1, 77, 300, 257]), ([i * 37 % 500 for i in range(8)], [1 + i * 13 % 130 for i in range(8)])]
DECODE_SEQS = [[1, 40, 90], [17]] if not ON_GPU else [[1], [17, 1024, 8192], [1 + (i * 131) % 8192 for i in range(64)]]


@pytest.mark.parametrize("prefix_lens, extend_lens", EXTEND_CASES)
def test_extend_matches_decompressed_reference_and_stores_rows(prefix_lens, extend_lens):
    p = make_problem(prefix_lens, extend_lens, seed=1)
    out = run(p)
    assert_pool_written(p)
    assert_close(out, reference(p), f"extend {prefix_lens} + {extend_lens}")


@pytest.mark.parametrize("seq_lens", DECODE_SEQS)
def test_decode_matches_decompressed_reference_with_several_splits(seq_lens):
    kwargs = {} if ON_GPU else {"min_split_tokens": 16, "max_kv_splits": 4, "sm_count": 8}
    p = make_problem([s - 1 for s in seq_lens], [1] * len(seq_lens), ForwardMode.DECODE, seed=2, **kwargs)
    out = run(p)
    if not ON_GPU and max(seq_lens) > 32:
        assert int(p.batch.attn_metadata.num_kv_splits.max()) > 1, "this case should split the KV"
    assert_pool_written(p)
    assert_close(out, reference(p), f"decode {seq_lens}")


def test_decode_split_count_does_not_change_the_result():
    outs = []
    for splits in (1, 4):
        p = make_problem([70, 3], [1, 1], ForwardMode.DECODE, seed=3, max_kv_splits=splits, min_split_tokens=16)
        outs.append(run(p))
    assert ((outs[0] - outs[1]).double().norm() / outs[0].double().norm()).item() < (1e-2 if ON_GPU else 1e-6)


def test_chunked_prefill_equals_one_extend():
    """A prompt prefilled in chunks (each chunk attending the earlier chunks from the pool) gives the
    same outputs as one extend over the whole prompt."""
    whole = make_problem([0], [23], seed=4)
    outs, pos = [], 0
    for chunk in (9, 9, 5):
        part = make_problem([pos], [chunk], seed=4)
        # same request, same rows: reuse the whole-prompt problem's tensors for this slice
        part.rows_full = [whole.rows_full[0][: pos + chunk]]
        part.layer = whole.layer
        part.batch.kv_pool, part.batch.req_to_token_pool = whole.batch.kv_pool, whole.batch.req_to_token_pool
        part.batch.req_pool_indices = whole.batch.req_pool_indices
        part.batch.out_cache_loc = whole.batch.out_cache_loc[pos: pos + chunk]
        part.q_nope, part.q_pe = whole.q_nope[pos: pos + chunk], whole.q_pe[pos: pos + chunk]
        part.c_new, part.pe_new = whole.c_new[pos: pos + chunk], whole.pe_new[pos: pos + chunk]
        outs.append(run(part))
        pos += chunk
    got = torch.cat(outs)
    want = run(whole)  # after the chunks: it stores the same rows again
    assert ((got - want).double().norm() / want.double().norm()).item() < (2e-2 if ON_GPU else 1e-6)


def test_tree_mask_verify_matches_decompressed_reference():
    """Speculative verify of draft trees: new tokens see their ancestors only, the prefix fully;
    one tree longer than a query block, a single token beside it; a chain as a tree equals causal."""
    trees = [[-1, 0, 0, 1, 1, 2, 0, 6, 3, 3, 4, 5, 0, 12, 13, 14, 15, 2, 17], [-1], [-1, 0, 1, 1, 0]]
    p = make_problem([12, 30, 0], [len(t) for t in trees], seed=5, trees=trees)
    out = run(p)
    assert_pool_written(p)
    assert_close(out, reference(p), "tree verify")
    causal = make_problem([12, 30, 0], [len(t) for t in trees], seed=5)
    assert (out - run(causal)).abs().max() > 1e-2, "the trees must change the result"
    chain = [list(range(-1, 10)), [-1]]
    with_mask = run(make_problem([7, 3], [11, 1], seed=6, trees=chain))
    causal = run(make_problem([7, 3], [11, 1], seed=6))
    # exact in the interpreter (fp32); bf16 on the GPU rounds the masked and causal tiles' sums apart by an
    # ulp here and there (an H100, session 23: absolute norm 0.0039), as this file's other GPU comparisons allow
    assert ((with_mask - causal).double().norm() / causal.double().norm()).item() < (1e-2 if ON_GPU else 1e-6)


def test_decode_rows_may_share_a_request():
    """`decode_rows_share_requests`: consecutive decode rows that are consecutive tokens of one request
    equal causal extend attention over those tokens (all rows are stored before any row reads)."""
    assert MlaTritonBackend.decode_rows_share_requests
    p = make_problem([19, 33], [5, 1], seed=7)
    want = reference(p)
    b = p.batch
    rows = b.req_pool_indices.tolist()
    seq = [20, 21, 22, 23, 24, 34]
    dev = b.seq_lens.device
    b.mode, b.batch_size = ForwardMode.DECODE, 6
    b.req_pool_indices = torch.tensor([rows[0]] * 5 + [rows[1]], device=dev)
    b.seq_lens, b.seq_lens_cpu = torch.tensor(seq, device=dev), seq
    b.prefix_lens, b.prefix_lens_cpu = torch.tensor([s - 1 for s in seq], device=dev), [s - 1 for s in seq]
    b.extend_lens, b.extend_lens_cpu = torch.ones(6, dtype=torch.int64, device=dev), [1] * 6
    assert_close(run(p), want, "chain rows in one decode batch")


def test_graph_metadata_is_refreshed_in_place():
    """capture/replay plan the splits into the static buffers: after the lengths grow, the same
    buffers hold the new plan and the result is right."""
    kwargs = {"min_split_tokens": 16, "max_kv_splits": 8, "sm_count": 8}
    short = make_problem([3, 9], [1, 1], ForwardMode.DECODE, seed=8, **kwargs)
    b = short.backend
    b.init_graph_state(max_bs=4)
    b.init_forward_metadata_capture(short.batch)
    static = short.batch.attn_metadata.num_kv_splits
    assert static.data_ptr() == b._graph.num_kv_splits.data_ptr() and static.tolist() == [1, 1]
    long = make_problem([60, 100], [1, 1], ForwardMode.DECODE, seed=9, **kwargs)
    long.batch.attn_backend = b
    b.init_forward_metadata_replay(long.batch, real_bs=2)
    meta = long.batch.attn_metadata
    assert meta.num_kv_splits.data_ptr() == static.data_ptr() and meta.mid_o.data_ptr() == b._graph.mid_o.data_ptr()
    assert static.tolist()[1] > 1
    out = b.forward_latent(long.q_nope, long.q_pe, long.c_new, long.pe_new, long.layer, long.batch)
    assert_close(out, reference(long), "replayed metadata")
    with pytest.raises(ValueError, match="captures decode batches only"):
        b.init_forward_metadata_capture(make_problem([2], [3], seed=10).batch)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay_with_new_lengths():
    sizes = {"num_slots": 1000, "max_context": 1000}  # both steps' pools and tables have one shape
    p = make_problem([50, 7, 900], [1, 1, 1], ForwardMode.DECODE, seed=11, **sizes)
    b, batch = p.backend, p.batch
    b.init_graph_state(max_bs=3)
    b.init_forward_metadata_capture(batch)
    args = [t.clone() for t in (p.q_nope, p.q_pe, p.c_new, p.pe_new)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        b.forward_latent(*args, p.layer, batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = b.forward_latent(*args, p.layer, batch)
    nxt = make_problem([51, 8, 901], [1, 1, 1], ForwardMode.DECODE, seed=12, **sizes)
    # the next step written into the captured tensors: pool, table, lengths, inputs; weights stay
    batch.kv_pool.get_latent(1).copy_(nxt.batch.kv_pool.get_latent(1))
    batch.req_to_token_pool.req_to_token.copy_(nxt.batch.req_to_token_pool.req_to_token)
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
        getattr(batch, name).copy_(getattr(nxt.batch, name))
    for dst, src in zip(args, (nxt.q_nope, nxt.q_pe, nxt.c_new, nxt.pe_new), strict=True):
        dst.copy_(src)
    nxt.layer = p.layer
    b.init_forward_metadata_replay(batch, real_bs=3)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference(nxt), "graph replay")


def test_latent_conformance_kit():
    """radixserve.testing's latent kit: random scenarios (shared prefixes, chunked prefill in mixed
    batches, decode over random subsets, draft trees, chain rows sharing a request in one decode
    batch) against its exact decompressed reference, pools compared after every step."""
    from radixserve.testing import check_latent_attention_backend

    if ON_GPU:
        check_latent_attention_backend(MlaTritonBackend, device="cuda", dtype=torch.bfloat16, tolerance=TOL)
    else:  # the interpreter is slow: one seed, fewer steps; both default shapes (odd heads, rope 8)
        check_latent_attention_backend(MlaTritonBackend, seeds=(0,), num_requests=3, decode_steps=2, tree_steps=2,
                                       decode_row_steps=1)


def test_refuses_standard_attention_and_declares_its_flags():
    assert MlaTritonBackend.supports_latent_attention and not MlaTritonBackend.supports_standard_attention
    assert MlaTritonBackend.supports_tree_mask
    assert MlaTritonBackend.supports("cuda", "bfloat16", 576)
    assert not MlaTritonBackend.supports("cuda", "int8", 576)
    p = make_problem([2], [1], ForwardMode.DECODE)
    assert p.backend.supports_cuda_graph()
    info = AttentionRunnerInfo(
        device=torch.device(DEVICE), dtype=DTYPE, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=64,
        req_to_token_pool=p.batch.req_to_token_pool, kv_pool=p.batch.kv_pool, max_bs=4, context_len=16,
    )
    with pytest.raises(ValueError, match="latent attention .MLA. only"):
        MlaTritonBackend(info)


def test_registered_as_a_latent_cuda_backend():
    from radixserve.plugins.known import install_hint
    from radixserve.plugins.registry import Registry

    reg = Registry.discover()
    spec = reg.get("attention", "mla_triton")
    assert spec.devices == ("cuda",) and "latent_attention" in spec.capabilities
    assert spec.distribution == install_hint("attention", "mla_triton") == "radixserve-attention-mla_triton"
    assert reg.load("attention", "mla_triton") is MlaTritonBackend
    assert reg.default("attention", "cuda").name != "mla_triton"  # never the default for standard models


def test_stack_default_on_cuda_by_attention_type():
    """With stack.attention unset the runner picks, per model attention type, the highest-priority
    CUDA backend that supports it: mla_triton for a latent model, never for a standard one."""
    from radixserve.plugins.registry import Registry
    from radixserve.plugins.stack import default_attention

    reg = Registry.discover()
    assert default_attention(reg, "cuda", "latent").name == "mla_triton"
    assert default_attention(reg, "cuda", "standard").name == "triton"
