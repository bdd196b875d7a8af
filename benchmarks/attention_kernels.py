"""Benchmark the triton attention kernels on a GPU against their limit and a peer.

Decode: time per layer of the split-KV decode kernels (Llama-3.1-8B attention shapes: 32 query heads,
8 KV heads, head dim 128, bf16) over KV scattered through the token-slot pool, against the bound
KV bytes read / HBM bandwidth. Timed inside a CUDA graph that runs one decode call per layer across
enough layers that the KV read is several times the 60 MB L2 (the way a model's decode step uses it);
the default configuration is also timed eagerly (one call after an L2 flush, host launch cost included).
Extend: time and TFLOP/s of the extend kernel (no prefix, and after a cached prefix) against torch SDPA
(`is_causal`, contiguous K/V, its flash kernel) on the same shapes.
Every point's output is checked against a float32 torch reference (max relative error reported), and
`--sweep` repeats each point over alternative tuning configurations.

Usage: python benchmarks/attention_kernels.py [--sweep] [--quick] [--out results.md] [--bandwidth-tbs 4.26]
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
from radixserve_attention_triton.decode_kernel import DecodeConfig
from radixserve_attention_triton.extend_kernel import ExtendConfig

H, KVH, D = 32, 8, 128  # Llama-3.1-8B per-layer attention shapes
G = H // KVH
DTYPE = torch.bfloat16
L2_BYTES = 60 * 2**20
DEVICE = "cuda"  # a module constant so the setup and reference can be dry-run elsewhere

# Backend keyword arguments per decode configuration; "default" is the backend's own defaults
# (since commit e1b4f07's sweep: 128-token tiles, 4 programs per SM, <= 32 splits of >= 128 tokens).
DECODE_CONFIGS: dict[str, dict] = {
    "default": {},
    "p2-s16-min256-n64": {  # the defaults before that sweep
        "programs_per_sm": 2,
        "max_kv_splits": 16,
        "min_split_tokens": 256,
        "decode_config": DecodeConfig(64, 4, 2),
    },
    "p4-s32-min128-n64": {"decode_config": DecodeConfig(64, 4, 2)},
    "p4-s32-min128-n64s3": {"decode_config": DecodeConfig(64, 4, 3)},
    "p8-s64-min64-n64": {
        "programs_per_sm": 8,
        "max_kv_splits": 64,
        "min_split_tokens": 64,
        "decode_config": DecodeConfig(64, 4, 2),
    },
    "p8-s64-min64-n32s3": {
        "programs_per_sm": 8,
        "max_kv_splits": 64,
        "min_split_tokens": 64,
        "decode_config": DecodeConfig(32, 4, 3),
    },
}
# Extend tiles (block_m, block_n, warps, stages); "default" is 64/64/4/3 for head dim 128.
EXTEND_CONFIGS: dict[str, ExtendConfig | None] = {
    "default": None,
    "m128-n64-w8-s2": ExtendConfig(128, 64, 8, 2),  # the default before that sweep
    "m128-n64-w4-s3": ExtendConfig(128, 64, 4, 3),
    "m128-n128-w8-s2": ExtendConfig(128, 128, 8, 2),
    "m128-n128-w8-s3": ExtendConfig(128, 128, 8, 3),
    "m128-n32-w4-s3": ExtendConfig(128, 32, 4, 3),
}


@dataclass
class Layer:
    layer_id: int
    num_heads: int = H
    num_kv_heads: int = KVH
    head_dim: int = D
    scaling: float = D**-0.5


@dataclass
class Setup:
    info: SimpleNamespace
    batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def build(prefix: list[int], ext: list[int], num_layers: int, mode: ForwardMode) -> Setup:
    """Pools with every request's KV scattered over random slots, and the batch for one step."""
    bs = len(prefix)
    seq = [p + e for p, e in zip(prefix, ext)]
    slots = sum(seq)
    pool = KVPool(slots, num_layers, KVH, D, DTYPE, DEVICE)
    for kb, vb in zip(pool.k_buffers, pool.v_buffers):
        kb.normal_()
        vb.normal_()
    r2t = ReqToTokenPool(bs, max(seq), DEVICE)
    perm = torch.randperm(slots, device=DEVICE) + 1
    out_loc, cur = [], 0
    for i in range(bs):
        r2t.req_to_token[i, : seq[i]] = perm[cur : cur + seq[i]]
        out_loc.append(perm[cur + prefix[i] : cur + seq[i]])
        cur += seq[i]
    info = SimpleNamespace(device=DEVICE, dtype=DTYPE, num_heads=H, num_kv_heads=KVH, head_dim=D, max_bs=bs,
                           req_to_token_pool=r2t, kv_pool=pool)  # fmt: skip

    def t(xs):
        return torch.tensor(xs, dtype=torch.int64, device=DEVICE)

    n = sum(ext)
    batch = ForwardBatch(mode=mode, batch_size=bs, input_ids=torch.zeros(n, dtype=torch.int64, device=DEVICE),
                         positions=torch.zeros(n, dtype=torch.int64, device=DEVICE), req_pool_indices=t(list(range(bs))),
                         seq_lens=t(seq), prefix_lens=t(prefix), extend_lens=t(ext), out_cache_loc=torch.cat(out_loc),
                         req_to_token_pool=r2t, kv_pool=pool, attn_backend=None, seq_lens_cpu=seq,
                         prefix_lens_cpu=prefix, extend_lens_cpu=ext)  # fmt: skip
    q = torch.randn(n, H * D, dtype=DTYPE, device=DEVICE)
    k = torch.randn(n, KVH * D, dtype=DTYPE, device=DEVICE)
    v = torch.randn(n, KVH * D, dtype=DTYPE, device=DEVICE)
    return Setup(info, batch, q, k, v)


def backend_for(s: Setup, **kw) -> TritonAttentionBackend:
    backend = TritonAttentionBackend(s.info, **kw)
    s.batch.attn_backend = backend
    backend.init_forward_metadata(s.batch)
    return backend


def reference(s: Setup) -> torch.Tensor:
    """float32 attention of the new tokens over layer 0's pool (new tokens' KV must be stored already)."""
    k_buf, v_buf = s.batch.kv_pool.get_kv(0)
    r2t = s.batch.req_to_token_pool.req_to_token
    outs, start = [], 0
    for i in range(s.batch.batch_size):
        seq, ext = s.batch.seq_lens_cpu[i], s.batch.extend_lens_cpu[i]
        slots = r2t[i, :seq]
        k = k_buf[slots].float().permute(1, 0, 2)  # [KVH, seq, D]
        v = v_buf[slots].float().permute(1, 0, 2)
        q = s.q[start : start + ext].float().view(ext, KVH, G, D).permute(1, 2, 0, 3)  # [KVH, G, ext, D]
        scores = torch.einsum("kgtd,ksd->kgts", q, k) * D**-0.5
        causal = torch.arange(seq, device=DEVICE)[None, :] > torch.arange(seq - ext, seq, device=DEVICE)[:, None]
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        outs.append(torch.einsum("kgts,ksd->tkgd", probs, v).reshape(ext, H * D))
        start += ext
    return torch.cat(outs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out.float() - ref).norm() / ref.norm()).item()


def graph_time_us(fn, reps: int = 20) -> float:
    """Mean time of `fn`'s GPU work, captured once in a CUDA graph and replayed (no host overhead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def graph_time_per_layer_us(backend, s: Setup, num_layers: int) -> float:
    """Per-layer decode time in a graph running one call per layer (so the KV read is not L2-resident)."""
    layers = [Layer(i) for i in range(num_layers)]

    def step():
        for layer in layers:
            backend.forward_decode(s.q, s.k, s.v, layer, s.batch)

    return graph_time_us(step) / num_layers


class Report(list):
    """Rows of the markdown report; each added row is printed and the file rewritten at once,
    so a run cut short by a time limit still leaves what it measured."""

    def __init__(self, path: str | None) -> None:
        super().__init__()
        self.path = path

    def append(self, row: str) -> None:
        super().append(row)
        print(row, flush=True)
        if self.path:
            with open(self.path, "w") as f:
                f.write("\n".join(self) + "\n")

    def extend(self, new_rows) -> None:
        for row in new_rows:
            self.append(row)


def guarded(rows: list[str], label: str, fn) -> None:
    """Run one benchmark point; a failure becomes a row naming it instead of ending the run."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- report and go on to the next point
        rows.append(f"| {label} | FAILED: {type(e).__name__}: {str(e)[:300]} |")
    torch.cuda.empty_cache()


def decode_point(bw: float, rows: list[str], bs: int, ctx: int, configs: dict[str, dict]) -> None:
    kv_layer = bs * ctx * KVH * D * 2 * 2  # K and V, bf16
    num_layers = max(2, min(32, math.ceil(4 * L2_BYTES / kv_layer)))
    s = build([ctx - 1] * bs, [1] * bs, num_layers, ForwardMode.DECODE)
    bound_us = kv_layer / (bw * 1e12) * 1e6
    ref = None
    for name, kw in configs.items():

        def point(name=name, kw=kw):
            nonlocal ref
            backend = backend_for(s, **kw)
            out = backend.forward_decode(s.q, s.k, s.v, Layer(0), s.batch)
            ref = reference(s) if ref is None else ref
            err = rel_err(out, ref)
            eager = "-"
            if name == "default":
                fn = lambda: backend.forward_decode(s.q, s.k, s.v, Layer(0), s.batch)  # noqa: E731
                eager = f"{triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3:.1f}"
            graph_us = graph_time_per_layer_us(backend, s, num_layers)
            splits = s.batch.attn_metadata.num_kv_splits[0].item()
            rows.append(
                f"| {name} | {bs} | {ctx} | {kv_layer / 2**20:.1f} | {splits} | {eager} | {graph_us:.1f} | "
                f"{bound_us:.1f} | {kv_layer / (graph_us * 1e-6) / 1e12:.2f} | {bound_us / graph_us * 100:.0f}% |"
                f" {err:.1e} |"
            )

        guarded(rows, f"{name} decode bs={bs} ctx={ctx}", point)


def causal_flops(prefix: int, ext: int) -> float:
    # QK^T and PV, 2 flops per MAC; each new token sees the prefix plus (on average) half the new tokens
    return 4.0 * H * D * ext * (prefix + (ext + 1) / 2)


def extend_point(rows: list[str], bs: int, prefix: int, ext: int, configs: dict[str, ExtendConfig | None]) -> None:
    s = build([prefix] * bs, [ext] * bs, 1, ForwardMode.EXTEND)
    flops = bs * causal_flops(prefix, ext)
    peer = "n/a (no paged prefix)"
    if prefix == 0:
        qs = s.q.view(bs, ext, H, D).transpose(1, 2).contiguous()
        # K/V heads expanded up front so SDPA can pick its flash kernel (the expansion is not timed)
        ks = s.k.view(bs, ext, KVH, D).transpose(1, 2).repeat_interleave(G, dim=1).contiguous()
        vs = s.v.view(bs, ext, KVH, D).transpose(1, 2).repeat_interleave(G, dim=1).contiguous()
        fn = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)  # noqa: E731
        sdpa_ms = triton.testing.do_bench(fn, warmup=10, rep=50)
        peer = f"{sdpa_ms * 1e3:.0f} us, {flops / (sdpa_ms * 1e-3) / 1e12:.0f} TFLOP/s"
        del qs, ks, vs
    ref = None
    # the kernel's own configurations (prefill_sdpa off), then the backend's fresh-prompt SDPA path
    variants = {name: {"extend_config": cfg, "prefill_sdpa": False} for name, cfg in configs.items()}
    if prefix == 0:
        variants["backend SDPA path"] = {"prefill_sdpa": True}
    for name, kw in variants.items():

        def point(name=name, kw=kw):
            nonlocal ref
            backend = backend_for(s, **kw)
            out = backend.forward_extend(s.q, s.k, s.v, Layer(0), s.batch)
            ref = reference(s) if ref is None else ref
            err = rel_err(out, ref)
            fn = lambda: backend.forward_extend(s.q, s.k, s.v, Layer(0), s.batch)  # noqa: E731
            ms = triton.testing.do_bench(fn, warmup=10, rep=50)
            graph_us = graph_time_us(fn)
            rows.append(
                f"| {name} | {bs} | {prefix} | {ext} | {ms * 1e3:.0f} | {graph_us:.0f} | "
                f"{flops / (graph_us * 1e-6) / 1e12:.0f} | {err:.1e} | {peer} |"
            )

        guarded(rows, f"{name} extend bs={bs} prefix={prefix} ext={ext}", point)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.26, help="HBM bandwidth limit, TB/s")
    ap.add_argument("--quick", action="store_true", help="fewer points")
    ap.add_argument("--sweep", action="store_true", help="also time the alternative tuning configurations")
    args = ap.parse_args()
    torch.manual_seed(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dec_cfgs = DECODE_CONFIGS if args.sweep else {"default": {}}
    ext_cfgs = EXTEND_CONFIGS if args.sweep else {"default": None}
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
        f"Bound = KV bytes / {args.bandwidth_tbs} TB/s. Graph = per-layer time inside a CUDA graph of one call"
        " per layer over >= 2x L2 of KV (store of the new token's KV included). Eager = one call after an L2"
        " flush, host launch cost included. err = relative L2 error vs a float32 reference.",
        "",
        "| config | bs | ctx | KV MiB/layer | splits | eager us | graph us | bound us | achieved TB/s | of bound | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = Report(args.out)
    rows.extend(head)
    dec = [(1, 1024), (1, 8192), (8, 2048), (8, 8192), (32, 4096), (64, 8192)]
    for bs, ctx in dec[:2] if args.quick else dec:
        decode_point(args.bandwidth_tbs, rows, bs, ctx, dec_cfgs)
    ext_head = [
        "",
        "## Extend (prefill), causal",
        "",
        "Eager = do_bench of one forward_extend (host launch cost included); graph = the same call replayed"
        " in a CUDA graph (GPU time only; TFLOP/s from it). SDPA: do_bench, eager.",
        "",
        "| config | bs | prefix | new tokens | eager us | graph us | TFLOP/s | err | torch SDPA (contiguous, no prefix) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows.extend(ext_head)
    ext = [(1, 0, 2048), (1, 0, 8192), (8, 0, 1024), (1, 7168, 1024), (4, 4096, 1024)]
    for bs, prefix, n in ext[:2] if args.quick else ext:
        extend_point(rows, bs, prefix, n, ext_cfgs)


if __name__ == "__main__":
    main()
