"""Issue 14's fidelity target on the GPU: for each quantization format, the greedy tokens of a tiny
quantized checkpoint equal those of the same model with its weights dequantized (top-5 rule at a
divergence), both run the same way on CUDA (bf16, triton attention, CUDA graphs), with the low-bit
GEMVs (`runtime.lowbit_gemv`) on and off. The checkpoints are the CPU tests' (tests/quant_fixtures.py).

    python benchmarks/h200/quant_fidelity.py [--out DIR]    (writes quant_fidelity.json; ~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from hf_reference import first_divergence, top5_rule_holds  # noqa: E402
from radixserve.config import Config  # noqa: E402
from radixserve.model_runner import ModelRunner  # noqa: E402
from radixserve.testing import tiny_checkpoint  # noqa: E402
from runner_driver import greedy_generate  # noqa: E402

from tests import quant_fixtures as qf  # noqa: E402

FORMATS = [("awq", 64, {}), ("gptq", 32, {"act_order": True}), ("gptq", 64, {"sym": True}),
           ("fp8_block", 128, {}), ("fp8_tensor", 128, {})]


def runner(path: str, lowbit: str, device: str) -> ModelRunner:
    cuda = device == "cuda"
    return ModelRunner(Config.build({
        "model": {"path": path},
        "runtime": {"device": device, "dtype": "bfloat16" if cuda else "float32", "lowbit_gemv": lowbit},
        "stack": {"attention": "triton" if cuda else "torch_native"},
        "scheduler": {"max_total_tokens": 4096, "max_running_requests": 16},
    }), show_progress=False)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--kernel-config", help="int4 kernel configs to use (benchmarks/h200_quant.py --kernel-config)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts run together (lengths 6, 11, 29, 64 over and "
                    "over): more than 4 decode through the int4 tensor-core GEMM instead of the GEMV")
    args = ap.parse_args()
    if args.kernel_config:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from h200_quant import apply_kernel_config

        apply_kernel_config(args.kernel_config)
    rows, ok_all = [], True
    with tempfile.TemporaryDirectory() as tmp:
        src = tiny_checkpoint("llama", os.path.join(tmp, "float"), tie_word_embeddings=False, **qf.TINY_QUANT_CONFIG)
        for fmt, group, opts in FORMATS:
            name = f"{fmt} g{group} {opts or ''}".strip()
            quant, ref = os.path.join(tmp, f"{fmt}{group}q"), os.path.join(tmp, f"{fmt}{group}r")
            qf.write_quantized_checkpoint(src, quant, ref, fmt, group, **opts)
            want_runner = runner(ref, "off", args.device)
            gen = torch.Generator().manual_seed(3)
            prompts = [torch.randint(0, want_runner.vocab_size, (n,), generator=gen).tolist()
                       for n in [(6, 11, 29, 64)[i % 4] for i in range(args.prompts)]]
            want = greedy_generate(want_runner, prompts, args.new_tokens, keep_logits=True)
            del want_runner
            for lowbit in ("off", "on") if args.device == "cuda" else ("off",):
                got_runner = runner(quant, lowbit, args.device)
                got = greedy_generate(got_runner, prompts, args.new_tokens, keep_logits=True)
                graphs = bool(getattr(got_runner, "last_run_used_cuda_graph", False))
                del got_runner
                same = sum(g.tokens == w.tokens for g, w in zip(got, want))
                rule = all(top5_rule_holds(g.tokens, g.logits, w.tokens, w.logits) for g, w in zip(got, want))
                divergences = [first_divergence(g.tokens, w.tokens) for g, w in zip(got, want)]
                ok_all &= rule
                row = {"format": name, "lowbit_gemv": lowbit, "identical": f"{same}/{len(prompts)}",
                       "top5_rule": rule, "first_divergence": divergences, "cuda_graph": graphs}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"SUMMARY {'ok' if ok_all else 'BROKEN'}: {len(rows)} runs, top-5 rule "
          f"{'holds in all' if ok_all else 'broken in some'}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quant_fidelity.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "rows": rows}, f, indent=1)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
