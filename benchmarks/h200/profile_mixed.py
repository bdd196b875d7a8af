"""Where a mixed step's time goes (issue 18's ITL p99): one scheduler step that prefills a prompt while the
running requests decode, split into its wall time, the device's kernel time and the top kernels.

    python benchmarks/h200/profile_mixed.py [--model benchmarks/model-configs/llama-3.1-8b] [--out DIR]
        [--decoding 24] [--prompts 512,1024] [--device cuda] [--extend-graph-tokens 0] [--tag ""]

Session 16's step traces (benchmarks/results/h100-session16.md) found a mixed step of the 8B shape takes ~33 ms
with 512 prompt tokens and with 1024 alike, while a decode step takes ~9 ms: this separates the candidates (host
time of the eager forward, the extend path's set-up, the decode rows inside the extend attention kernel). The
scheduler runs in this process (no server), non-overlapped, with `scheduler.enable_mixed_chunk=true`: `--decoding`
requests of 1024-token prompts are brought to decoding first, then for each prompt length one new prompt is
added and the next step (the mixed one) is timed three times without the profiler, once under torch's
profiler and once under cProfile; the same prompt lengths are then timed with nothing decoding (a plain prefill step), and decode-only steps as the
reference. `launch_ms`: the host's time until `launch_batch` returned (it queues the forward without waiting for
the device); close to `wall_ms` means the step is host-bound (mixed and prefill batches run eagerly: only decode
batches replay a CUDA graph). Prints one JSON line per case and writes profile_mixed.json under --out. `--device cpu` with a tiny
checkpoint checks the script itself (no CUDA timings then)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import time

import torch
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.state import SamplingParams

_ids = itertools.count()


def build(model: str, device: str, decoding: int, extend_graph_tokens: int) -> Scheduler:
    cuda = device == "cuda"
    cfg = Config.build({
        "model": {"path": model, "load_format": "dummy", "context_length": 4096},
        "runtime": {"device": device, "dtype": "bfloat16" if cuda else "float32", "overlap": False,
                    **({"cuda_graph": True, "cuda_graph_extend_max_tokens": extend_graph_tokens} if cuda else {})},
        "stack": {"attention": "triton" if cuda else "torch_native"},
        "scheduler": {"enable_mixed_chunk": True, "chunked_prefill_size": 4096,
                      "max_running_requests": decoding + 8, "max_total_tokens": (decoding + 8) * 4096},
    })
    runner = ModelRunner(cfg, show_progress=False)
    return Scheduler.from_config(cfg, runner, Registry.from_config(cfg))


def prompt(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, vocab - 1) for _ in range(n)]  # fresh ids: no prefix-cache hit


def add(s: Scheduler, ids: list[int], max_new: int) -> str:
    rid = f"r{next(_ids)}"
    s.add_request(GenerateRequest(rid=rid, input_ids=ids, stream=False,
                                  sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)))
    return rid


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


_launch_s: list[float] = []  # per forward: seconds until launch_batch returned (the host's share)


def time_launches(s: Scheduler) -> None:
    """Record how long each `launch_batch` takes to return: it queues the forward and the sampling on
    the device and returns without waiting, so on CUDA this is the host's time for the step's forward;
    if it is close to the step's wall time, the step is host-bound."""
    launch = s.runner.launch_batch

    def timed(sb):
        t = time.perf_counter()
        out = launch(sb)
        _launch_s.append(time.perf_counter() - t)
        return out

    s.runner.launch_batch = timed


def timed_step(s: Scheduler, device: str) -> float:
    sync(device)
    t = time.perf_counter()
    s.step()
    sync(device)
    return time.perf_counter() - t


def settle(s: Scheduler) -> None:
    """Step until nothing waits and no prompt is half prefilled: every running request decodes."""
    for _ in range(10_000):
        if not s.waiting and s.chunked_req is None:
            return
        s.step()
    raise RuntimeError("the scheduler did not settle")


def profiled_step(s: Scheduler, device: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        wall = timed_step(s, device)
    events = prof.key_averages()
    kernels = [(e.key, e.device_time_total / 1e3, e.count) for e in events
               if e.device_time_total > 0 and not e.key.startswith(("aten::", "cu", "Memcpy", "Memset"))]
    kernels.sort(key=lambda k: -k[1])
    # the host side: every op the step ran on the CPU (aten ops, kernel launches, Python-level records),
    # by count and by self CPU time; a mixed step's extra host time shows up as extra or slower ops here
    host = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in events if e.self_cpu_time_total > 0 or e.count]
    return {"profiled_wall_ms": round(wall * 1e3, 2),
            "kernel_ms": round(sum(k[1] for k in kernels), 2),
            "host_events": sum(c for _, c, _ in host),
            "top_kernels": [{"name": k[:90], "ms": round(ms, 3), "calls": c} for k, ms, c in kernels[:15]],
            "top_host_by_count": [{"name": k[:90], "calls": c, "self_ms": round(ms, 3)}
                                  for k, c, ms in sorted(host, key=lambda h: -h[1])[:25]],
            "top_host_by_time": [{"name": k[:90], "calls": c, "self_ms": round(ms, 3)}
                                 for k, c, ms in sorted(host, key=lambda h: -h[2])[:25]]}


def python_profiled_step(s: Scheduler, device: str) -> dict:
    """The step under cProfile: which Python functions hold the host's time (tottime: own code,
    cumtime: with callees)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    sync(device)
    prof.enable()
    s.step()
    sync(device)
    prof.disable()
    st = pstats.Stats(prof)
    rows = [(f"{os.path.basename(fn)}:{line}:{name}", cc, tt * 1e3, ct * 1e3)
            for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items()]
    return {"py_total_ms": round(st.total_tt * 1e3, 2), "py_calls": sum(r[1] for r in rows),
            "top_py_by_tottime": [{"fn": f, "calls": c, "tottime_ms": round(t, 3), "cumtime_ms": round(ct, 3)}
                                  for f, c, t, ct in sorted(rows, key=lambda r: -r[2])[:30]],
            "top_py_by_cumtime": [{"fn": f, "calls": c, "tottime_ms": round(t, 3), "cumtime_ms": round(ct, 3)}
                                  for f, c, t, ct in sorted(rows, key=lambda r: -r[3])[:40]]}


def case(s: Scheduler, device: str, vocab: int, rng: random.Random, new_tokens: int, label: str) -> dict:
    """One new prompt of `new_tokens` prefilled in the next step (with whatever decodes), three times
    unprofiled, once under torch's profiler and once under cProfile; each prompt is then stepped to decoding and aborted."""
    walls, hosts = [], []
    row: dict = {}
    graphed = False
    for rep in range(5):
        rid = add(s, prompt(new_tokens, vocab, rng), 8)
        if rep < 3:
            walls.append(timed_step(s, device))
            hosts.append(_launch_s[-1])
            graphed = s.runner.last_run_used_cuda_graph
        elif rep == 3:
            row = profiled_step(s, device)
        else:
            row.update(python_profiled_step(s, device))
        settle(s)
        s.abort(rid)
    return {"case": label, "prompt_tokens": new_tokens, "decoding": len(s.running), "graph": graphed,
            "wall_ms": round(statistics.median(walls) * 1e3, 2),
            "launch_ms": round(statistics.median(hosts) * 1e3, 2), **row}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/model-configs/llama-3.1-8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--decoding", type=int, default=24, help="requests decoding while the prompt is prefilled")
    ap.add_argument("--prompts", default="512,1024", help="comma-separated prompt lengths")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--extend-graph-tokens", type=int, default=0,
                    help="runtime.cuda_graph_extend_max_tokens (0: prefill and mixed steps run eagerly)")
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    args = ap.parse_args()
    lengths = [int(x) for x in args.prompts.split(",")]
    s = build(args.model, args.device, args.decoding, args.extend_graph_tokens)
    time_launches(s)
    vocab = s.runner.vocab_size
    rng = random.Random(0)
    rows = []
    for n in lengths:  # warm-up: every prompt length once, alone (compiles, graph capture done at load)
        rows.append(case(s, args.device, vocab, rng, n, "warm-up, nothing decoding"))
    rows.clear()
    for n in lengths:
        rows.append(case(s, args.device, vocab, rng, n, "prefill, nothing decoding"))
    for _ in range(args.decoding):
        add(s, prompt(1024, vocab, rng), 2000)  # 1024 + 2000 fit the 4096 context
    settle(s)
    decode = [timed_step(s, args.device) for _ in range(10)]
    rows.append({"case": "decode only", "decoding": len(s.running), "wall_ms": round(statistics.median(decode) * 1e3, 2),
                 "launch_ms": round(statistics.median(_launch_s[-10:]) * 1e3, 2)})
    for n in lengths:
        rows.append(case(s, args.device, vocab, rng, n, "mixed: prefill + decode rows"))
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("top_")}), flush=True)
        for k in row.get("top_kernels", [])[:8]:
            print(f"    {k['ms']:8.3f} ms {k['calls']:4d}x  {k['name']}")
        for k in row.get("top_host_by_time", [])[:12]:
            print(f"    host {k['self_ms']:8.3f} ms {k['calls']:5d}x  {k['name']}")
        for k in row.get("top_py_by_tottime", [])[:15]:
            print(f"    py {k['tottime_ms']:8.3f} ms own {k['cumtime_ms']:8.3f} ms cum {k['calls']:6d}x  {k['fn']}")
    with open(os.path.join(args.out, f"profile_mixed{args.tag}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
