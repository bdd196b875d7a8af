"""DeepSeek (latent attention + MoE) greedy parity with transformers on the GPU: the plugin's tiny
V2-Lite / V2 / V3 checkpoints (plugins/models/deepseek/tests/deepseek_cases.py) through our runner
(a latent-attention backend, CUDA graphs) against HF eager on the same device and dtype, top-5 rule.

    python benchmarks/h200/deepseek_parity.py [--attention mla_triton] [--dtype bfloat16]

Prints one line per prompt and a SUMMARY per case (benchmarks/gpu_parity.py's `compare`); exits
non-zero if any prompt breaks the top-5 rule."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "tests"),
                os.path.join(ROOT, "plugins", "models", "deepseek", "tests")]
from deepseek_cases import CASES, write_checkpoint  # noqa: E402
from gpu_parity import compare, config_vocab_size  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention", default=None, help="stack.attention (default: the device's default backend)")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(2)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for case in sorted(CASES):
            path = write_checkpoint(case, os.path.join(tmp, case))
            vocab = config_vocab_size(path)
            prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 31, 2, 17)]
            ok &= compare(f"deepseek-{case}", path, prompts, 24, args, hf_kwargs={"attn_implementation": "eager"})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
