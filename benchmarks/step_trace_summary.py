#!/usr/bin/env python3
"""Where a scheduler's forward time went, by batch kind: a summary of a `RADIXSERVE_STEP_TRACE` file
(one line per forward: start, decode rows, prefill tokens, seconds; under overlap a step's seconds
run from the previous step's tokens arriving to its own, docs/configuration.md).

    RADIXSERVE_STEP_TRACE=/tmp/served.trace PEER=0 benchmarks/served_vs_vllm.sh
    python benchmarks/step_trace_summary.py /tmp/served.trace [--all-runs] [--bucket 64]

The file appends across runs and server starts; a pause of more than 2 s between forwards starts a
new run (the warm-up client, then the timed one), and only the last run is summarised unless
--all-runs. Prints, per run: its span and busy time, decode-only steps by batch size (count, median
and mean ms, total seconds), prefill/mixed steps (prompt tokens per second, decode rows carried),
and the host gaps between forwards."""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict


def read_runs(path: str, gap_s: float = 2.0) -> list[list[tuple[float, int, int, float]]]:
    runs: list[list[tuple[float, int, int, float]]] = []
    prev_end = None
    with open(path) as f:
        for line in f:
            start, decode, prefill, seconds = line.split()
            row = (float(start), int(decode), int(prefill), float(seconds))
            if prev_end is None or row[0] - prev_end > gap_s:
                runs.append([])
            runs[-1].append(row)
            prev_end = row[0] + row[3]
    return runs


def summarise(run: list[tuple[float, int, int, float]], bucket: int = 1) -> list[str]:
    """`bucket`: decode steps grouped by rows in ranges of this width (1: each batch size apart)."""
    lines = []
    span = run[-1][0] + run[-1][3] - run[0][0]
    lines.append(f"{len(run)} forwards over {span:.2f} s, busy {sum(r[3] for r in run):.2f} s")
    by_rows: dict[int, list[float]] = defaultdict(list)
    for _, decode, prefill, seconds in run:
        if prefill == 0:
            by_rows[(decode - 1) // bucket * bucket + 1 if bucket > 1 else decode].append(seconds)
    for rows in sorted(by_rows):
        t = by_rows[rows]
        label = f"{rows:3d}-{rows + bucket - 1:3d}" if bucket > 1 else f"{rows:3d}"
        lines.append(f"decode {label} rows: {len(t):4d} steps, median {statistics.median(t) * 1e3:.1f} ms, "
                     f"mean {statistics.mean(t) * 1e3:.1f} ms, {sum(t):.2f} s")
    mixed = [r for r in run if r[2] > 0]
    if mixed:
        tokens, seconds = sum(r[2] for r in mixed), sum(r[3] for r in mixed)
        lines.append(f"prefill/mixed: {len(mixed)} steps, {tokens} prompt tokens in {seconds:.2f} s = "
                     f"{tokens / seconds:.0f} tok/s, {sum(r[1] for r in mixed)} decode rows carried")
    gaps = [b[0] - (a[0] + a[3]) for a, b in zip(run, run[1:])]
    if gaps:
        lines.append(f"host gaps between forwards: {sum(gaps):.2f} s in all, median {statistics.median(gaps) * 1e3:.2f} ms")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--all-runs", action="store_true")
    ap.add_argument("--bucket", type=int, default=1, help="group decode steps by rows in ranges this wide")
    args = ap.parse_args()
    runs = read_runs(args.trace)
    if not runs:
        raise SystemExit(f"{args.trace}: no forwards recorded")
    for i, run in enumerate(runs if args.all_runs else runs[-1:]):
        print(f"run {i + 1 if args.all_runs else len(runs)} of {len(runs)}:")
        for line in summarise(run, args.bucket):
            print("  " + line)


if __name__ == "__main__":
    main()
