"""A/B in one process: torch_native's extend of whole prompts (no cached prefix) with SDPA's own causal
mask (is_causal, the default since session 20) vs the same mask given as a bool tensor; alternating rounds of
4 prompts x 500 tokens (past cpu_batched's native extend limit of 256), logits compared.

    python benchmarks/cpu_causal_mask_ab.py [float32|bf16]"""

from __future__ import annotations

import sys
import time

import torch
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from radixserve.state import SamplingParams
from radixserve.static_batch import run_static_batch
from radixserve_attention_torch_native import backend as tn

dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
over = {"runtime": {"device": "cpu", "num_threads": 2}, "model": {"path": ".models/smollm2-135m-instruct"},
        "scheduler": {"max_total_tokens": 8192}}
if dtype == "bf16":
    over["runtime"].update(cpu_matmul_precision="medium", kv_cache_dtype="bfloat16")
runner = ModelRunner(Config.build(over), show_progress=False)
orig = tn.TorchNativeBackend.init_forward_metadata
MODE = {"causal": True}
def patched(self, batch):
    orig(self, batch)
    if not MODE["causal"] and isinstance(batch.attn_metadata, list):
        for v in batch.attn_metadata:
            v.plain_causal = False
tn.TorchNativeBackend.init_forward_metadata = patched
g = torch.Generator().manual_seed(0)
def prompts(seed, n=4, L=500):
    g.manual_seed(seed)
    return [torch.randint(100, 40000, (L,), generator=g).tolist() for _ in range(n)]
sp = SamplingParams(temperature=0.0, ignore_eos=True)
run_static_batch(runner, prompts(99), sp, 1)  # warm-up
res = {True: [], False: []}
outs = {}
for r in range(6):
    for mode in (True, False) if r % 2 == 0 else (False, True):
        MODE["causal"] = mode
        t0 = time.perf_counter()
        o = run_static_batch(runner, prompts(r), sp, 1, keep_logits=True)
        res[mode].append(time.perf_counter() - t0)
        outs.setdefault(r, []).append(o.logits)
for mode in (True, False):
    print(dtype, "is_causal" if mode else "bool mask", f"median {sorted(res[mode])[3]:.3f} s", [round(x, 3) for x in res[mode]])
d = max((a - b).abs().max().item() for r in outs for la, lb in [outs[r]] for a, b in zip(sum(la, []), sum(lb, [])))
print("max logit diff", d)
