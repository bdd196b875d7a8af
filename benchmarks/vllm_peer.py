"""The vLLM-CPU peer: offline generate on token-id prompts, run with vLLM's own venv.

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \
        benchmarks/.peers/vllm-venv/bin/python benchmarks/vllm_peer.py --model HF_DIR --prompts prompts.json \
        --output-len 128

`prompts.json` is a list of token-id lists (benchmarks/engine_throughput.py writes it). Prints one
JSON line: seconds, output tokens, output tok/s (load and a warm-up request excluded)."""

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.load(open(args.prompts))]
    llm = LLM(model=args.model, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"peer": "vllm-cpu", "seconds": dt, "output_tokens": n_out, "tok_s": n_out / dt}), flush=True)


if __name__ == "__main__":
    main()
