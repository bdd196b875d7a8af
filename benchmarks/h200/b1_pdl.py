"""Issue 18 (Llama-3.1-8B batch-1 decode): programmatic dependent launch (PDL) for the batch-1 GEMVs
(`runtime.batch1_gemv_pdl`, GemvConfig.pdl: the plain and the norm-fused GEMV; silu_and_mul and the
triton decode attention's merge kernel signal `launch_dependents` at their start on sm90) and the
greedy sampler's two-launch Triton argmax (radixserve.layers.triton_argmax).

    python3 benchmarks/h200/b1_pdl.py --out $OUT [--parts kernels,runner]

Parts (progress lines on stdout; results in $OUT/b1_pdl.json):
- kernels: per 8B shape, microseconds per call replayed from a CUDA graph that cycles over > 256 MB of
  weight copies (each call streams its weights from HBM), PDL off / on, and whether the outputs are
  bit-equal: qkv and gate_up on the norm-fused GEMV (residual add + RMSNorm + GEMV), o and down on
  the plain GEMV. Then one 8B layer's chain (fused qkv -> o -> fused gate_up -> silu_and_mul -> down,
  8 layers of distinct weights in one graph): us per layer off / on, final outputs bit-equal.
  Then the greedy argmax of one [1, 128256] fp32 row: torch.argmax vs argmax_rows (us, same index), and
  the 8B LM head on cuBLAS vs the Triton GEMV (us: could a GEMV with a fused argmax keep its speed).
- runner: the 8B runner (dummy weights, triton attention, CUDA graphs, fuse_norm on as served):
  graph replay ms per batch-1 decode step and the synchronous step with PDL off / on, and the greedy
  tokens of 48 steps (1024-token prompt) identical off / on (the kernels are bit-equal).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time

import torch

T0 = time.time()
EPS = 1e-5


def log(msg: str) -> None:
    print(f"[b1_pdl {time.time() - T0:6.1f}s] {msg}", flush=True)


def graph_us(fn, n_calls: int, reps: int = 20) -> float:
    """Microseconds per call of `fn()` (which makes n_calls kernel calls), replayed from one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / n_calls


def first(out):
    """y of a GEMV call ((y, stream) for the norm-fused one)."""
    return out[0] if isinstance(out, tuple) else out


def shape_row(name: str, n: int, k: int, fused: bool) -> dict:
    """One 8B shape on its kernel (norm-fused or plain GEMV, auto's tile), PDL off / on."""
    from radixserve.layers.gemv_selection import gemv_config_for_shape
    from radixserve.layers.norm_gemv import rmsnorm_gemv
    from radixserve.layers.triton_gemv import gemv

    bf = torch.bfloat16
    tile = gemv_config_for_shape(n, k)
    copies = max(2, -(-256 * 2**20 // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=bf) * k**-0.5 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=bf)
    r = torch.randn(1, k, device="cuda", dtype=bf)
    g = (1 + 0.1 * torch.randn(k, device="cuda")).to(bf)
    row = {"N": n, "K": k, "tile": tile.__dict__, "kernel": "rmsnorm_gemv" if fused else "gemv"}
    outs = {}
    for pdl in (False, True):
        cfg = dataclasses.replace(tile, pdl=pdl)

        def call(w, c=cfg):
            return rmsnorm_gemv(x, g, EPS, w, None, r, c) if fused else gemv(x, w, config=c)

        outs[pdl] = [call(w) for w in ws[:2]]
        row[f"us_pdl_{'on' if pdl else 'off'}"] = round(graph_us(lambda c=call: [c(w) for w in ws], len(ws)), 2)
    same = all(torch.equal(first(a), first(b)) for a, b in zip(outs[False], outs[True]))
    if fused:  # the residual stream too
        same = same and all(torch.equal(a[1], b[1]) for a, b in zip(outs[False], outs[True]))
    row["bit_equal"] = bool(same)
    log(f"{name:8s} {row['kernel']:12s} {tile.__dict__}: PDL off {row['us_pdl_off']} us, on {row['us_pdl_on']} us, "
        f"bit-equal {same}")
    return row


def kernels_part() -> dict:
    from radixserve.layers.triton_argmax import argmax_rows

    torch.manual_seed(0)
    rows: dict = {}
    shapes = {"qkv": (6144, 4096, True), "o": (4096, 4096, False), "gate_up": (28672, 4096, True),
              "down": (4096, 14336, False)}
    for name, (n, k, fused) in shapes.items():
        rows[name] = shape_row(name, n, k, fused)
        torch.cuda.empty_cache()
    rows["layer_chain"] = layer_chain()
    torch.cuda.empty_cache()
    rows["argmax"] = argmax_timing(argmax_rows)
    torch.cuda.empty_cache()
    rows["lm_head"] = lm_head_timing()
    return rows


def lm_head_timing() -> dict:
    """The 8B LM head [128256, 4096] at batch 1: cuBLAS (F.linear, as served) vs the Triton GEMV on a
    few tiles (us, 2 weight copies = 2.1 GB cycled): whether a GEMV with the argmax in its epilogue
    could keep the head's speed (it would save the logits' argmax, not the head's own time)."""
    import torch.nn.functional as F
    from radixserve.layers.triton_gemv import GemvConfig, gemv

    n, k = 128256, 4096
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(2)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    row = {"cublas_us": round(graph_us(lambda: [F.linear(x, w) for w in ws], 2), 2)}
    for tile in (GemvConfig(8, 512, 4, 3), GemvConfig(16, 256, 4, 4), GemvConfig(16, 512, 8, 3)):
        row[str(tile.__dict__)] = round(graph_us(lambda t=tile: [gemv(x, w, config=t) for w in ws], 2), 2)
    log(f"LM head [128256 x 4096] batch 1: {row} (us; bytes / 4.26 TB/s = {n * k * 2 / 4.26e6:.1f} us)")
    return row


def layer_chain(layers: int = 8) -> dict:
    """One 8B layer's batch-1 kernels in sequence (attention replaced by reading q's first 4096
    values), `layers` layers of distinct weights, PDL off vs on: us per layer, outputs bit-equal."""
    from radixserve.layers import triton_ops
    from radixserve.layers.gemv_selection import gemv_config_for_shape
    from radixserve.layers.norm_gemv import rmsnorm_gemv
    from radixserve.layers.triton_gemv import gemv

    bf = torch.bfloat16
    h, inter = 4096, 14336
    mk = lambda n, k: torch.randn(n, k, device="cuda", dtype=bf) * k**-0.5  # noqa: E731
    weights = [dict(qkv=mk(6144, h), o=mk(h, h), gu=mk(2 * inter, h), down=mk(h, inter),
                    g1=(1 + 0.1 * torch.randn(h, device="cuda")).to(bf), g2=(1 + 0.1 * torch.randn(h, device="cuda")).to(bf))
                for _ in range(layers)]
    x0 = torch.randn(1, h, device="cuda", dtype=bf)

    def run(pdl: bool):
        t = {s: dataclasses.replace(gemv_config_for_shape(*s), pdl=pdl)
             for s in ((6144, h), (h, h), (2 * inter, h), (h, inter))}

        def chain():
            x, res = x0, None
            for w in weights:
                qkv, res = rmsnorm_gemv(x, w["g1"], EPS, w["qkv"], None, res, t[(6144, h)])
                o = gemv(qkv[:, :h], w["o"], config=t[(h, h)])
                gu, res = rmsnorm_gemv(o, w["g2"], EPS, w["gu"], None, res, t[(2 * inter, h)])
                x = gemv(triton_ops.silu_and_mul(gu), w["down"], config=t[(h, inter)])
            return x, res

        us = graph_us(chain, layers)
        return us, chain()

    off_us, off_out = run(False)
    on_us, on_out = run(True)
    same = torch.equal(off_out[0], on_out[0]) and torch.equal(off_out[1], on_out[1])
    finite = bool(torch.isfinite(off_out[0]).all())
    row = {"layers": layers, "us_per_layer_pdl_off": round(off_us, 2), "us_per_layer_pdl_on": round(on_us, 2),
           "bit_equal": bool(same), "finite": finite,
           "per_32_layer_step_saving_ms": round(32 * (off_us - on_us) / 1e3, 3)}
    log(f"layer chain ({layers} layers): PDL off {off_us:.2f} us/layer, on {on_us:.2f} us/layer "
        f"(32 layers: {row['per_32_layer_step_saving_ms']} ms/step saved); outputs bit-equal {same}, finite {finite}")
    return row


def argmax_timing(argmax_rows) -> dict:
    """One Llama-3 row of fp32 logits: torch.argmax vs the two-launch Triton argmax (eager, events
    around 200 calls each, and the index equal on random rows and on ties)."""
    v = 128256
    same = True
    for trial in range(20):
        x = torch.randn(1, v, device="cuda") * 4
        if trial % 4 == 1:  # ties: the first index must win
            x[0, 1000 + trial] = x[0, 90000] = 100.0
        if trial % 4 == 2:
            x[0, 5 * trial] = float("nan")
        same &= torch.equal(torch.argmax(x, dim=-1), argmax_rows(x))
    x = torch.randn(1, v, device="cuda")
    res = {}
    for name, fn in (("torch", lambda: torch.argmax(x, dim=-1)), ("triton", lambda: argmax_rows(x))):
        res[name] = round(graph_us(lambda f=fn: [f() for _ in range(50)], 50), 2)
    row = {"vocab": v, "torch_us": res["torch"], "triton_us": res["triton"], "same_index": bool(same)}
    log(f"greedy argmax [1, {v}] fp32: torch {res['torch']} us, Triton two-launch {res['triton']} us; "
        f"same index on 20 rows (ties, NaN) {same}")
    return row


def runner_part(model: str) -> dict:
    from radixserve.config import Config
    from radixserve.layers.gemv_selection import attach_batch1_gemv, batch1_gemv_pdl_enabled
    from radixserve.model_runner import ModelRunner
    from radixserve.static_batch import run_static_batch

    cfg = Config.build({
        "model": {"path": model, "load_format": "dummy", "context_length": 2048},
        "runtime": {"device": "cuda", "dtype": "bfloat16", "cuda_graph": True, "cuda_graph_max_bs": 8},
        "stack": {"attention": "triton"},
        "scheduler": {"max_running_requests": 8, "max_total_tokens": 8192},
    })
    runner = ModelRunner(cfg, show_progress=False)
    log(f"runner loaded; runtime.batch1_gemv_pdl=auto resolves to {batch1_gemv_pdl_enabled('auto', runner.device)}")
    prompt = [[(7 * i) % 30000 + 100 for i in range(1024)]]
    rows: dict = {}
    for pdl in (False, True, False, True):  # twice each: the run-to-run spread
        key = "pdl_on" if pdl else "pdl_off"
        if runner.graph_runner is not None:
            runner.req_to_token_pool.free(runner.graph_runner.dummy_row)
        runner.graph_runner = None
        gc.collect()
        torch.cuda.empty_cache()
        n = attach_batch1_gemv(runner.model, "auto", runner.device, pdl=pdl, fuse_norm=True)
        runner._init_cuda_graphs()
        run_static_batch(runner, prompt, max_new_tokens=4)
        res = run_static_batch(runner, prompt, max_new_tokens=48)
        graph = runner.graph_runner.graphs[1]
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        row = rows.setdefault(key, {"graph_replay_ms": [], "sync_step_ms": [], "layers": n})
        row["graph_replay_ms"].append(round(start.elapsed_time(end) / 200, 4))
        row["sync_step_ms"].append(round(statistics.median(res.decode_step_s) * 1e3, 3))
        row["tokens"] = res.output_ids[0]
        log(f"[{key}] {n} layers on the GEMV: graph replay {row['graph_replay_ms'][-1]} ms/step, "
            f"sync step {row['sync_step_ms'][-1]} ms")
    same = rows["pdl_off"]["tokens"] == rows["pdl_on"]["tokens"]
    rows["greedy_tokens_identical"] = same
    off, on = min(rows["pdl_off"]["graph_replay_ms"]), min(rows["pdl_on"]["graph_replay_ms"])
    rows["graph_replay_saving_ms"] = round(off - on, 4)
    log(f"graph replay best of 2: PDL off {off} ms, on {on} ms ({off - on:+.4f} ms saved per step); "
        f"greedy tokens (48) identical off/on: {same}")
    for k in ("pdl_off", "pdl_on"):
        rows[k].pop("tokens")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="kernels,runner")
    ap.add_argument("--model", default="benchmarks/model-configs/llama-3.1-8b")
    args = ap.parse_args()
    parts = args.parts.split(",")
    result: dict = {"device": torch.cuda.get_device_name()}
    os.makedirs(args.out, exist_ok=True)  # s25_call1.sh passes a folder per switch setting
    path = os.path.join(args.out, "b1_pdl.json")
    if "kernels" in parts:
        result["kernels"] = kernels_part()
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    if "runner" in parts:
        result["runner"] = runner_part(args.model)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    log("done")


if __name__ == "__main__":
    main()
