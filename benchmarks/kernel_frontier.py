"""Which kernels a chain of overlapping launches actually waits on: the step's time attributed by finish frontier.

With programmatic dependent launch a kernel is resident (and counted by the profiler) long before it does its
work, so device time per kernel over-counts: in a Qwen3-30B-A3B batch-1 step the kernels' device times summed to
3.46 ms against a 3.11 ms replay (session 23). Here the step's span is cut at every point where a kernel finishes
later than any kernel before it: the time from the previous frontier (or from the kernel's start, after an idle
gap) to its end is credited to it. The credits plus the idle gaps add up to the span exactly, and a kernel that
finishes under another's shadow gets nothing: what remains is the chain's critical path, kernel by kernel.

    from kernel_frontier import frontier_attribution, kernel_intervals
    credits, idle = frontier_attribution(kernel_intervals(prof))   # prof: a finished torch.profiler.profile
"""

from __future__ import annotations

from collections.abc import Iterable

SKIP_PREFIXES = ("aten::", "cu", "Memcpy", "Memset", "ProfilerStep", "Activity Buffer", "Torch-Compiled")


def frontier_attribution(intervals: Iterable[tuple[str, float, float]]) -> tuple[dict[str, float], float]:
    """({name: time credited}, idle time) of (name, start, end) intervals, in their unit. Taken by end time, each
    interval is credited with the busy time from the frontier (the latest end so far) to its end; time no interval
    covers is idle. sum(credits) + idle == max(end) - min(start)."""
    rows = sorted(intervals, key=lambda r: (r[2], r[1]))
    credits: dict[str, float] = {name: 0.0 for name, _, _ in rows}
    if not rows:
        return credits, 0.0
    busy = _union(rows)
    frontier, idle, i = busy[0][0], 0.0, 0
    for name, _, end in rows:
        if end <= frontier:
            continue
        covered = 0.0  # of (frontier, end]: the merged busy spans are consecutive, walked once
        while i < len(busy) and busy[i][0] < end:
            lo, hi = max(busy[i][0], frontier), min(busy[i][1], end)
            covered += max(0.0, hi - lo)
            if busy[i][1] > end:
                break
            i += 1
        credits[name] += covered
        idle += end - frontier - covered
        frontier = end
    return credits, idle


def _union(rows: list[tuple[str, float, float]]) -> list[tuple[float, float]]:
    """The merged [start, end] spans the intervals cover, in order."""
    spans: list[list[float]] = []
    for _, start, end in sorted(rows, key=lambda r: r[1]):
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(lo, hi) for lo, hi in spans]


def kernel_intervals(prof) -> list[tuple[str, float, float]]:
    """(kernel name, start us, end us) of the device kernels a torch.profiler run recorded (launch, copy and
    aten rows left out)."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        if e.name.startswith(SKIP_PREFIXES):
            continue
        out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return out


def frontier_rows(intervals: list[tuple[str, float, float]], steps: int, n: int = 12) -> dict:
    """The attribution per step in ms, the largest first: {"span_ms", "idle_ms", "kernels": [{name, ms}]}."""
    credits, idle = frontier_attribution(intervals)
    span = (max(e for _, _, e in intervals) - min(s for _, s, _ in intervals)) if intervals else 0.0
    top = sorted(credits.items(), key=lambda kv: -kv[1])[:n]
    return {"span_ms": round(span / 1e3 / steps, 4), "idle_ms": round(idle / 1e3 / steps, 4),
            "kernels": [{"name": k[:80], "ms": round(v / 1e3 / steps, 4)} for k, v in top]}
