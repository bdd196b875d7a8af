"""`radixserve generate`: complete one prompt in process with the ModelRunner (no server).

Runs the prompt as a one-request static batch (`radixserve.static_batch`) and streams the text to
stdout as it is generated."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterator

from radixserve.config import Config
from radixserve.state import SamplingParams


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (a user message with --chat)")
    parser.add_argument("--model", help="HF model directory, a .gguf file or a file another installed weight source "
                        "reads (radixserve plugins lists the suffixes); default: the embedded SmolLM2")
    parser.add_argument("--tokenizer", metavar="PATH", help="tokenizer directory (default: from the model; files "
                        "other than .gguf carry none: model.tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="apply the model's chat template (default on when it has one)")
    parser.add_argument("--config", metavar="FILE", help="YAML component stack (see stacks/)")
    parser.add_argument("--stats", action="store_true",
                        help="print the start-up log (the stack, the weights' path: e.g. a GGUF kept quantized or "
                             "dequantized), load time and tokens/s to stderr")
    parser.add_argument("-p", action="append", metavar="no:PLUGIN", help="do not load this plugin (repeatable)")
    from radixserve.cli_serve import add_model_impl_argument, add_speculative_arguments

    add_model_impl_argument(parser)
    add_speculative_arguments(parser)
    parser.add_argument("overrides", nargs="*", default=[], metavar="section.key=value", help="config overrides")


def generate_ids(runner, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
    """Yield new token ids for one request until EOS (unless ignore_eos), a stop token id or
    max_new_tokens. Frees its KV slots and ReqToTokenPool row when done or abandoned."""
    from radixserve.static_batch import StaticBatch

    if len(prompt_ids) + params.max_new_tokens > runner.context_len:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max tokens ({params.max_new_tokens}) exceed the "
                         f"context length {runner.context_len}")
    steps = StaticBatch(runner, [prompt_ids], params).steps()
    try:
        for (tok,) in steps:
            yield tok
    finally:
        steps.close()  # gives the KV back at once when the caller stops early


def generate_ids_speculative(runner, config, registry, prompt_ids: list[int], params: SamplingParams,
                             summary: list[str]) -> Iterator[int]:
    """Like `generate_ids`, through the in-process Scheduler (speculative verify steps need it). Once done,
    appends its verify statistics to `summary` (the caller prints them after the text's last line)."""
    from radixserve.runtime.messages import GenerateRequest
    from radixserve.scheduler import Scheduler

    sched = Scheduler.from_config(config, runner, registry)
    sched.add_request(GenerateRequest(rid="generate", input_ids=prompt_ids, sampling_params=params, stream=True))
    try:
        while sched.has_work():
            for out in sched.step():
                if out.error:
                    raise ValueError(out.error)
                yield from out.new_ids
    finally:
        sched.abort("generate")  # gives the KV back at once when the caller stops early
        while sched.has_work():
            sched.step()
        sched.flush_cache()
        if sched.drafter is not None and sched.metrics.spec_verifies:
            summary.append(f"[speculative: {sched.metrics.spec_verifies} verify steps, "
                           f"{sched.metrics.spec_accept_length():.2f} tokens per step]")


def split_prompt(first: str, rest: list[str]) -> tuple[str, list[str]]:
    """The prompt and the overrides among the positionals, wherever the prompt stands: argparse gives
    the first positional to the prompt, so `generate --model M stack.policy=lpm "Hi"` would take the
    override for the prompt (and a mistyped override alone would be generated from)."""
    from radixserve.config import ConfigError

    def is_override(arg: str) -> bool:
        key, sep, _ = arg.partition("=")
        return bool(sep) and key.split(".")[0] in Config.model_fields and re.fullmatch(r"\w+(\.\w+)+", key) is not None

    positionals = [first, *rest]
    prompts = [a for a in positionals if not is_override(a)]
    overrides = [a for a in positionals if is_override(a)]
    if len(prompts) != 1:
        given = f"{len(prompts)}: " + ", ".join(repr(p) for p in prompts) if prompts else "none (only config overrides)"
        raise ConfigError(f"radixserve generate takes one prompt, got {given}; quote a prompt with spaces")
    return prompts[0], overrides


def scheduler_only_keys(config: Config) -> list[str]:
    """The stack keys set away from their defaults that only the scheduler reads: `generate` checks them
    like every other key but has no scheduler to use them, so it says so rather than ignore them."""
    defaults = type(config.stack)()
    return [f"stack.{k}" for k in ("prefix_cache", "prefix_cache_options", "policy", "policy_options")
            if getattr(config.stack, k) != getattr(defaults, k)]


def run_generate(args: argparse.Namespace) -> int:
    from radixserve.cli import load_config_from_args
    from radixserve.cli_serve import speculative_overrides
    from radixserve.config import ConfigError, check_cache_dir
    from radixserve.model_runner import ModelRunner
    from radixserve.plugins.registry import Registry
    from radixserve.tokenizer import apply_chat_template

    args.prompt, args.overrides = split_prompt(args.prompt, args.overrides)
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens}: must be at least 1")
    flags = speculative_overrides(args)
    if args.model:
        flags.setdefault("model", {})["path"] = args.model
    if args.tokenizer:
        flags.setdefault("model", {})["tokenizer"] = args.tokenizer
    if args.model_impl:
        flags.setdefault("model", {})["impl"] = args.model_impl
    config = load_config_from_args(args, flags)  # YAML < overrides < flags; -p no:NAME disables a plugin
    if config.runtime.tp_size > 1 or config.runtime.dp_size > 1:
        raise ConfigError(f"radixserve generate runs the model in this one process (runtime.tp_size="
                          f"{config.runtime.tp_size}, runtime.dp_size={config.runtime.dp_size}): use "
                          "`radixserve serve --tp N` / `--dp N`, or Engine(tp_size=N)")
    if args.stats:  # the start-up lines serve logs (stack, weights, KV pool): how this run was set up
        from radixserve.logs import configure_logging

        configure_logging("info", "generate")
    registry = Registry.from_config(config)
    check_cache_dir()  # the native kernels are built there
    start = time.perf_counter()
    runner = ModelRunner(config, registry)  # checks the whole stack before loading the model
    unused = scheduler_only_keys(config)
    if unused:  # checked with the rest of the stack, but this one request never meets a scheduler
        print(f"radixserve generate: note: {', '.join(unused)} not used: generate runs one request "
              "without the scheduler (no policy, no prefix cache); `radixserve serve` and `Engine` use them",
              file=sys.stderr)
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
    summary: list[str] = []  # printed once the text has ended its line (it was glued to the text)
    if config.stack.speculative is not None:
        ids = generate_ids_speculative(runner, config, registry, prompt_ids, params, summary)
    else:
        ids = generate_ids(runner, prompt_ids, params)
    try:
        # a quantization plugin's apply: one line naming it (RADIXSERVE_DEBUG=1: the traceback)
        with runner.quant_hooks_named():
            for t in ids:
                if t in runner.eos_token_ids:
                    break
                out.append(t)
                text = tok.decode(out, skip_special_tokens=True)
                if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                    sys.stdout.write(text[len(printed):])
                    sys.stdout.flush()
                    printed = text
    except KeyboardInterrupt:  # Ctrl-C: what was generated stays printed, no traceback; 130 as shells report it
        sys.stdout.write("\n")
        return 130
    finally:
        if hasattr(ids, "close"):
            ids.close()  # the scheduler's clean-up (and its summary) now, not when the generator is collected
    sys.stdout.write("\n")
    sys.stdout.flush()
    for line in summary:
        print(line, file=sys.stderr)
    if args.stats:
        dt = time.perf_counter() - t0
        print(f"[load {loaded:.1f}s, {len(out)} tokens in {dt:.2f}s, {len(out) / max(dt, 1e-9):.1f} tok/s]",
              file=sys.stderr)
    return 0
