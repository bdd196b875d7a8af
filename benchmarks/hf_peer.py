"""The HF transformers peer: `generate` with a static cache on random weights of a real shape.

    python benchmarks/hf_peer.py --config-dir benchmarks/model-configs/llama-3.1-8b \
        --batch-size 1 128 --input-len 1024 --output-len 256 [--device cuda] [--dtype bfloat16]

For each batch size prints the whole-run output and total (input+output) tok/s of a warmed-up run, as JSON lines (also appended to --result-file)."""

from __future__ import annotations

import argparse
import time

import torch
from bench_env import emit


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-dir", required=True)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1])
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--result-file")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(args.config_dir)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def timed(bs: int, new: int) -> float:
        ids = torch.randint(100, cfg.vocab_size - 100, (bs, args.input_len), device=args.device)
        sync()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, cache_implementation="static", pad_token_id=0)
        sync()
        return time.perf_counter() - t0

    for bs in args.batch_size:
        # a static cache is sized input+new tokens and generate compiles per size: warm up with the
        # very shape that is timed, or the timing includes compilation
        timed(bs, args.output_len)
        tn = timed(bs, args.output_len)
        row = {
            "peer": "hf-transformers-generate-static-cache",
            "batch_size": bs, "input_len": args.input_len, "output_len": args.output_len,
            "output_tok_s": round(bs * args.output_len / tn, 1),
            "total_tok_s": round(bs * (args.input_len + args.output_len) / tn, 1),
            "device": args.device, "dtype": args.dtype,
        }
        emit(row, args.result_file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
