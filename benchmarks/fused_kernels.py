"""Benchmark the fused Triton layer kernels (radixserve.layers.triton_ops) against the layers' torch code.

Llama-3.1-8B shapes: hidden 4096 (RMSNorm, with and without the residual add), intermediate 14336
(SiLU-and-mul over the [n, 2*14336] gate_up output), 32 query / 8 KV heads of dim 128 (rotary on q and
k sliced from one fused qkv output, llama3 rope scaling), for 1, 64 and 1024 tokens.

Per point: the max abs difference between the fused output and the torch path's output in the same
dtype (and how many elements differ at all), the median time per call of each (torch.cuda.Event
around every call, 100 calls after warm-up, L2 warm, host launch cost included), and the fused
call's time replayed from a CUDA graph (launch cost excluded), which also checks that the kernels
capture. Rotary is timed as the layer runs it (gather cos/sin for the positions, cast, rotate);
`rotary (kernel)` times the kernel alone on gathered cos/sin.

Usage: python benchmarks/fused_kernels.py [--out fused_kernels.json] [--tokens 1,64,1024]
       [--dtypes bfloat16,float32] [--iters 100]
Needs CUDA, torch and triton only (the repository's core/ is put on sys.path). Prints a Markdown table
and writes the rows as JSON to --out. `--dry-run` runs the same code on CPU in Triton's interpreter
(tiny token counts, host timings that mean nothing; the interpreter truncates float32 -> bfloat16
where GPUs round to nearest, so its bf16 errors are not the GPU's) to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "core"))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HIDDEN, INTERMEDIATE, NQ, NKV, HEAD_DIM = 4096, 14336, 32, 8, 128  # Llama-3.1-8B
EPS = 1e-5
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
ROPE_POSITIONS = 8192  # cos/sin cache size (the runtime sizes it to the context length)


@dataclass
class Case:
    op: str
    tokens: int
    dtype: torch.dtype
    fused: Callable[[], object]
    torch_ref: Callable[[], object]


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def build_cases(tokens: int, dtype: torch.dtype, device: str) -> list[Case]:
    """Inputs for one (tokens, dtype) point; each case pairs the fused call with the torch path."""
    from radixserve.layers import triton_ops
    from radixserve.layers.norm import RMSNorm
    from radixserve.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(tokens)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    norm = RMSNorm(HIDDEN, EPS, params_dtype=dtype).to(device)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=gen))
    x, residual = randn(tokens, HIDDEN, scale=3.0), randn(tokens, HIDDEN)

    def torch_norm(x, residual=None):  # RMSNorm.forward's torch path
        if residual is None:
            return norm._norm(x)
        x = x + residual
        return norm._norm(x), x

    gate_up = randn(tokens, 2 * INTERMEDIATE, scale=2.0)

    def torch_silu():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM, 131072, LLAMA3_ROPE).to(device)
    rope.reserve(ROPE_POSITIONS, torch.device(device))
    positions = torch.randint(0, ROPE_POSITIONS, (tokens,), generator=gen).to(device)
    qkv = randn(tokens, (NQ + 2 * NKV) * HEAD_DIM)
    q, k, _ = qkv.split([NQ * HEAD_DIM, NKV * HEAD_DIM, NKV * HEAD_DIM], dim=-1)

    def gathered():
        cos, sin = rope._cos_sin(positions)
        return cos.to(dtype), sin.to(dtype)

    def torch_rope():  # RotaryEmbedding.forward's torch path
        cos, sin = gathered()
        return rope._rotate(q, cos, sin), rope._rotate(k, cos, sin)

    def fused_rope():  # what RotaryEmbedding.forward runs on CUDA
        cos, sin = gathered()
        return triton_ops.rotary(q, k, cos, sin, HEAD_DIM, HEAD_DIM)

    cos_g, sin_g = gathered()
    return [
        Case("rmsnorm", tokens, dtype, lambda: triton_ops.rmsnorm(x, norm.weight, EPS), lambda: torch_norm(x)),
        Case(
            "rmsnorm+residual",
            tokens,
            dtype,
            lambda: triton_ops.rmsnorm(x, norm.weight, EPS, residual),
            lambda: torch_norm(x, residual),
        ),
        Case("silu_and_mul", tokens, dtype, lambda: triton_ops.silu_and_mul(gate_up), torch_silu),
        Case("rotary", tokens, dtype, fused_rope, torch_rope),
        Case(
            "rotary (kernel)",
            tokens,
            dtype,
            lambda: triton_ops.rotary(q, k, cos_g, sin_g, HEAD_DIM, HEAD_DIM),
            lambda: (rope._rotate(q, cos_g, sin_g), rope._rotate(k, cos_g, sin_g)),
        ),
    ]


def compare(fused_out, torch_out) -> tuple[float, int, int]:
    """(max abs difference, differing elements, elements) over all outputs; NaN counts as a difference."""
    max_err, differ, total = 0.0, 0, 0
    for a, b in zip(_flat(fused_out), _flat(torch_out), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        diff = (a.float() - b.float()).abs()
        bad = diff.isnan() & ~(a.isnan() & b.isnan())
        max_err = (
            float("inf") if bad.any() else max(max_err, float(diff.nan_to_num(0.0).max()) if diff.numel() else 0.0)
        )
        differ += int(((a != b) & ~(a.isnan() & b.isnan())).sum())
        total += a.numel()
    return max_err, differ, total


def time_us(fn: Callable[[], object], iters: int, device: str) -> float:
    """Median microseconds per call: a CUDA event pair around every call (host wall time on CPU)."""
    for _ in range(10):
        fn()
    if device != "cuda":
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def graph_replay(case: Case, iters: int) -> tuple[float, bool]:
    """Capture one fused call in a CUDA graph: (median µs per replay, replayed output == eager output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            case.fused()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = case.fused()
    graph.replay()
    torch.cuda.synchronize()
    eager = case.fused()
    same = all(torch.equal(a, b) for a, b in zip(_flat(captured), _flat(eager), strict=True))
    return time_us(graph.replay, iters, "cuda"), same


def run(tokens_list: list[int], dtypes: list[torch.dtype], iters: int, device: str) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for tokens in tokens_list:
            for case in build_cases(tokens, dtype, device):
                max_err, differ, total = compare(case.fused(), case.torch_ref())
                torch_us = time_us(case.torch_ref, iters, device)
                fused_us = time_us(case.fused, iters, device)
                graph_us, graph_ok = graph_replay(case, iters) if device == "cuda" else (None, None)
                rows.append(
                    {
                        "op": case.op,
                        "tokens": tokens,
                        "dtype": str(dtype).removeprefix("torch."),
                        "max_abs_err": max_err,
                        "elements_differing": differ,
                        "elements": total,
                        "torch_us": round(torch_us, 2),
                        "fused_us": round(fused_us, 2),
                        "speedup": round(torch_us / fused_us, 2),
                        "fused_graph_us": None if graph_us is None else round(graph_us, 2),
                        "graph_replay_matches": graph_ok,
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    head = (
        "| op | tokens | dtype | max abs err | elements differing | torch µs | fused µs | speedup "
        "| fused in graph µs | graph replay ok |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in rows:
        graph = "-" if r["fused_graph_us"] is None else f"{r['fused_graph_us']:.2f}"
        ok = "-" if r["graph_replay_matches"] is None else ("yes" if r["graph_replay_matches"] else "**NO**")
        lines.append(
            f"| {r['op']} | {r['tokens']} | {r['dtype']} | {r['max_abs_err']:.3g} "
            f"| {r['elements_differing']} / {r['elements']} | {r['torch_us']:.2f} | {r['fused_us']:.2f} "
            f"| {r['speedup']:.2f}x | {graph} | {ok} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows (and the environment) as JSON here")
    ap.add_argument("--tokens", default="1,64,1024")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, to check the script")
    args = ap.parse_args()

    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first built
        device, tokens, iters = "cpu", [1, 3], 3
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --dry-run)")
        device, tokens, iters = "cuda", [int(t) for t in args.tokens.split(",")], args.iters
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]

    import triton

    sys.path.insert(0, _HERE)
    from bench_env import commit, machine

    env = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "none (dry run: Triton interpreter on CPU)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "machine": machine(),
        "commit": commit(),
        "iters": iters,
    }
    rows = run(tokens, dtypes, iters, device)
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}\n")
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
