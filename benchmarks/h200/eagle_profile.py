"""Per-kernel breakdown of one EAGLE-3 chain propose and of the verify at batch 1 (issue 13).

Llama-3.1-8B shape, dummy weights, a random EAGLE-3 head (spec_eagle.write_head), topk 1, 4 steps.
Two short profiled runs on one target load:

* ``graphs``: the draft's and the target's CUDA graphs on (the served configuration). Kernels inside
  graph replays are attributed to the propose or to the rest of the step (the verify) by the GPU
  time window: the propose is bracketed by synchronizes, so its kernels run inside its wall window.
* ``eager``: the draft eager, so its CPU ops carry shapes: each matmul's bytes (A + B + C, bf16) and
  its achieved GB/s are printed, the way to see which kernels run far from HBM speed.

    python benchmarks/h200/eagle_profile.py --out $OUT [--output-len 12]

Writes $OUT/eagle_profile.txt (the tables), $OUT/eagle_profile.json, and the gzipped chrome traces.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_eagle import MODEL, stop_recording, write_head  # noqa: E402

LINES: list[str] = []


def say(s: str = "") -> None:
    print(s, flush=True)
    LINES.append(s)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def windows(trace: dict, name: str) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == name)


def inside(ts: float, wins: list[tuple[float, float]]) -> bool:
    return any(a <= ts <= b for a, b in wins)


def kernel_table(trace: dict, label: str) -> dict:
    """Device kernels split into propose / verify (the step outside the propose), per verify step."""
    props, steps = windows(trace, "eagle_propose"), windows(trace, "eagle_step")
    n = max(1, len(props))
    acc: dict[str, dict[str, list[float]]] = {"propose": defaultdict(list), "verify": defaultdict(list)}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ts = e["ts"]
        if inside(ts, props):
            acc["propose"][e["name"]].append(e["dur"])
        elif inside(ts, steps):
            acc["verify"][e["name"]].append(e["dur"])
    out = {}
    for phase, d in acc.items():
        total = sum(sum(v) for v in d.values()) / n
        rows = sorted(((sum(v) / n, len(v) / n, k) for k, v in d.items()), reverse=True)
        say(f"-- [{label}] {phase}: {total / 1e3:.3f} ms of kernels per verify step ({n} steps), "
            f"{sum(len(v) for v in d.values()) / n:.0f} kernels/step")
        for us, cnt, k in rows[:25]:
            say(f"   {us:8.1f} us  x{cnt:5.1f}  {k[:140]}")
        out[phase] = {"kernel_ms_per_step": total / 1e3, "top": [[k, us, cnt] for us, cnt, k in rows[:40]]}
    wall_p = [b - a for a, b in props]
    wall_s = [b - a for a, b in steps]
    if wall_p:
        say(f"-- [{label}] wall (profiled): propose {sum(wall_p) / len(wall_p) / 1e3:.3f} ms, "
            f"step {sorted(wall_s)[len(wall_s) // 2] / 1e3:.3f} ms (median)")
    return out


def matmul_bytes(prof, label: str) -> list:
    """Eager CPU ops with shapes: bytes moved by each matmul and the achieved bandwidth."""
    rows = []
    for ev in prof.key_averages(group_by_input_shape=True):
        if ev.key not in ("aten::mm", "aten::addmm"):  # the leaf ops (linear / matmul would count them twice)
            continue
        shapes = [s for s in ev.input_shapes if s]
        elems = 0
        if ev.key == "aten::addmm" and len(shapes) >= 3:
            (m, k), (k2, n2) = shapes[1], shapes[2]
            elems = m * k + k2 * n2 + m * n2
        elif ev.key in ("aten::mm", "aten::matmul") and len(shapes) >= 2 and len(shapes[0]) == 2:
            (m, k), (k2, n2) = shapes[0], shapes[1]
            elems = m * k + k2 * n2 + m * n2
        elif ev.key == "aten::linear" and len(shapes) >= 2:
            x, w = shapes[0], shapes[1]
            m = 1
            for d in x[:-1]:
                m *= d
            elems = m * x[-1] + w[0] * w[1] + m * w[0]
        dev_us = getattr(ev, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "cuda_time_total", 0)
        if ev.count == 0 or not elems:
            continue
        per_call_us = dev_us / ev.count
        gbs = (2 * elems) / (per_call_us * 1e-6) / 1e9 if per_call_us > 0 else 0.0
        rows.append((dev_us, ev.key, str(shapes), ev.count, per_call_us, 2 * elems / 1e6, gbs))
    rows.sort(reverse=True)
    say(f"-- [{label}] matmuls by device time (bf16 bytes = A + B + C)")
    say("   total_us   calls  us/call    MB/call   GB/s  op  shapes")
    for tot, key, shp, cnt, per, mb, gbs in rows[:25]:
        say(f"   {tot:9.0f} {cnt:6d} {per:8.1f} {mb:9.2f} {gbs:7.0f}  {key}  {shp[:100]}")
    return [list(r) for r in rows[:40]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=12)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--modes", default="graphs,eager")
    ap.add_argument("--attention", default="triton")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.plugins.registry import Registry
    from radixserve.runtime.messages import GenerateRequest
    from radixserve.scheduler import Scheduler
    from radixserve.scheduler.speculative.setup import build_drafter
    from radixserve.state import SamplingParams

    t_start = time.perf_counter()
    target = json.loads(Path(args.model, "config.json").read_text())
    target.setdefault("head_dim", target["hidden_size"] // target["num_attention_heads"])
    target.setdefault("rope_theta", 10000.0)
    target.setdefault("rope_scaling", None)
    tmp = Path(tempfile.mkdtemp())
    head = write_head(tmp / "eagle3", "eagle3", target, min(args.draft_vocab, target["vocab_size"]))
    cuda = args.device == "cuda"
    base = {
        "model": {"path": args.model, "load_format": "dummy", "context_length": 4096},
        "stack": {"attention": args.attention, "prefix_cache": "radix", "speculative": "eagle"},
        "runtime": {"device": args.device, "dtype": "bfloat16" if cuda else "float32", "cuda_graph_max_bs": 16},
    }

    def spec_config(draft_graphs: bool) -> Config:
        spec = {"num_draft_tokens": 4, "topk": 1, "num_steps": 4, "draft_model_path": head,
                "adaptive_batch_size": 0, "options": {"cuda_graph": draft_graphs and cuda}}
        return Config.build({**base, "speculative": spec})

    cfg = spec_config(True)
    registry = Registry.from_config(cfg)
    runner = ModelRunner(cfg, registry, show_progress=False)
    runner.warmup()
    say(f"target loaded + warmed in {time.perf_counter() - t_start:.1f} s")
    prompt = [int(x) for x in torch.randint(0, min(30000, target["vocab_size"]), (args.input_len,),
                                            generator=torch.Generator().manual_seed(1))]

    def run(c: Config):
        cache = registry.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
        sched = Scheduler(c, runner, cache, registry.load("policy", "fcfs")(), drafter=build_drafter(c, runner, registry))
        inner = sched.drafter.propose

        def propose(reqs, k):
            sync()
            with torch.profiler.record_function("eagle_propose"):
                r = inner(reqs, k)
                sync()
            return r

        sched.drafter.propose = propose
        sched.add_request(GenerateRequest(rid="r", input_ids=prompt, sampling_params=SamplingParams(
            max_new_tokens=args.output_len, temperature=0, ignore_eos=True)))
        first = True
        while sched.has_work():
            sync()
            if first:  # the prefill step: not profiled as a verify step
                sched.step()
                first = False
                continue
            with torch.profiler.record_function("eagle_step"):
                sched.step()
                sync()
        sched.flush_cache()

    result = {}
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    for mode in args.modes.split(","):
        stop_recording(runner)
        c = spec_config(mode == "graphs")
        t0 = time.perf_counter()
        run(c)  # untimed: captures the draft graphs, compiles
        say(f"[{mode}] warm pass in {time.perf_counter() - t0:.1f} s")
        with torch.profiler.profile(activities=acts, record_shapes=(mode == "eager")) as prof:
            run(c)
        trace_path = tmp / f"trace_{mode}.json"
        prof.export_chrome_trace(str(trace_path))
        with open(trace_path, "rb") as src, gzip.open(out / f"trace_{mode}.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace = json.loads(trace_path.read_text())
        result[mode] = {"kernels": kernel_table(trace, mode)}
        if mode == "eager":
            result[mode]["matmuls"] = matmul_bytes(prof, mode)
        say(f"[{mode}] done at {time.perf_counter() - t_start:.1f} s")
    (out / "eagle_profile.json").write_text(json.dumps(result))
    (out / "eagle_profile.txt").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
