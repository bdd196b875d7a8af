"""Where a constrained batch-64 decode step loses time on the H200 (issue 15): the real Scheduler
(overlap on) over the real ModelRunner (Llama-3.1-8B shape, dummy bf16 weights, CUDA graphs, triton
attention) in this process, no server; every request constrained by structured_output_gpu.py's
schema (synthetic 128,256-token tokenizer) or none.

For each kind: ms per decode step over --steps steps at full batch (64 rows), then a torch.profiler
window of --profile-steps steps: (1) the host calls that can block on the device (cudaStreamSynchronize,
cudaEventSynchronize, cudaDeviceSynchronize, cudaMemcpyAsync, cudaHostAlloc...) with count, total and
max host ms, and the Python stack of the slowest ones; (2) the device's idle time between kernels per
step (the GPU waiting for the host) and the largest gaps. If the constrained step's extra time is
device idle time behind a blocking call, the stack names it.

(3) From the exported chrome trace (Python frames recorded): per step host ms of the scheduler's
phases on its thread (lookahead, launch, ready, the wait for the mask fill, ...), how long a mask
fill waited between its submission and its start in the mask thread, and the innermost Python
frames of the scheduler's thread at the start of the largest device gaps and around the slowest
blocking calls (torch's FunctionEvent stacks came back empty for runtime calls in session 8).

    python benchmarks/h200/grammar_timeline.py --out $OUT          # ~2-3 min; writes grammar_timeline.json
    python benchmarks/h200/grammar_timeline.py --analyze grammar_timeline_c.json --profile-steps 6   # a trace again
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from full_vocab_tokenizer import make_tokenizer  # noqa: E402
from structured_output_gpu import THROUGHPUT_SCHEMA, VOCAB  # noqa: E402

BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
            "cudaMemcpy", "cudaHostAlloc", "cudaFreeHost", "cudaMalloc", "cudaFree", "cudaStreamWaitEvent")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(model: str, tok_dir: Path, batch: int, device: str = "cuda"):
    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.plugins.registry import Registry
    from radixserve.scheduler import Scheduler
    from transformers import AutoTokenizer

    cfg = Config.build({
        "model": {"path": model, "load_format": "dummy", "context_length": 2048, "tokenizer": str(tok_dir)},
        "runtime": {"device": device, "dtype": "bfloat16" if device == "cuda" else "float32",
                    "cuda_graph": device == "cuda", "cuda_graph_max_bs": batch, "overlap": True},
        "stack": {"attention": "triton"} if device == "cuda" else {},
        "scheduler": {"max_running_requests": batch + 8, "max_total_tokens": batch * 1024},
    })
    runner = ModelRunner(cfg, show_progress=False)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    s = Scheduler.from_config(cfg, runner, Registry.discover(), tok)
    print(f"scheduler: overlap={s.overlap}, fill_beside_processing={getattr(s, 'fill_beside_processing', None)}",
          flush=True)
    return s


def add_batch(s, batch: int, constrained: bool, max_new: int, tag: str, input_len: int) -> None:
    from radixserve.runtime.messages import GenerateRequest
    from radixserve.state import SamplingParams

    rng = random.Random(0)
    for i in range(batch):
        sp = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True,
                            json_schema=json.dumps(THROUGHPUT_SCHEMA) if constrained else None)
        s.add_request(GenerateRequest(rid=f"{tag}{i}", input_ids=[rng.randrange(300, min(30000, VOCAB)) % s.runner.vocab_size
                                                                  for _ in range(input_len)],
                                      sampling_params=sp))


def gaps_per_step(prof, steps: int) -> dict:
    """Device idle time between kernels/copies over the profiled window."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return {}
    idle, big, end = 0.0, [], spans[0][1]
    for a, b in spans[1:]:
        if a > end:
            gap = (a - end) / 1000.0  # us -> ms
            idle += gap
            big.append(round(gap, 3))
        end = max(end, b)
    busy_window = (end - spans[0][0]) / 1000.0
    return {"window_ms": round(busy_window, 3), "device_idle_ms_per_step": round(idle / steps, 3),
            "largest_gaps_ms": sorted(big, reverse=True)[:12]}


def blocking_calls(prof) -> list[dict]:
    rows = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not any(e.name.startswith(b) for b in BLOCKING):
            continue
        dur = (e.time_range.end - e.time_range.start) / 1000.0
        r = rows.setdefault(e.name, {"call": e.name, "count": 0, "total_ms": 0.0, "max_ms": 0.0, "slowest_stack": []})
        r["count"] += 1
        r["total_ms"] += dur
        if dur > r["max_ms"]:
            r["max_ms"] = dur
            r["slowest_stack"] = [f for f in (e.stack or []) if "site-packages/torch" not in f][:8]
    out = sorted(rows.values(), key=lambda r: -r["total_ms"])
    for r in out:
        r["total_ms"], r["max_ms"] = round(r["total_ms"], 3), round(r["max_ms"], 3)
    return out


# (label, file, function) of the scheduler-thread phases reported per step (the fill: any thread)
PHASES = (
    ("step", "scheduler.py", "step"),
    ("lookahead_decode", "scheduler.py", "_lookahead_decode"),
    ("to_scheduled_batch", "scheduler.py", "_to_scheduled_batch"),
    ("launch_batch", "model_runner.py", "launch_batch"),
    ("sampling_batch", "batch.py", "from_reqs"),
    ("prepare", "model_runner.py", "prepare"),
    ("graph_run", "cuda_graph_runner.py", "run"),
    ("bitmask_ready", "scheduler.py", "ready"),
    ("process_prev", "scheduler.py", "_process"),
    ("accept_tokens", "scheduler.py", "_accept_grammar_tokens"),
    ("wait_for_fill", "_base.py", "wait"),
    ("fill_bitmasks (mask thread)", "backend.py", "fill_bitmasks"),
    ("early accept+fill (mask thread)", "scheduler.py", "accept_and_fill"),
    ("apply_bitmask", "backend.py", "apply_bitmask_inplace"),
    ("sample", "sampler.py", "sample"),
    ("copy_to_host", "model_runner.py", "_copy_to_host"),
)


def _frame(name: str) -> tuple[str, str]:
    """('scheduler.py', 'ready') of a trace frame name like '.../scheduler.py(972): ready'."""
    where, _, func = name.rpartition(": ")
    return where.split("(")[0].rsplit("/", 1)[-1], func


def trace_context(trace: Path, steps: int, gaps: int = 8) -> dict:
    """Host phases per step, mask-fill start delays and the scheduler thread's Python frames at the
    largest device gaps and the slowest blocking calls, read from an exported chrome trace."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    py = [e for e in events if e.get("cat") == "python_function"]
    steps_ev = [e for e in py if _frame(e["name"]) == ("scheduler.py", "step")]
    if not steps_ev:
        return {"error": "no Scheduler.step frames in the trace (was it recorded with_stack=True?)"}
    main = steps_ev[0]["tid"]
    main_py = sorted((e for e in py if e["tid"] == main), key=lambda e: e["ts"])

    def frames_at(ts: float, depth: int = 4) -> list[str]:
        cover = [e for e in main_py if e["ts"] <= ts < e["ts"] + e["dur"]]
        return [e["name"].rsplit("/", 1)[-1][:70] for e in cover][-depth:]

    phases = {}
    for label, file, func in PHASES:
        ds = [e["dur"] for e in py if _frame(e["name"]) == (file, func) and (e["tid"] == main or "fill" in label)]
        if ds:
            phases[label] = round(sum(ds) / 1000 / steps, 3)
    # a fill is submitted from scheduler._started (before it: from start_fill / _token_bitmask)
    submits = [e["ts"] for e in main_py if _frame(e["name"]) == ("scheduler.py", "_started")] or [
        e["ts"] for e in main_py if _frame(e["name"]) == ("scheduler.py", "start_fill")]
    starts = sorted(e["ts"] for e in py if e["tid"] != main and _frame(e["name"])[1] == "fill_bitmasks")
    delays = []
    for t in sorted(set(submits)):
        later = [x for x in starts if x >= t]
        if later:
            delays.append(round((later[0] - t) / 1000, 3))
    dev = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    found, end = [], dev[0][1] if dev else 0
    for a, b in dev[1:]:
        if a > end:
            found.append((a - end, end))
        end = max(end, b)
    at_gaps = [{"gap_ms": round(g / 1000, 3), "host_at_start": frames_at(t + 1)}
               for g, t in sorted(found, reverse=True)[:gaps]]
    slow = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and any(e["name"].startswith(b) for b in BLOCKING):
            if e["dur"] > slow.get(e["name"], {"dur": -1})["dur"]:
                slow[e["name"]] = e
    slowest = [{"call": n, "ms": round(e["dur"] / 1000, 3), "host_frames": frames_at(e["ts"])}
               for n, e in sorted(slow.items(), key=lambda kv: -kv[1]["dur"])]
    return {"host_ms_per_step": phases, "fill_start_delay_ms": delays, "largest_device_gaps": at_gaps,
            "slowest_blocking_calls": slowest}


def print_context(ctx: dict) -> None:
    print("  host ms per step: " + ", ".join(f"{k} {v}" for k, v in ctx.get("host_ms_per_step", {}).items()),
          flush=True)
    if ctx.get("fill_start_delay_ms"):
        print(f"  mask fill start after its submission (ms): {ctx['fill_start_delay_ms']}", flush=True)
    for g in ctx.get("largest_device_gaps", [])[:6]:
        print(f"  device gap {g['gap_ms']} ms; scheduler thread in: {' > '.join(g['host_at_start'])}", flush=True)
    for c in ctx.get("slowest_blocking_calls", [])[:4]:
        print(f"  slowest {c['call']} {c['ms']} ms in: {' > '.join(c['host_frames'])}", flush=True)


def run_kind(s, batch: int, kind: str, steps: int, profile_steps: int, out: Path, input_len: int) -> dict:
    """kind: plain, constrained, or constrained-late (Scheduler.fill_before_launch off: the mask is
    always filled inside the batch's token_bitmask_ready, as before session 8)."""
    from torch.profiler import ProfilerActivity, profile

    constrained = kind.startswith("constrained")
    if hasattr(s, "fill_before_launch"):
        s.fill_before_launch = kind != "constrained-late"
    tag = {"plain": "p", "constrained": "c", "constrained-late": "cl"}[kind]
    add_batch(s, batch, constrained, steps + profile_steps + 40, tag, input_len)
    for _ in range(10000):
        if not (s._grammar_pending or s.waiting or len(s.running) < batch):
            break
        for o in s.step():
            if o.error:
                raise SystemExit(f"request {o.rid}: {o.error}")
    else:
        raise SystemExit(f"only {len(s.running)} of {batch} requests running ({len(s.waiting)} waiting)")
    for _ in range(8):  # warm decode steps
        s.step()
    sync()
    m0 = s.metrics.overlapped_batches
    t0 = time.perf_counter()
    for _ in range(steps):
        s.step()
    sync()
    ms = 1000 * (time.perf_counter() - t0) / steps
    ahead = s.metrics.overlapped_batches - m0
    print(f"{kind}: {ms:.3f} ms per decode step at {len(s.running)} rows "
          f"({ahead}/{steps} launched ahead)", flush=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, with_stack=True) as prof:
        for _ in range(profile_steps):
            s.step()
        sync()
    trace = out / f"grammar_timeline_{tag}.json"
    prof.export_chrome_trace(str(trace))
    row = {"kind": kind, "constrained": constrained, "ms_per_step": round(ms, 3), "launched_ahead": ahead, "steps": steps,
           "gaps": gaps_per_step(prof, profile_steps), "blocking_calls": blocking_calls(prof)}
    print(json.dumps({k: row[k] for k in ("ms_per_step", "gaps")}), flush=True)
    for r in row["blocking_calls"][:6]:
        print(f"  {r['call']}: {r['count']} calls, {r['total_ms']} ms total, max {r['max_ms']} ms", flush=True)
    try:
        row["trace_context"] = trace_context(trace, profile_steps)
        print_context(row["trace_context"])
    except Exception as e:  # the analysis must not cost the measurement
        print(f"  trace analysis failed: {e!r}", flush=True)
    while s.has_work():  # the kind's requests run to their max_new_tokens before the next kind
        s.step()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/model-configs/llama-3.1-8b")
    ap.add_argument("--tokenizer-dir", type=Path, default=Path("/tmp/tok128k"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--profile-steps", type=int, default=6)
    ap.add_argument("--kinds", default="plain,constrained,constrained-late")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (with a tiny --model)")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--analyze", type=Path, help="only read this exported trace (steps: --profile-steps) and exit")
    args = ap.parse_args()
    if args.analyze:
        ctx = trace_context(args.analyze, args.profile_steps)
        print_context(ctx)
        print(json.dumps(ctx, indent=1))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.tokenizer_dir / "tokenizer.json").exists():
        make_tokenizer(args.tokenizer_dir, VOCAB)
    t0 = time.perf_counter()
    s = build(args.model, args.tokenizer_dir, args.batch, args.device)
    print(f"runner + scheduler built in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = [run_kind(s, args.batch, kind, args.steps, args.profile_steps, args.out, args.input_len)
            for kind in args.kinds.split(",")]
    (args.out / "grammar_timeline.json").write_text(json.dumps(rows, indent=1))
    plain = next((r for r in rows if r["kind"] == "plain"), None)
    for r in rows:
        if plain is not None and r is not plain:
            print(f"plain / {r['kind']} step time: {plain['ms_per_step'] / r['ms_per_step']:.4f}")


if __name__ == "__main__":
    main()
