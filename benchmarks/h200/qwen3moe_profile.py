"""Where a batch-1 decode step of the Qwen3-30B-A3B shape spends its time (dummy bf16, H200, issue 16).

    python benchmarks/h200/qwen3moe_profile.py [--model benchmarks/model-configs/qwen3-30b-a3b] [--out DIR]

One ModelRunner (triton attention, CUDA graphs up to batch 8), a 128-token prompt, then:
  1. static batch: the synchronous decode step (`run_static_batch`, as `bench one-batch` times it)
     and whether it replayed a CUDA graph;
  2. the batch-1 graph replayed back to back (the GPU's own time per step, no host work);
  3. the kernels inside that graph replay, by device time (torch.profiler over 20 replays);
  4. the kernels of eager decode steps by device time (prefill subtracted), as profile_decode.py;
  5. the scheduler loop in this process (the Engine's scheduler without the IPC): per decode step the
     wall time, the host time spent inside `launch_batch`, the time blocked on the result, and how
     many decode forwards replayed a CUDA graph (ModelRunner.last_run_used_cuda_graph);
  6. the step time against the HBM floor of the bytes a step reads (moe_limit.py's count).
Progress lines on stdout; everything in qwen3moe_profile.json under --out."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from radixserve.static_batch import run_static_batch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from kernel_frontier import SKIP_PREFIXES, frontier_rows, kernel_intervals  # noqa: E402

PROMPT = [[(7 * i) % 30000 + 100 for i in range(128)]]


def log(msg: str) -> None:
    print(f"[qwen3moe_profile {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def runner_for(model: str, tokenizer: str | None, device: str, dtype: str) -> tuple[ModelRunner, Config]:
    m = {"path": model, "load_format": "dummy", "context_length": 2048}
    if tokenizer:
        m["tokenizer"] = tokenizer
    cfg = Config.build({
        "model": m,
        "runtime": {"device": device, "dtype": dtype, "cuda_graph": True, "cuda_graph_max_bs": 8},
        "stack": {"attention": "triton" if device == "cuda" else "torch_native"},
        "scheduler": {"max_running_requests": 8, "max_total_tokens": 8192},
    })
    return ModelRunner(cfg, show_progress=False), cfg


def kernel_table(prof, divide: int, minus: dict | None = None) -> dict[str, tuple[float, int]]:
    """{kernel name: (device ms per step, calls per step)} of the kernels (not the aten/launch rows)."""
    out = {}
    for e in prof.key_averages():
        if e.device_time_total <= 0 or e.key.startswith(SKIP_PREFIXES):
            continue
        t, c = e.device_time_total, e.count
        if minus and e.key in minus:
            t, c = t - minus[e.key][0], c - minus[e.key][1]
        out[e.key] = (t / 1e3 / divide, c // divide)
    return out


def raw_times(prof) -> dict[str, tuple[float, int]]:
    return {e.key: (e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0}


def top_rows(table: dict[str, tuple[float, int]], n: int = 40) -> list[dict]:
    rows = sorted(table.items(), key=lambda kv: -kv[1][0])
    return [{"name": k[:110], "calls": c, "ms": round(ms, 4)} for k, (ms, c) in rows[:n] if ms > 0]


def print_rows(title: str, rows: list[dict], total: float) -> None:
    log(f"{title}: {total:.3f} ms of kernels per step")
    for r in rows[:25]:
        print(f"    {r['ms']:8.4f} ms  {r['calls']:4d}x  {r['name']}", flush=True)


def graph_section(runner: ModelRunner, row: dict) -> None:
    graph = runner.graph_runner.graphs[1]
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    row["graph_replay_ms"] = round(start.elapsed_time(end) / 100, 3)
    log(f"batch-1 graph replayed back to back: {row['graph_replay_ms']} ms per step")
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                graph.replay()
            torch.cuda.synchronize()
        table = kernel_table(prof, 20)
        row["graph_kernels_ms_per_step"] = round(sum(ms for ms, _ in table.values()), 3)
        row["graph_top_kernels"] = top_rows(table)
        print_rows("kernels inside the graph replay", row["graph_top_kernels"], row["graph_kernels_ms_per_step"])
        # PDL-launched kernels are resident while they wait: their device times overlap. The critical path by
        # finish frontier (benchmarks/kernel_frontier.py) says which kernels the step waits on.
        row["graph_frontier"] = frontier_rows(kernel_intervals(prof), 20)
        log(f"by finish frontier (span {row['graph_frontier']['span_ms']} ms a step, idle "
            f"{row['graph_frontier']['idle_ms']}): "
            + ", ".join(f"{k['name'][:28]} {k['ms']}" for k in row["graph_frontier"]["kernels"][:8]))
    except Exception as e:  # the profiler may not see kernels inside graphs on every CUDA/CUPTI
        row["graph_profile_error"] = repr(e)
        log(f"graph-replay profile failed: {e!r}")


def eager_section(runner: ModelRunner, row: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        def run(n_new: int):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                res = run_static_batch(runner, PROMPT, max_new_tokens=n_new)
            return prof, res

        run_static_batch(runner, PROMPT, max_new_tokens=4)
        res = run_static_batch(runner, PROMPT, max_new_tokens=32)
        row["eager_sync_step_ms"] = round(statistics.median(res.decode_step_s) * 1e3, 3)
        prefill, _ = run(1)
        with_decode, _ = run(9)
    finally:
        runner.graph_runner = graphs
    table = kernel_table(with_decode, 8, minus=raw_times(prefill))
    row["eager_kernels_ms_per_step"] = round(sum(ms for ms, _ in table.values() if ms > 0), 3)
    row["eager_kernel_launches_per_step"] = sum(c for ms, c in table.values() if ms > 0)
    row["eager_top_kernels"] = top_rows(table)
    log(f"eager decode step (sync): {row['eager_sync_step_ms']} ms, {row['eager_kernel_launches_per_step']} kernels")
    print_rows("eager decode kernels", row["eager_top_kernels"], row["eager_kernels_ms_per_step"])


def scheduler_section(runner: ModelRunner, cfg: Config, row: dict, overlap: bool, out_len: int = 256) -> None:
    """The Engine's scheduler loop in this process, one request of 128 in / out_len out."""
    from radixserve.messages import GenerateRequest
    from radixserve.plugins.registry import Registry
    from radixserve.scheduler.scheduler import Scheduler
    from radixserve.state import SamplingParams

    cfg = Config.build({**cfg.model_dump(), "runtime": {**cfg.runtime.model_dump(), "overlap": overlap}})
    launches: list[float] = []
    waits: list[float] = []
    graph_flags: list[bool] = []
    orig_launch, orig_forward = runner.launch_batch, runner._forward

    def forward(sb, greedy_ids):
        res = orig_forward(sb, greedy_ids)
        if len(sb.extend_lens) and all(e == 1 for e in sb.extend_lens):
            graph_flags.append(bool(runner.last_run_used_cuda_graph))
        return res

    def launch(sb):
        t0 = time.perf_counter()
        launched = orig_launch(sb)
        launches.append(time.perf_counter() - t0)
        resolve = launched.result

        def result():
            t1 = time.perf_counter()
            r = resolve()
            waits.append(time.perf_counter() - t1)
            return r

        launched.result = result
        return launched

    runner.launch_batch, runner._forward = launch, forward
    try:
        sched = Scheduler.from_config(cfg, runner, Registry.discover())
        for warm in range(2):
            sched.add_request(GenerateRequest(rid=f"w{warm}", input_ids=PROMPT[0],
                                              sampling_params=SamplingParams(max_new_tokens=8, temperature=0,
                                                                             ignore_eos=True)))
            while sched.has_work():
                sched.step()
        sched.flush_cache()
        launches.clear(), waits.clear(), graph_flags.clear()
        sched.add_request(GenerateRequest(rid="r", input_ids=[t + 1 for t in PROMPT[0]],
                                          sampling_params=SamplingParams(max_new_tokens=out_len, temperature=0,
                                                                         ignore_eos=True)))
        steps: list[float] = []
        n_tok = 0
        t_start = time.perf_counter()
        while sched.has_work():
            t0 = time.perf_counter()
            for o in sched.step():
                n_tok += len(o.new_ids)
            steps.append(time.perf_counter() - t0)
        total = time.perf_counter() - t_start
    finally:
        runner.launch_batch, runner._forward = orig_launch, orig_forward
    body = steps[2:-2] or steps
    key = "overlap" if overlap else "no_overlap"
    row[f"sched_{key}"] = {
        "tokens": n_tok, "seconds": round(total, 3), "tok_s": round(n_tok / total, 1),
        "median_step_ms": round(statistics.median(body) * 1e3, 3),
        "median_launch_host_ms": round(statistics.median(launches) * 1e3, 3),
        "median_result_wait_ms": round(statistics.median(waits) * 1e3, 3) if waits else None,
        "decode_forwards": len(graph_flags), "decode_forwards_in_graph": sum(graph_flags),
        "overlapped_batches": sched.metrics.overlapped_batches,
    }
    log(f"scheduler ({key}): {row[f'sched_{key}']}")


def fused_gate_check(runner: ModelRunner, row: dict, reps: int = 200) -> None:
    """The one-launch router (FusedMoE.forward_with_gate, when the tree has it) against the linear
    layer + router on the first MoE block, 1-8 tokens, 200 launches each (the arrival counters must
    stay consistent): the routed ids agree (ties aside) and the outputs are close."""
    block = next((m for m in runner.model.modules() if hasattr(m, "experts") and hasattr(m, "gate")), None)
    if block is None or not hasattr(block.experts, "forward_with_gate"):
        row["fused_gate_check"] = "not in this tree"
        return
    from radixserve.layers.moe import select_experts, small_m

    experts, gate = block.experts, block.gate
    w13f, w2f = experts.w13_weight.float(), experts.w2_weight.float()  # the fp32 reference's weights
    out: dict = {}
    with torch.inference_mode():
        for m in (1, 2, 4, 8):
            x = torch.randn(m, gate.weight.shape[1], device=gate.weight.device, dtype=gate.weight.dtype)
            if not small_m.fused_gate_applies(x, gate.weight, experts.routing, experts._gate_arrivals):
                out[m] = "not applicable"
                continue
            want_w, want_ids = select_experts(gate(x), experts.routing)
            same_ids = 0
            for _ in range(reps):
                w, ids = small_m.fused_gate_select_experts(x, gate.weight, experts.routing, experts._gate_arrivals)
                same_ids += int(torch.equal(ids.long().sort(1).values, want_ids.long().sort(1).values))
            err = (experts.forward_with_gate(x, gate).float() - experts(x, gate(x)).float()).abs().max().item()
            # the expert sum in the down kernel's last program: the same bits as the sum_rows launch, and
            # close to fp32 torch
            blocks = small_m.DEFAULT_BLOCKS  # the layer's blocks: its fused_sum off for the second run
            try:
                a = experts(x, gate(x))
                small_m.DEFAULT_BLOCKS = dataclasses.replace(blocks, fused_sum=False)
                b = experts(x, gate(x))
            finally:
                small_m.DEFAULT_BLOCKS = blocks
            from radixserve.layers.moe.reference import fused_experts_reference

            ref = fused_experts_reference(x.float(), w13f, w2f, want_w, want_ids)
            rel = ((a.float() - ref).abs().max() / ref.abs().max()).item()
            out[m] = {"ids_equal_runs": same_ids, "of": reps, "max_abs_out_diff": round(err, 5),
                      "counters_zero": not bool(experts._gate_arrivals.any()),
                      "fused_sum_bit_equal": bool(torch.equal(a, b)), "experts_rel_err_vs_fp32": round(rel, 5)}
    row["fused_gate_check"] = out
    log(f"one-launch router vs linear + router: {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/model-configs/qwen3-30b-a3b")
    ap.add_argument("--tokenizer", default=".gpu2/tok-smollm2" if os.path.isdir(".gpu2/tok-smollm2") else None)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script on a tiny config")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="skip the eager-kernel profile and the no-overlap run")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    row: dict = {}
    t0 = time.perf_counter()
    log("loading the runner (dummy weights, graphs captured)")
    runner, cfg = runner_for(args.model, args.tokenizer, args.device, args.dtype)
    row["load_s"] = round(time.perf_counter() - t0, 1)
    row["graphs_captured"] = runner.graph_runner is not None
    log(f"loaded in {row['load_s']} s; graphs captured: {row['graphs_captured']}; "
        f"GPU memory {torch.cuda.memory_allocated() / 2**30 if args.device == 'cuda' else 0:.1f} GiB")
    try:
        run_static_batch(runner, PROMPT, max_new_tokens=4)
        res = run_static_batch(runner, PROMPT, max_new_tokens=64)
        row["static_sync_step_ms"] = round(statistics.median(res.decode_step_s) * 1e3, 3)
        row["static_used_cuda_graph"] = res.used_cuda_graph
        log(f"static batch-1 decode step (sync): {row['static_sync_step_ms']} ms, graph: {res.used_cuda_graph}")
        if args.device == "cuda":
            try:
                fused_gate_check(runner, row)
            except Exception as e:  # a finding, not the end of the profile
                row["fused_gate_check"] = {"error": repr(e)[:400]}
                log(f"one-launch router check failed: {e!r}"[:400])
        if runner.graph_runner is not None:
            graph_section(runner, row)
        for overlap in ((True,) if args.quick else (True, False)):
            scheduler_section(runner, cfg, row, overlap)
        if not args.quick:
            eager_section(runner, row)
        try:
            import subprocess

            here = os.path.dirname(os.path.abspath(__file__))
            lim = subprocess.run([sys.executable, os.path.join(here, "moe_limit.py"), args.model, "--measured-tok-s",
                                  str(round(1e3 / row["sched_overlap"]["median_step_ms"], 1))],
                                 capture_output=True, text=True, timeout=120)
            row["limit"] = json.loads(lim.stdout.strip().splitlines()[-1]) if lim.returncode == 0 else lim.stderr[-800:]
            log(f"limit: {row['limit']}")
        except Exception as e:
            row["limit"] = repr(e)
    finally:
        with open(os.path.join(args.out, "qwen3moe_profile.json"), "w") as f:
            json.dump(row, f, indent=1)
        summary = {k: v for k, v in row.items() if not k.endswith("top_kernels")}
        print(json.dumps(summary, indent=1), flush=True)
        log(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
