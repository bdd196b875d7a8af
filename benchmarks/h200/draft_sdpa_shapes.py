"""Device check for issue 13's slow eager EAGLE draft (session 8 call 5: 92.9 ms a propose): what one
SDPA call of the eager draft costs when its KV width is new, as the eager path had it (exact widths,
one more column every propose) and as it has it now (widths padded to the graphs' 256-column step).

The shapes are the Llama-3.1-8B EAGLE-3 draft's (32 query heads, 8 KV heads, head dim 128, bf16) in the
chain step's grouped form (`EagleDrafter._attention_padded`: each KV head's 4 query heads as its
query rows, keys [1, W, 8, 128] transposed, a boolean mask). On the H200 torch runs these in cuDNN
(session 7's profiles: `cudnn_generated_fort_native_sdpa_*`), whose plan is built once per new shape.
Rows: ms of each call (synchronized) for widths 1030..1045 exact, the same widths padded (1280), and
exact widths with cuDNN excluded (`sdpa_kernel`), so the cost of a new shape is cuDNN's or not.
The `fresh_prompt_*` rows ask the same of the triton attention backend's prefill of a prompt with no
cached prefix (`_fresh_prompts_sdpa`: causal, no mask, `enable_gqa`, [1, 32, n, 128] queries): ms per
call for prompt lengths not seen before, default backends vs cuDNN excluded, and the kernel names the
default picked (issue 18's online TTFT p99 was 180.8 ms with random prompt lengths: a plan build per new
length would be part of it).

    python benchmarks/h200/draft_sdpa_shapes.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV, D = 32, 8, 128


def call_ms(width: int, real: int) -> float:
    """One grouped chain-step SDPA over `width` columns of which `real` are attended, in ms."""
    q = torch.randn(1, KV, HEADS // KV, D, dtype=torch.bfloat16, device="cuda")
    keys = torch.randn(1, width, KV, D, dtype=torch.bfloat16, device="cuda")
    values = torch.randn_like(keys)
    mask = (torch.arange(width, device="cuda") < real)[None, None, None, :]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def fresh_prompt_ms(n: int) -> float:
    """One causal GQA prefill of an n-token prompt as `_fresh_prompts_sdpa` calls it, in ms."""
    q = torch.randn(n, HEADS, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(n, KV, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                   is_causal=True, scale=D ** -0.5, enable_gqa=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def fresh_prompt_kernels(n: int) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fresh_prompt_ms(n)
    return sorted({e.name[:80] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    widths = list(range(1030, 1046))
    call_ms(256, 200)  # CUDA / cuBLAS / cuDNN initialisation outside the rows
    rows = {
        "exact": [call_ms(w, w) for w in widths],
        "padded_1280": [call_ms(1280, w) for w in widths],
    }
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        rows["exact_without_cudnn"] = [call_ms(w + 100, w + 100) for w in widths]  # widths not seen yet
    fresh_prompt_ms(64)
    rows["fresh_prompt_new_lengths"] = [fresh_prompt_ms(n) for n in range(900, 916)]
    rows["fresh_prompt_same_length"] = [fresh_prompt_ms(915) for _ in range(16)]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        rows["fresh_prompt_new_lengths_without_cudnn"] = [fresh_prompt_ms(n) for n in range(1000, 1016)]
    res = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "widths": widths,
           **{k: [round(v, 3) for v in ms] for k, ms in rows.items()},
           **{f"{k}_median_ms": round(sorted(ms)[len(ms) // 2], 3) for k, ms in rows.items()},
           "fresh_prompt_kernels": fresh_prompt_kernels(1200)}
    print(json.dumps(res), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "draft_sdpa_shapes.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
