"""GPU greedy parity with transformers for the tiny Qwen2-MoE and Qwen3-MoE checkpoints (tests/family_cases.py):
bf16, triton attention, CUDA graphs, each prompt alone (batch-1 decode, where their MoE layers take the
small path with the post-attention norm inside the router's launch, session 7). Exit 0 when the top-5
rule holds for both.

    python benchmarks/h200/qwen_b1_parity.py"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import gpu_parity  # noqa: E402
from family_cases import MOE_CASES  # noqa: E402
from radixserve.layers.moe import small_m  # noqa: E402
from radixserve.testing import tiny_checkpoint  # noqa: E402

_greedy = gpu_parity.greedy_generate
CALLS = {"norm_in_router": 0}


def one_at_a_time(runner, prompts, new_tokens, keep_logits=False):
    """Each prompt alone: batch-1 decode steps, which take the small MoE path (few experts here)."""
    return [_greedy(runner, [p], new_tokens, keep_logits=keep_logits)[0] for p in prompts]


def counted(fn):
    def wrapper(*args, **kwargs):
        CALLS["norm_in_router"] += 1
        return fn(*args, **kwargs)
    return wrapper


gpu_parity.greedy_generate = one_at_a_time
small_m.fused_norm_gate_select_experts = counted(small_m.fused_norm_gate_select_experts)


def main() -> int:
    args = argparse.Namespace(device="cuda", dtype="bfloat16", attention="triton", disable_cuda_graph=False,
                              gguf=None, skip_tiny=False, dump_tokens=None, decode_fusions_ab=False,
                              batch1_gemv_all=False, families=True, deepseek=False)
    gen = torch.Generator().manual_seed(2)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            model_type, overrides = MOE_CASES[name]
            path = tiny_checkpoint(model_type, os.path.join(tmp, name), **overrides)
            vocab = gpu_parity.config_vocab_size(path)
            prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 31, 2, 17)]
            ok &= gpu_parity.compare(name, path, prompts, 24, args, hf_kwargs={"attn_implementation": "eager"})
    # graphs capture each call once: the count shows the fused norm was part of the decode steps
    print(f"qwen moe parity {'ok' if ok else 'FAILED'}; norm-in-router calls (eager + captures): "
          f"{CALLS['norm_in_router']}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
