"""Benchmark the triton attention kernels on a GPU against their limit and a peer.

Decode: time per layer of the split-KV decode kernels (Llama-3.1-8B attention shapes: 32 query heads,
8 KV heads, head dim 128, bf16) over KV scattered through the token-slot pool, against the bound
KV bytes read / HBM bandwidth. Each point is timed two ways: one eager call after an L2 flush
(`triton.testing.do_bench`), and inside a CUDA graph that runs one call per layer across enough layers
that the KV read is several times the 60 MB L2 (the way a model's decode step uses it).
Extend: throughput of the extend kernel (no prefix, and with a cached prefix) against torch SDPA
(`is_causal`, contiguous K/V, its flash backend) on the same shapes.

Usage: python benchmarks/attention_kernels.py [--out results.md] [--bandwidth-tbs 4.26]
Needs CUDA; prints a markdown report (and writes it to --out).
"""

from __future__ import annotations

import argparse
import math
import platform
import subprocess
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton
import triton.testing
from radixserve.memory.kv_pool import KVPool
from radixserve.memory.req_to_token import ReqToTokenPool
from radixserve.state import ForwardBatch, ForwardMode
from radixserve_attention_triton.backend import TritonAttentionBackend

H, KVH, D = 32, 8, 128  # Llama-3.1-8B per-layer attention shapes
DTYPE = torch.bfloat16
L2_BYTES = 60 * 2**20


@dataclass
class Layer:
    layer_id: int
    num_heads: int = H
    num_kv_heads: int = KVH
    head_dim: int = D
    scaling: float = D**-0.5


def build(prefix: list[int], ext: list[int], num_layers: int, mode: ForwardMode, **kw):
    """Pools with every request's KV scattered over random slots, and the batch for one step."""
    bs = len(prefix)
    seq = [p + e for p, e in zip(prefix, ext)]
    slots = sum(seq)
    pool = KVPool(slots, num_layers, KVH, D, DTYPE, "cuda")
    for kb, vb in zip(pool.k_buffers, pool.v_buffers):
        kb.normal_()
        vb.normal_()
    r2t = ReqToTokenPool(bs, max(seq), "cuda")
    perm = torch.randperm(slots, device="cuda") + 1
    out_loc, cur = [], 0
    for i in range(bs):
        r2t.req_to_token[i, : seq[i]] = perm[cur : cur + seq[i]]
        out_loc.append(perm[cur + prefix[i] : cur + seq[i]])
        cur += seq[i]
    info = SimpleNamespace(device="cuda", dtype=DTYPE, num_heads=H, num_kv_heads=KVH, head_dim=D, max_bs=bs,
                           req_to_token_pool=r2t, kv_pool=pool)  # fmt: skip
    backend = TritonAttentionBackend(info, **kw)

    def t(xs):
        return torch.tensor(xs, dtype=torch.int64, device="cuda")

    n = sum(ext)
    batch = ForwardBatch(mode=mode, batch_size=bs, input_ids=torch.zeros(n, dtype=torch.int64, device="cuda"),
                         positions=torch.zeros(n, dtype=torch.int64, device="cuda"), req_pool_indices=t(list(range(bs))),
                         seq_lens=t(seq), prefix_lens=t(prefix), extend_lens=t(ext), out_cache_loc=torch.cat(out_loc),
                         req_to_token_pool=r2t, kv_pool=pool, attn_backend=backend, seq_lens_cpu=seq,
                         prefix_lens_cpu=prefix, extend_lens_cpu=ext)  # fmt: skip
    q = torch.randn(n, H * D, dtype=DTYPE, device="cuda")
    k = torch.randn(n, KVH * D, dtype=DTYPE, device="cuda")
    v = torch.randn(n, KVH * D, dtype=DTYPE, device="cuda")
    backend.init_forward_metadata(batch)
    return backend, batch, q, k, v


def graph_time_per_layer_us(backend, batch, q, k, v, num_layers: int, reps: int = 20) -> float:
    layers = [Layer(i) for i in range(num_layers)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for layer in layers:
            backend.forward_decode(q, k, v, layer, batch)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for layer in layers:
            backend.forward_decode(q, k, v, layer, batch)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * num_layers)


def guarded(rows: list[str], label: str, fn) -> None:
    """Run one benchmark point; a failure becomes a row naming it instead of ending the run."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- report and go on to the next point
        rows.append(f"| {label} | FAILED: {type(e).__name__}: {str(e)[:200]} |")
        print(rows[-1], flush=True)
    torch.cuda.empty_cache()


def bench_decode(bw: float, rows: list[str], cases, **kw) -> None:
    for bs, ctx in cases:
        guarded(rows, f"decode bs={bs} ctx={ctx}", lambda bs=bs, ctx=ctx: _decode_point(bw, rows, bs, ctx, **kw))


def _decode_point(bw: float, rows: list[str], bs: int, ctx: int, **kw) -> None:
    kv_layer = bs * ctx * KVH * D * 2 * 2  # K and V, bf16
    num_layers = max(2, min(32, math.ceil(4 * L2_BYTES / kv_layer)))
    backend, batch, q, k, v = build([ctx - 1] * bs, [1] * bs, num_layers, ForwardMode.DECODE, **kw)
    layer0 = Layer(0)
    eager_ms = triton.testing.do_bench(lambda: backend.forward_decode(q, k, v, layer0, batch), warmup=10, rep=50)
    graph_us = graph_time_per_layer_us(backend, batch, q, k, v, num_layers)
    bound_us = kv_layer / (bw * 1e12) * 1e6
    splits = batch.attn_metadata.num_kv_splits[0].item()
    rows.append(
        f"| {bs} | {ctx} | {kv_layer / 2**20:.1f} | {splits} | {eager_ms * 1e3:.1f} | {graph_us:.1f} | "
        f"{bound_us:.1f} | {kv_layer / (graph_us * 1e-6) / 1e12:.2f} | {bound_us / graph_us * 100:.0f}% |"
    )
    print(rows[-1], flush=True)


def causal_flops(prefix: int, ext: int) -> float:
    # QK^T and PV, 2 flops per MAC; each new token sees the prefix plus (on average) half the new tokens
    return 4.0 * H * D * ext * (prefix + (ext + 1) / 2)


def bench_extend(rows: list[str], cases) -> None:
    for bs, prefix, ext in cases:
        point = lambda bs=bs, prefix=prefix, ext=ext: _extend_point(rows, bs, prefix, ext)  # noqa: E731
        guarded(rows, f"extend bs={bs} prefix={prefix} ext={ext}", point)


def _extend_point(rows: list[str], bs: int, prefix: int, ext: int) -> None:
    backend, batch, q, k, v = build([prefix] * bs, [ext] * bs, 1, ForwardMode.EXTEND)
    layer0 = Layer(0)
    ms = triton.testing.do_bench(lambda: backend.forward_extend(q, k, v, layer0, batch), warmup=10, rep=50)
    tflops = bs * causal_flops(prefix, ext) / (ms * 1e-3) / 1e12
    peer = "n/a (SDPA has no paged prefix)"
    if prefix == 0:
        qs = q.view(bs, ext, H, D).transpose(1, 2).contiguous()
        # K/V heads expanded up front so SDPA can pick its flash kernel (the expansion is not timed)
        ks = k.view(bs, ext, KVH, D).transpose(1, 2).repeat_interleave(H // KVH, dim=1).contiguous()
        vs = v.view(bs, ext, KVH, D).transpose(1, 2).repeat_interleave(H // KVH, dim=1).contiguous()
        sdpa_ms = triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True), warmup=10, rep=50
        )
        peer = f"{sdpa_ms * 1e3:.0f} us, {bs * causal_flops(0, ext) / (sdpa_ms * 1e-3) / 1e12:.0f} TFLOP/s"
    rows.append(f"| {bs} | {prefix} | {ext} | {ms * 1e3:.0f} | {tflops:.0f} | {peer} |")
    print(rows[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.26, help="HBM bandwidth limit, TB/s")
    ap.add_argument("--quick", action="store_true", help="fewer points")
    args = ap.parse_args()
    torch.manual_seed(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    head = [
        "# Triton attention kernels",
        "",
        f"- device: {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs;"
        f" torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}",
        f"- commit: {commit or 'unknown'}; date {time.strftime('%Y-%m-%d %H:%M')}",
        f"- shapes: {H} query heads, {KVH} KV heads, head dim {D}, bf16; KV slots scattered (random permutation)",
        "",
        "## Decode (per layer)",
        "",
        f"Bound = KV bytes / {args.bandwidth_tbs} TB/s. Eager = one call after an L2 flush (two launches included);"
        " graph = per-layer time inside a CUDA graph of one call per layer over >= 4x L2 of KV.",
        "",
        "| bs | ctx | KV MiB/layer | splits | eager us | graph us | bound us | achieved TB/s | of bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = list(head)
    print("\n".join(head), flush=True)
    dec = [(1, 1024), (1, 8192), (8, 2048), (32, 4096), (64, 2048), (64, 8192)]
    if args.quick:
        dec = dec[:2]
    bench_decode(args.bandwidth_tbs, rows, dec)
    sweep = ["", "Split-count sweep (max_kv_splits), bs 1 and 8, ctx 8192:", "",
             "| bs | ctx | KV MiB/layer | splits | eager us | graph us | bound us | achieved TB/s | of bound |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    rows += sweep
    print("\n".join(sweep), flush=True)
    for max_splits in (4, 8, 32):
        bench_decode(args.bandwidth_tbs, rows, [(1, 8192), (8, 8192)], max_kv_splits=max_splits)
    ext_head = ["", "## Extend (prefill), causal", "",
                "| bs | prefix | new tokens | triton us | triton TFLOP/s | torch SDPA (contiguous, no prefix) |",
                "|---|---|---|---|---|---|"]  # fmt: skip
    rows += ext_head
    print("\n".join(ext_head), flush=True)
    ext = [(1, 0, 1024), (1, 0, 4096), (1, 0, 8192), (8, 0, 1024), (4, 4096, 1024), (1, 7168, 1024)]
    if args.quick:
        ext = ext[:2]
    bench_extend(rows, ext)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
