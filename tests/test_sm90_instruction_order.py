"""The PDL launches' ordering rules, checked in the sm_90 machine code that Triton's own ptxas makes on
this CPU machine (benchmarks/sm90_kernel_report.py): what may run before `griddepcontrol.wait`
(ACQBULK in SASS) runs before it, and what must wait does. A kernel that touched its counters before
the wait raced a launch of itself on the H100 (session 22: an illegal address); the interpreter
cannot see such an order, the GPU build can."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ("experts_qwen3_gdc1", "router_qwen3_gdc1_trigger1", "decode_split_d128_gqa8_gdc0_trigger0",
           "decode_split_d128_gqa8_gdc1_trigger1", "decode_merge_d128_gdc1", "rotary_store_qwen3_trigger1_gdc1",
           "gemv_8b_o_pdl1")


@pytest.fixture(scope="module")
def sass_dir(tmp_path_factory):
    """The presets' SASS, compiled by the report script in its own process: it must run without
    TRITON_INTERPRET (which this test process sets for the kernels of every other test, and which
    decides at decoration time whether a kernel compiles or interprets)."""
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton carries no ptxas: nothing to cross-compile with")
    out = tmp_path_factory.mktemp("sass")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sm90_kernel_report.py"), *PRESETS,
                           "--sass", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["kernel"]: r for r in map(json.loads, done.stdout.splitlines())}
    for name in PRESETS:
        assert rows[name]["spill_stack_bytes"] == 0, f"{name} spills: {rows[name]}"
    return out


def _sass(sass_dir, name: str) -> list[str]:
    text = (sass_dir / f"{name}.sass").read_text()
    return [ln for ln in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]


def _first(lines: list[str], pattern: str) -> int:
    return next(i for i, ln in enumerate(lines) if re.search(pattern, ln))


def test_experts_kernel_takes_its_ticket_after_the_wait(sass_dir):
    lines = _sass(sass_dir, "experts_qwen3_gdc1")
    wait = _first(lines, r"\bACQBULK\b")
    assert _first(lines, r"\bPREEXIT\b") < wait  # its dependents may launch early
    assert all(not re.search(r"\b(ATOMG|REDG|LDG|STG)\b", ln) for ln in lines[:wait])  # no memory access before


def test_router_loads_its_weights_before_the_wait_and_activations_after(sass_dir):
    lines = _sass(sass_dir, "router_qwen3_gdc1_trigger1")
    wait = _first(lines, r"\bACQBULK\b")
    assert _first(lines, r"\bPREEXIT\b") < wait
    before = [ln for ln in lines[:wait] if re.search(r"\bLDG\b", ln)]
    assert len(before) >= 16  # 2 rows x 2048 bf16 in 16-byte loads per lane (+ norm weight), all issued early
    assert all(not re.search(r"\b(ATOMG|REDG|STG)\b", ln) for ln in lines[:wait])
    assert any(re.search(r"\bLDG\b", ln) for ln in lines[wait:])  # x and the residual


def test_decode_split_prefetches_into_l2_before_the_wait_and_reads_q_after(sass_dir):
    lines = _sass(sass_dir, "decode_split_d128_gqa8_gdc1_trigger1")
    wait = _first(lines, r"\bACQBULK\b")
    assert _first(lines, r"\bPREEXIT\b") < wait  # the merge kernel after it may launch early
    prefetches = [i for i, ln in enumerate(lines) if re.search(r"\bCCTL\.E\.PF2\b", ln)]
    assert prefetches and max(prefetches) < wait
    # before the wait only the batch metadata and the slots are read (no K/V tile copies, no stores)
    assert all(not re.search(r"\b(LDGSTS|STG|ATOMG)\b", ln) for ln in lines[:wait])
    plain = _sass(sass_dir, "decode_split_d128_gqa8_gdc0_trigger0")
    assert not any(re.search(r"\b(ACQBULK|CCTL\.E\.PF2|PREEXIT)\b", ln) for ln in plain)


def test_decode_merge_reads_the_partials_only_after_the_wait(sass_dir):
    """RADIXSERVE_DECODE_MERGE_PDL (session 24): the merge, PDL-launched after the split kernel, reads only the
    request's split count (batch metadata) before the wait; the partials and every store come after it."""
    lines = _sass(sass_dir, "decode_merge_d128_gdc1")
    wait = _first(lines, r"\bACQBULK\b")
    assert sum(bool(re.search(r"\bLDG\b", ln)) for ln in lines[:wait]) <= 1
    assert all(not re.search(r"\b(STG|ATOMG)\b", ln) for ln in lines[:wait])
    assert sum(bool(re.search(r"\bLDG\b", ln)) for ln in lines[wait:]) >= 2  # sum-exps and partial outputs


def test_rotary_store_writes_the_pool_only_after_the_wait(sass_dir):
    """RADIXSERVE_ROTARY_STORE_PDL (session 24): the rotary + KV store kernel, PDL-launched after the qkv GEMV,
    signals its own dependents first, reads slots and positions before the wait, and q/k/v and every pool or
    q store after it."""
    lines = _sass(sass_dir, "rotary_store_qwen3_trigger1_gdc1")
    wait = _first(lines, r"\bACQBULK\b")
    assert _first(lines, r"\bPREEXIT\b") < wait
    assert all(not re.search(r"\b(STG|ATOMG)\b", ln) for ln in lines[:wait])
    assert sum(bool(re.search(r"\bLDG\b", ln)) for ln in lines[:wait]) <= 2  # the slot and the position
    assert any(re.search(r"\bSTG\b", ln) for ln in lines[wait:])


def test_batch1_gemv_streams_its_first_weight_tile_before_the_wait(sass_dir):
    """runtime.batch1_gemv_pdl's tile (session 8): weights (evict-first loads) before the wait, the
    signal to its own dependents and the input row after it."""
    lines = _sass(sass_dir, "gemv_8b_o_pdl1")
    wait = _first(lines, r"\bACQBULK\b")
    assert sum(bool(re.search(r"\bLDG\.E\.EF\b", ln)) for ln in lines[:wait]) >= 4
    assert all(not re.search(r"\b(STG|ATOMG|PREEXIT)\b", ln) for ln in lines[:wait])
    assert _first(lines, r"\bPREEXIT\b") > wait
