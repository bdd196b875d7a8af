"""Device check for issue 13's failed draft capture (session 8 call 5): is a CUDA graph that Python's
automatic GC destroys during another graph's capture fatal to that capture on this torch, and does
`radixserve.cuda_graph_runner.CudaGraph.capture` (GC off while capturing, caller's stream put back on
failure) avoid it?

Each attempt drops a captured graph inside a reference cycle (only the cyclic GC frees it, as a
dropped EAGLE drafter's graphs), then captures a function that, once the stream is capturing,
lowers the GC threshold and allocates: with the GC on, a collection runs inside the capture and
destroys the dropped graph there. Attempts: `torch.cuda.graph` directly (what CudaGraph did before),
then CudaGraph.capture. One JSON line per attempt: captured or the error, and whether the thread is
back on its stream.

    python benchmarks/h200/capture_gc_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch


def drop_a_graph_in_a_cycle() -> None:
    graph, x = torch.cuda.CUDAGraph(), torch.zeros(4, device="cuda")
    with torch.cuda.graph(graph):
        x.add_(1)
    holder: dict = {"graph": graph}
    holder["self"] = holder  # a reference cycle: refcounts alone never free the graph


def attempt(name: str, capture) -> dict:
    gc.collect()
    threshold = gc.get_threshold()
    gc.set_threshold(1_000_000)  # no automatic collection before the capture starts
    drop_a_graph_in_a_cycle()
    y = torch.ones(4, device="cuda")

    def fn() -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():  # not in CudaGraph's warm-up runs
            gc.set_threshold(10)
            _ = [[i] for i in range(10_000)]  # container allocations: a collection, if the GC is on
        return y * 2

    caller = torch.cuda.current_stream()
    try:
        capture(fn)
        res = {"capture": name, "captured": True, "error": None}
    except Exception as e:  # noqa: BLE001 - the probe reports whatever the capture raised
        res = {"capture": name, "captured": False, "error": repr(e)[:400]}
    finally:
        gc.set_threshold(*threshold)
    res["caller_stream_current"] = torch.cuda.current_stream() == caller
    torch.cuda.set_stream(caller)
    torch.cuda.synchronize()
    gc.collect()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from radixserve.cuda_graph_runner import CudaGraph

    def torch_graph(fn):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fn()

    rows = [attempt("torch.cuda.graph", torch_graph), attempt("CudaGraph.capture", CudaGraph().capture)]
    for r in rows:
        r["torch"] = torch.__version__
        print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "capture_gc_probe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
