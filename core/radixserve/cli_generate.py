"""`radixserve generate`: complete one prompt in process with the ModelRunner (no server).

A deliberately small loop (prefill, then decode until EOS or --max-tokens); the Engine replaces it
once it exists. Text is streamed to stdout as it is generated."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator

import torch

from radixserve.state import ForwardMode, Req, SamplingParams, ScheduledBatch


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (a user message with --chat)")
    parser.add_argument("--model", help="HF model directory or .gguf file (default: the embedded SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="apply the model's chat template (default on when it has one)")
    parser.add_argument("--config", metavar="FILE", help="YAML component stack (see stacks/)")
    parser.add_argument("--stats", action="store_true", help="print load time and tokens/s to stderr")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")


def generate_ids(runner, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
    """Yield new token ids for one request until EOS (unless ignore_eos) or max_new_tokens.
    Frees its KV slots and ReqToTokenPool row when done or abandoned."""
    pool, alloc = runner.req_to_token_pool, runner.token_allocator
    if len(prompt_ids) + params.max_new_tokens > runner.context_len:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max tokens ({params.max_new_tokens}) exceed the "
                         f"context length {runner.context_len}")
    req = Req(rid="cli", origin_input_ids=list(prompt_ids), sampling_params=params,
              eos_token_ids=runner.eos_token_ids)
    row = pool.alloc()
    held: list[torch.Tensor] = []
    try:
        new, kv_len, mode = list(prompt_ids), 0, ForwardMode.EXTEND
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(runner.eos_token_ids))
        for _ in range(params.max_new_tokens):
            slots = alloc.alloc(len(new))
            if slots is None:
                raise RuntimeError("KV cache is full; raise scheduler.max_total_tokens or cpu_kv_cache_gb")
            held.append(slots)
            pool.write(row, kv_len, slots)
            sb = ScheduledBatch(mode=mode, reqs=[req], input_ids=new, req_pool_indices=[row], prefix_lens=[kv_len],
                                extend_lens=[len(new)], out_cache_loc=slots)
            tok = runner.run_batch(sb).next_token_ids[0]
            kv_len += len(new)
            req.output_ids.append(tok)
            yield tok
            if tok in stops and len(req.output_ids) >= params.min_new_tokens:
                return
            new, mode = [tok], ForwardMode.DECODE
    finally:
        pool.free(row)
        for s in held:
            alloc.free(s)


def run_generate(args: argparse.Namespace) -> int:
    from radixserve.config import Config, parse_dotted_overrides
    from radixserve.model_runner import ModelRunner
    from radixserve.plugins.registry import Registry
    from radixserve.tokenizer import apply_chat_template

    overrides = parse_dotted_overrides(args.overrides or [])
    if args.model:
        overrides.setdefault("model", {})["path"] = args.model
    config = Config.load(args.config, overrides)
    registry = Registry.from_config(config)
    start = time.perf_counter()
    runner = ModelRunner(config, registry)  # checks the whole stack before loading the model
    tok = runner.tokenizer
    loaded = time.perf_counter() - start
    if args.chat and getattr(tok, "chat_template", None):
        prompt_ids = apply_chat_template(tok, [{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tok.encode(args.prompt)
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    params.validate()
    out: list[int] = []
    printed = ""
    t0 = time.perf_counter()
    for t in generate_ids(runner, prompt_ids, params):
        if t in runner.eos_token_ids:
            break
        out.append(t)
        text = tok.decode(out, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    sys.stdout.write("\n")
    if args.stats:
        dt = time.perf_counter() - t0
        print(f"[load {loaded:.1f}s, {len(out)} tokens in {dt:.2f}s, {len(out) / max(dt, 1e-9):.1f} tok/s]",
              file=sys.stderr)
    return 0
