"""MLA (latent attention) kernels on the H200: mla_triton against a decompressed torch path (issue 17).

(a) parity, CUDA bf16: mla_triton and the decompressed path (torch_native's forward_latent_* when that
    backend implements latent attention, else this script's decompressed torch code) against a float64
    decompressed reference, on twin pools, for batch 1/8 x prefix 0/300: a chunked extend (two chunks),
    a decode step and a tree-mask verify.
(b) decode speed at DeepSeek-V2-Lite's attention shape (16 heads, kv_lora_rank 512, rope 64, nope 128,
    v 128, bf16): median of many CUDA-event timings of one forward_latent_decode (rows stored, weights
    absorbed, kernels, output expanded) at batch 1/64 x context 1k/8k; the bytes each path must move
    per step and the implied bandwidth against the H200's 4.8 TB/s.

Builds pools and ForwardBatch objects directly (no server). Every case is recorded, a failing one with
its error. Writes $OUT/mla_kernels.json and $OUT/mla_kernels.md. Run from the repo root:
    source benchmarks/h200/setup.sh && python3 benchmarks/h200/mla_kernels.py
(without setup.sh it falls back to the source tree on sys.path).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for sub in ("core", "plugins/attention/mla_triton", "plugins/attention/triton", "plugins/attention/torch_native"):
    if str(ROOT / sub) not in sys.path:
        sys.path.append(str(ROOT / sub))  # only used when the distributions are not installed

import torch  # noqa: E402
from radixserve.interfaces.attention import AttentionRunnerInfo  # noqa: E402
from radixserve.interfaces.latent_attention import LatentAttentionDims  # noqa: E402
from radixserve.layers.latent_attention import RadixLatentAttention  # noqa: E402
from radixserve.memory import LatentKVPool, ReqToTokenPool  # noqa: E402
from radixserve.state import ForwardBatch, ForwardMode, tree_block  # noqa: E402

# MLA_KERNELS_SMOKE=1: a CPU run of every code path under Triton's interpreter at tiny shapes (a check
# of this script, not a measurement); must be set before the kernels are imported
SMOKE = os.environ.get("MLA_KERNELS_SMOKE") == "1"
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
DEV, DT = ("cpu", torch.float32) if SMOKE else ("cuda", torch.bfloat16)
HEADS, LORA, ROPE, NOPE, V = (4, 64, 16, 32, 32) if SMOKE else (16, 512, 64, 128, 128)  # DeepSeek-V2-Lite
CHUNK = 6 if SMOKE else 48
from radixserve_attention_mla_triton.backend import MlaTritonBackend  # noqa: E402

PEAK_BPS = 4.8e12
OUT = Path(os.environ.get("OUT", "."))


class ScriptDecompressed:
    """Decompressed latent attention in torch, one request at a time (used when torch_native has no
    latent path): per head keys [c @ W_UK.T, k_pe] and values c @ W_UV.T, then SDPA."""

    name = "script_decompressed"

    def init_forward_metadata(self, batch):
        batch.attn_metadata = None

    def forward_latent(self, q_nope, q_pe, c_kv, k_pe, layer, batch):
        batch.kv_pool.set_latent(layer.layer_id, batch.out_cache_loc, c_kv, k_pe)
        buf = batch.kv_pool.get_latent(layer.layer_id)
        table = batch.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices.tolist()
        out, start = [], 0
        decode = batch.mode is ForwardMode.DECODE
        mask_at = 0
        for row, seq, ext in zip(rows, batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True):
            lat = buf[table[row, :seq]]
            c, pe = lat[:, :LORA], lat[:, LORA:]
            k = torch.cat([torch.einsum("sl,hnl->hsn", c, layer.w_uk), pe[None].expand(HEADS, -1, -1)], -1)
            v = torch.einsum("sl,hvl->hsv", c, layer.w_uv)
            q = torch.cat([q_nope[start:start + ext], q_pe[start:start + ext]], -1).transpose(0, 1)
            if decode:
                mask = None
            else:
                mask = torch.ones(ext, seq, dtype=torch.bool, device=q.device).tril(seq - ext)
                if batch.tree_mask is not None:
                    mask[:, seq - ext:] = batch.tree_mask[mask_at:mask_at + ext * ext].view(ext, ext)
                    mask_at += ext * ext
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling)
            out.append(o.transpose(0, 1).reshape(ext, -1))
            start += ext
        return torch.cat(out)


def decompressed_backend(info):
    """torch_native when it implements latent attention (mla-core), else the script's own path."""
    try:
        from radixserve_attention_torch_native.backend import TorchNativeBackend

        if getattr(TorchNativeBackend, "supports_latent_attention", False):
            try:
                return TorchNativeBackend(info)
            except TypeError:
                return TorchNativeBackend()
    except Exception:  # noqa: BLE001 - recorded as the fallback's name
        pass
    return ScriptDecompressed()


class World:
    """A pool with random latent rows, a request table and the layer; batches over it."""

    def __init__(self, num_slots: int, bs: int, max_ctx: int, seed: int = 0):
        torch.manual_seed(seed)
        self.pool = LatentKVPool(num_slots, 1, LORA, ROPE, DT, DEV)
        self.table = ReqToTokenPool(bs, max_ctx, DEV)
        self.free = (torch.randperm(num_slots) + 1).tolist()
        self.slots = [[] for _ in range(bs)]
        kv_b = torch.nn.Linear(LORA, HEADS * (NOPE + V), bias=False).to(DEV, DT)
        torch.nn.init.normal_(kv_b.weight, std=LORA ** -0.5)
        self.layer = RadixLatentAttention(0, HEADS, LORA, NOPE, ROPE, V, (NOPE + ROPE) ** -0.5, kv_b)
        self.kv_b = kv_b
        self.info = AttentionRunnerInfo(
            device=torch.device(DEV), dtype=DT, num_layers=1, num_heads=HEADS, num_kv_heads=1, head_dim=LORA + ROPE,
            req_to_token_pool=self.table, kv_pool=self.pool, max_bs=bs, context_len=max_ctx,
            latent=LatentAttentionDims(1, HEADS, LORA, NOPE, ROPE, V),
        )

    def fill_prefix(self, i: int, n: int) -> None:
        loc = self._take(i, n)
        if n:
            rows = torch.randn(n, LORA + ROPE, device=DEV).to(DT)
            self.pool.set_latent(0, loc, rows[:, :LORA], rows[:, LORA:])

    def _take(self, i: int, n: int) -> torch.Tensor:
        got, self.free = self.free[:n], self.free[n:]
        self.table.write(i, len(self.slots[i]), torch.tensor(got, dtype=torch.int64))
        self.slots[i] += got
        return torch.tensor(got, dtype=torch.int64, device=DEV)

    def batch(self, mode, ext: list[int], backend, trees=None) -> ForwardBatch:
        prefix = [len(s) for s in self.slots]
        loc = torch.cat([self._take(i, n) for i, n in enumerate(ext)])
        seq = [p + e for p, e in zip(prefix, ext, strict=True)]
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEV)  # noqa: E731
        blocks = [tree_block(p) for p in trees] if trees else None
        return ForwardBatch(
            mode=mode, batch_size=len(ext), input_ids=torch.zeros(sum(ext), dtype=torch.int64, device=DEV),
            positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq, strict=True)]).to(DEV),
            req_pool_indices=t(list(range(len(ext)))), seq_lens=t(seq), prefix_lens=t(prefix), extend_lens=t(ext),
            out_cache_loc=loc, req_to_token_pool=self.table, kv_pool=self.pool, attn_backend=backend,
            seq_lens_cpu=seq, prefix_lens_cpu=prefix, extend_lens_cpu=list(ext),
            tree_mask=None if blocks is None else torch.tensor(
                [x for b in blocks for r in b for x in r], dtype=torch.bool, device=DEV),
            tree_mask_cpu=blocks,
        )


def reference64(world: World, batch: ForwardBatch, q_nope, q_pe) -> torch.Tensor:
    """Float64 decompressed attention over the pool rows (the new rows already stored)."""
    buf = world.pool.get_latent(0).double()
    w_uk, w_uv = world.layer.w_uk.double(), world.layer.w_uv.double()
    out, start, mask_at = [], 0, 0
    for row, seq, ext in zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True):
        lat = buf[world.table.req_to_token[row, :seq]]
        c, pe = lat[:, :LORA], lat[:, LORA:]
        s = (torch.einsum("thn,hnl,sl->hts", q_nope[start:start + ext].double(), w_uk, c)
             + torch.einsum("thr,sr->hts", q_pe[start:start + ext].double(), pe)) * world.layer.scaling
        hidden = torch.ones(ext, seq, dtype=torch.bool, device=DEV).tril(seq - ext).logical_not()
        if batch.tree_mask is not None:
            hidden[:, seq - ext:] = ~batch.tree_mask[mask_at:mask_at + ext * ext].view(ext, ext)
            mask_at += ext * ext
        p = s.masked_fill(hidden, float("-inf")).softmax(-1)
        out.append(torch.einsum("hts,sl,hvl->thv", p, c, w_uv).reshape(ext, -1))
        start += ext
    return torch.cat(out)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def parity_case(bs: int, prefix: int) -> dict:
    """Twin worlds (same seed): mla_triton on one, the decompressed path on the other; steps: a
    two-chunk extend of 96 tokens per request, one decode, one tree verify."""
    worlds = [World(bs * (prefix + 200) + 8, bs, prefix + 200, seed=1) for _ in range(2)]
    backends = [MlaTritonBackend(worlds[0].info), decompressed_backend(worlds[1].info)]
    for w in worlds:
        w.kv_b.weight.data.copy_(worlds[0].kv_b.weight.data)
        for i in range(bs):
            torch.manual_seed(100 + i)
            w.fill_prefix(i, prefix)
    trees = [[-1, 0, 0, 1, 2, 2, 3, 0], [-1, 0, 1, 2], [-1]] * 3
    steps = [("extend chunk 1", ForwardMode.EXTEND, [CHUNK] * bs, None),
             ("extend chunk 2", ForwardMode.EXTEND, [CHUNK] * bs, None),
             ("decode", ForwardMode.DECODE, [1] * bs, None),
             ("tree verify", ForwardMode.EXTEND, [len(t) for t in trees[:bs]], trees[:bs])]
    result = {"bs": bs, "prefix": prefix, "decompressed": backends[1].name, "steps": []}
    gen = torch.Generator(device=DEV).manual_seed(7)
    for what, mode, ext, tr in steps:
        n = sum(ext)
        q_nope = torch.randn(n, HEADS, NOPE, device=DEV, generator=gen).to(DT)
        q_pe = torch.randn(n, HEADS, ROPE, device=DEV, generator=gen).to(DT)
        c = torch.randn(n, LORA, device=DEV, generator=gen).to(DT)
        pe = torch.randn(n, ROPE, device=DEV, generator=gen).to(DT)
        outs, batches = [], []
        for w, b in zip(worlds, backends, strict=True):
            batches.append(w.batch(mode, ext, b, tr))
            b.init_forward_metadata(batches[-1])
            outs.append(b.forward_latent(q_nope, q_pe, c, pe, w.layer, batches[-1]))
        ref = reference64(worlds[0], batches[0], q_nope, q_pe)
        pools_equal = torch.equal(worlds[0].pool.get_latent(0), worlds[1].pool.get_latent(0))
        step = {"step": what, "mla_triton_vs_fp64": rel(outs[0], ref), "decompressed_vs_fp64": rel(outs[1], ref),
                "mla_triton_vs_decompressed": rel(outs[0], outs[1]), "pools_equal": pools_equal}
        step["ok"] = bool(step["mla_triton_vs_fp64"] < 3e-2 and pools_equal and torch.isfinite(outs[0]).all())
        result["steps"].append(step)
    result["ok"] = all(s["ok"] for s in result["steps"])
    return result


def time_ms(fn, warmup: int = 3, iters: int = 30) -> float:
    if SMOKE:  # no CUDA events on the CPU: one timed call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def speed_case(bs: int, ctx: int) -> dict:
    world = World(bs * ctx + 8, bs, ctx + 1, seed=2)
    for i in range(bs):
        world.fill_prefix(i, ctx - 1)
    triton_b = MlaTritonBackend(world.info)
    dec_b = decompressed_backend(world.info)
    q_nope = torch.randn(bs, HEADS, NOPE, device=DEV).to(DT)
    q_pe = torch.randn(bs, HEADS, ROPE, device=DEV).to(DT)
    c = torch.randn(bs, LORA, device=DEV).to(DT)
    pe = torch.randn(bs, ROPE, device=DEV).to(DT)
    batch = world.batch(ForwardMode.DECODE, [1] * bs, triton_b)
    res = {"bs": bs, "context": ctx, "decompressed": dec_b.name}
    row_bytes = (LORA + ROPE) * 2
    weight_bytes = HEADS * (NOPE + V) * LORA * 2
    latent_bytes = bs * ctx * row_bytes
    # mla_triton: each latent row once (one head block of 16), the absorb/expand weights, q/o (small)
    res["mla_triton_bytes"] = latent_bytes + weight_bytes
    # decompressed: the latent rows, then per-head K (nope+rope) and V written and read back
    res["decompressed_bytes"] = latent_bytes + weight_bytes + 2 * bs * ctx * HEADS * (NOPE + ROPE + V) * 2
    for name, b in (("mla_triton", triton_b), ("decompressed", dec_b)):
        try:
            batch.attn_backend = b
            b.init_forward_metadata(batch)
            ms = time_ms(lambda b=b: b.forward_latent(q_nope, q_pe, c, pe, world.layer, batch),
                         iters=30 if name == "mla_triton" else 10)
            res[f"{name}_ms"] = ms
            res[f"{name}_TBps"] = res[f"{name}_bytes"] / (ms / 1e3) / 1e12
            res[f"{name}_of_peak"] = res[f"{name}_TBps"] * 1e12 / PEAK_BPS
        except Exception as e:  # noqa: BLE001 - recorded, the other path still runs
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"
    if "mla_triton_ms" in res and "decompressed_ms" in res:
        res["speedup"] = res["decompressed_ms"] / res["mla_triton_ms"]
    if not SMOKE:  # as served: the decode step captured in a CUDA graph (no Python launch overhead)
        try:
            batch.attn_backend = triton_b
            triton_b.init_graph_state(bs)
            triton_b.init_forward_metadata_capture(batch)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                triton_b.forward_latent(q_nope, q_pe, c, pe, world.layer, batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                triton_b.forward_latent(q_nope, q_pe, c, pe, world.layer, batch)
            triton_b.init_forward_metadata_replay(batch, bs)
            res["mla_triton_graph_ms"] = time_ms(graph.replay, iters=50)
            res["mla_triton_graph_of_peak"] = res["mla_triton_bytes"] / (res["mla_triton_graph_ms"] / 1e3) / PEAK_BPS
            if "decompressed_ms" in res:
                res["speedup_graph"] = res["decompressed_ms"] / res["mla_triton_graph_ms"]
        except Exception as e:  # noqa: BLE001
            res["mla_triton_graph_error"] = f"{type(e).__name__}: {e}"
    # the kernels alone (no absorb/expand bmm): what the split-KV kernel reaches on the latent rows
    try:
        batch.attn_backend = triton_b
        triton_b.init_forward_metadata(batch)
        from radixserve_attention_mla_triton.decode_kernel import latent_decode_attention

        q_lat = torch.randn(HEADS, bs, LORA, device=DEV).to(DT)
        o_lat = torch.empty_like(q_lat)
        meta = batch.attn_metadata
        buf = world.pool.get_latent(0)

        def kernel():
            latent_decode_attention(q_lat.transpose(0, 1), q_pe, o_lat.transpose(0, 1), buf, LORA,
                                    world.table.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                    meta.num_kv_splits, meta.mid_o, meta.mid_lse, world.layer.scaling,
                                    triton_b.decode_config)

        ms = time_ms(kernel, iters=50)
        res["kernel_only_ms"] = ms
        res["kernel_only_of_peak"] = latent_bytes / (ms / 1e3) / PEAK_BPS
        res["num_kv_splits_max"] = int(meta.num_kv_splits.max())
    except Exception as e:  # noqa: BLE001
        res["kernel_only_error"] = f"{type(e).__name__}: {e}"
    torch.cuda.empty_cache()
    return res


def run_case(fn, *args) -> dict:
    t0 = time.time()
    try:
        out = fn(*args)
    except Exception as e:  # noqa: BLE001 - one failing case must not stop the others
        out = {"args": list(args), "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        out["ok"] = False
    out["seconds"] = round(time.time() - t0, 2)
    print(json.dumps({k: v for k, v in out.items() if k != "trace"}, default=str), flush=True)
    return out


def markdown(results: dict) -> str:
    lines = ["# MLA kernels on the H200", "", f"device: {results['device']}", "", f"## Parity ({str(DT)[6:]}, relative error)", "",
             "| bs | prefix | step | mla_triton vs fp64 | decompressed vs fp64 | mla_triton vs decompressed | ok |",
             "|---|---|---|---|---|---|---|"]
    for r in results["parity"]:
        if "steps" not in r:
            lines.append(f"| {r.get('args')} | | error | {r.get('error')} | | | no |")
            continue
        for s in r["steps"]:
            lines.append(f"| {r['bs']} | {r['prefix']} | {s['step']} | {s['mla_triton_vs_fp64']:.2e} | "
                         f"{s['decompressed_vs_fp64']:.2e} | {s['mla_triton_vs_decompressed']:.2e} | {s['ok']} |")
    lines += ["", f"## Decode step ({HEADS} heads, kv_lora_rank {LORA}, rope {ROPE}, {str(DT)[6:]}; median ms)", "",
              "| bs | context | mla_triton ms | decompressed ms | speedup | mla_triton TB/s (of 4.8) | "
              "kernel-only ms (of peak) | graph ms (of peak), speedup | decompressed TB/s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results["speed"]:
        def f(key, fmt="{:.3f}", r=r):
            return fmt.format(r[key]) if key in r else r.get(key.rsplit("_", 1)[0] + "_error", "-")
        lines.append(f"| {r.get('bs')} | {r.get('context')} | {f('mla_triton_ms')} | {f('decompressed_ms')} | "
                     f"{f('speedup', '{:.1f}x')} | {f('mla_triton_TBps', '{:.2f}')} ({f('mla_triton_of_peak', '{:.0%}')}) | "
                     f"{f('kernel_only_ms')} ({f('kernel_only_of_peak', '{:.0%}')}) | "
                     f"{f('mla_triton_graph_ms')} ({f('mla_triton_graph_of_peak', '{:.0%}')}), {f('speedup_graph', '{:.1f}x')} | "
                     f"{f('decompressed_TBps', '{:.2f}')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    device = "cpu (smoke run, interpreter)" if SMOKE else torch.cuda.get_device_name(0)
    results = {"device": device, "parity": [], "speed": []}
    for bs in (1, 8):
        for prefix in ((0, 5) if SMOKE else (0, 300)):
            results["parity"].append(run_case(parity_case, bs, prefix))
    for bs in ((1, 2) if SMOKE else (1, 64)):
        for ctx in ((32, 64) if SMOKE else (1024, 8192)):
            results["speed"].append(run_case(speed_case, bs, ctx))
    target = [r for r in results["speed"] if r.get("bs") == 64 and r.get("context") == 8192]
    results["target_3x_at_bs64_8k"] = bool(target and target[0].get("speedup", 0) >= 3)  # eager vs eager
    (OUT / "mla_kernels.json").write_text(json.dumps(results, indent=1, default=str))
    (OUT / "mla_kernels.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
