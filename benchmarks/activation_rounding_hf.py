#!/usr/bin/env python3
"""transformers' own fp32 SmolLM2 with each linear's input rounded as the GGUF kept-block kernels
round it (per 32-input block, scale amax / (2^(bits-1) - 1)): which greedy chat answers move with
int8 and with int16 activations, independent of our kernels (docs/quantization.md).

    python benchmarks/smollm2_hf.py                       # .models/smollm2-135m-instruct
    python benchmarks/activation_rounding_hf.py [--model DIR] [--new-tokens 16]

Prints, per question, the answer with no rounding, int8 and int16."""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2+2?",
             "Who wrote Romeo and Juliet?", "What is the largest planet in our solar system?"]


def rounded(x: torch.Tensor, bits: int) -> torch.Tensor:
    blocks = x.reshape(-1, 32)
    top = 2 ** (bits - 1) - 1
    scale = blocks.abs().amax(-1, keepdim=True) / top
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return ((blocks / scale).round().clamp(-top, top) * scale).reshape(x.shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=".models/smollm2-135m-instruct")
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    bits = {"value": 0}  # 0: no rounding

    def round_input(_module, inputs):
        return (rounded(inputs[0], bits["value"]),) if bits["value"] else None

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":  # the decoder linears the kernels run
            module.register_forward_pre_hook(round_input)
    for question in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        print(question)
        for b in (0, 8, 16):
            bits["value"] = b
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
            print(f"  {'fp32' if b == 0 else f'int{b}':>5}: {tok.decode(out[0, ids.shape[1]:])!r}")


if __name__ == "__main__":
    main()
