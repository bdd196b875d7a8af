"""benchmarks/kernel_frontier.py: a profiled step's time attributed to the kernels its chain waits on (PDL-launched
kernels are resident long before they work, so their device times over-count)."""

from __future__ import annotations

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from kernel_frontier import frontier_attribution, frontier_rows  # noqa: E402


def test_a_pdl_chain_credits_each_kernel_with_its_advance_not_its_residency():
    # b is resident from 1 (launched early, waiting) but finishes 4 after a; c starts after a gap
    credits, idle = frontier_attribution([("a", 0.0, 10.0), ("b", 1.0, 14.0), ("c", 16.0, 17.0)])
    assert credits == {"a": 10.0, "b": 4.0, "c": 1.0}
    assert idle == 2.0


def test_a_kernel_in_another_ones_shadow_gets_nothing_and_names_add_up():
    credits, idle = frontier_attribution([("x", 0.0, 10.0), ("y", 2.0, 9.0), ("x", 10.0, 12.0)])
    assert credits == {"y": 9.0, "x": 3.0} and idle == 0.0  # y finished first: the frontier's first cut is its
    assert frontier_attribution([]) == ({}, 0.0)


@pytest.mark.parametrize("seed", range(5))
def test_credits_and_idle_add_up_to_the_span(seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(200):
        start = rng.uniform(0, 1000)
        rows.append((rng.choice("abcde"), start, start + rng.expovariate(0.1)))
    credits, idle = frontier_attribution(rows)
    span = max(e for _, _, e in rows) - min(s for _, s, _ in rows)
    assert sum(credits.values()) + idle == pytest.approx(span)
    assert all(v >= 0 for v in credits.values()) and idle >= 0
    # idle is exactly the time no interval covers
    covered = sum(hi - lo for lo, hi in _merged(rows))
    assert idle == pytest.approx(span - covered)
    assert frontier_rows(rows, steps=2)["span_ms"] == pytest.approx(span / 2e3, abs=1e-4)


def _merged(rows):
    out = []
    for _, s, e in sorted(rows, key=lambda r: r[1]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out
