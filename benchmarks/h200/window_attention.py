"""Sliding-window and soft-capped attention in the triton backend on the H200 (issue 16).

Correctness: the backend against torch_native on the same pool, bf16, for decode (many KV splits)
and long extends, with windows shorter than the contexts and a logit cap. Speed: decode and extend
kernel time with and without a 4096-token window at 32k context (a window must cut the time
roughly by context / window, since it skips the keys outside it). Writes $OUT/window_attention.json.
Run from the repo root after `source benchmarks/h200/setup.sh`: python3 benchmarks/h200/window_attention.py
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from radixserve.memory.kv_pool import KVPool
from radixserve.memory.req_to_token import ReqToTokenPool
from radixserve.state import ForwardBatch, ForwardMode
from radixserve_attention_torch_native.backend import TorchNativeBackend
from radixserve_attention_triton.backend import TritonAttentionBackend

DEV, DT = "cuda", torch.bfloat16
H, KVH, D = 32, 8, 128


@dataclass
class Layer:
    layer_id: int = 0
    num_heads: int = H
    num_kv_heads: int = KVH
    head_dim: int = D
    scaling: float = D**-0.5
    sliding_window: int | None = None
    logit_cap: float | None = None


def problem(prefix: list[int], ext: list[int], mode: ForwardMode):
    seq = [p + e for p, e in zip(prefix, ext)]
    slots = sum(seq) + 1
    pool = KVPool(slots, 1, KVH, D, DT, DEV)
    table = ReqToTokenPool(len(seq), max(seq), DEV)
    perm = (torch.randperm(slots - 1) + 1).to(DEV)
    out_loc, at = [], 0
    for i, (p, s) in enumerate(zip(prefix, seq)):
        table.write(i, 0, perm[at : at + s])
        pool.set_kv(0, perm[at : at + p], torch.randn(p, KVH, D, device=DEV), torch.randn(p, KVH, D, device=DEV))
        out_loc.append(perm[at + p : at + s])
        at += s
    n = sum(ext)
    info = SimpleNamespace(device=DEV, dtype=DT, num_heads=H, num_kv_heads=KVH, head_dim=D, max_bs=len(seq),
                           req_to_token_pool=table, kv_pool=pool)
    backend = TritonAttentionBackend(info)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEV)  # noqa: E731
    batch = ForwardBatch(mode=mode, batch_size=len(seq), input_ids=torch.zeros(n, dtype=torch.int64, device=DEV),
                         positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq)]).to(DEV),
                         req_pool_indices=t(list(range(len(seq)))), seq_lens=t(seq), prefix_lens=t(prefix),
                         extend_lens=t(ext), out_cache_loc=torch.cat(out_loc), req_to_token_pool=table, kv_pool=pool,
                         attn_backend=backend, seq_lens_cpu=seq, prefix_lens_cpu=prefix, extend_lens_cpu=ext)
    q = torch.randn(n, H * D, device=DEV, dtype=DT)
    k, v = (torch.randn(n, KVH * D, device=DEV, dtype=DT) for _ in range(2))
    return backend, batch, q, k, v


def run(backend, batch, q, k, v, layer):
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, layer, batch)


def timed(fn, *args, reps=20) -> float:
    fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "checks": [], "timings_ms": {}}
    for mode, prefix, ext in ((ForwardMode.DECODE, [1, 300, 5000, 9000], [1] * 4),
                              (ForwardMode.EXTEND, [0, 700, 3000], [2000, 1, 1500])):
        for window, cap in ((256, None), (1024, 30.0), (None, 50.0), (1, None)):
            b, batch, q, k, v = problem(prefix, ext, mode)
            layer = Layer(sliding_window=window, logit_cap=cap)
            got = run(b, batch, q, k, v, layer).float()
            native = TorchNativeBackend()
            native.init_forward_metadata(batch)
            want = native.forward(q.float(), k.float(), v.float(), layer, batch)
            rel = ((got - want).norm() / want.norm()).item()
            results["checks"].append({"mode": mode.name, "window": window, "cap": cap, "rel_err": rel, "ok": rel < 2e-2})
    for mode, prefix, ext in ((ForwardMode.DECODE, [32768] * 32, [1] * 32), (ForwardMode.EXTEND, [24576], [8192])):
        b, batch, q, k, v = problem(prefix, ext, mode)
        for window in (None, 4096):
            layer = Layer(sliding_window=window)
            results["timings_ms"][f"{mode.name} window={window}"] = timed(run, b, batch, q, k, v, layer)
    print(json.dumps(results, indent=1))
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "window_attention.json"), "w") as f:
        json.dump(results, f, indent=1)
    assert all(c["ok"] for c in results["checks"]), "a windowed / capped case differs from torch_native"


if __name__ == "__main__":
    main()
