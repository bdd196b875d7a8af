"""The model parity sweep: every causal-LM architecture transformers can build, run through RadixServe
and through transformers on the same tiny random checkpoint, judged by the top-5 rule.

The architectures come from transformers' own auto mappings (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`:
model type -> class), not from a hand list. For each model type the sweep

1. builds a tiny config from the config class's defaults with the size fields shrunk (`tiny_config`),
   skipping, with a reason, what is not a text decoder (multimodal wrappers);
2. saves a random checkpoint of it (`build_checkpoint`);
3. picks the model class RadixServe would (`radixserve.plugins.model_select.select_model`, under
   `model.impl: auto`: the native plugin if one claims the architecture, else the transformers
   fallback), and runs `check_model_parity` (chunked prefill in mixed batches, a prefix-cache hit,
   decode) on the default CPU attention backend;
4. classifies the outcome: `pass`; `skip` (not a decoder-only text model); `unsupported` (a
   feature the fallback refuses, named); `transformers` (transformers itself is inconsistent or
   cannot build/run the model: e.g. its cached and uncached greedy outputs differ); `ours` (any
   other failure: a bug or gap on RadixServe's side, or in the sweep's tiny configs).

Run it: `python -m radixserve.testing.sweep [--only llama,gpt2] [--markdown PATH] [--jsonl PATH]`
(benchmarks/model_sweep.py writes docs/supported-models.md with it). Each architecture runs in a
worker process with a time limit, so a crash or a hang is one classified row, not a lost sweep."""

from __future__ import annotations

import argparse
import copy
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass

STATUSES = ("pass", "unsupported", "transformers", "ours", "skip")

# size fields shrunk in every config that has them (value: the tiny size)
_SIZES = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "model_dim", "embed_dim", "n_embed"), 64),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "inner_hidden_size", "d_ff",
                     "decoder_ffn_dim", "hidden_dim", "ffn_intermediate_size"), 128),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads"), 4),
    "head_dim": 16, "rotary_dim": 8,
    **dict.fromkeys(("vocab_size", "encoder_hash_byte_group_vocab"), 512),
    "hidden_size_global": 64,  # BLT's local models project to the global model's hidden size
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length",
                     "max_sequence_length"), 512),
    # mixture of experts
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_selected_experts"), 2),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"), 64),
    **dict.fromkeys(("n_group", "topk_group", "first_k_dense_replace"), 1),
    # multi-head latent attention
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    # layers that reuse an earlier layer's KV (Gemma 3n): keep one so the sharing is exercised
    "num_kv_shared_layers": 1,
}
# counts a family may restrict (ZAYA routes to one expert only): shrunk, never raised above the default
_NEVER_RAISE = ("num_experts_per_tok", "moe_topk", "num_selected_experts", "num_kv_shared_layers")
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_KV_HEAD_FIELDS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv")
_SUB_CONFIG_MARKERS = ("vision_config", "audio_config", "vision_tower_config", "image_config", "speech_config")


class Skip(Exception):
    """The model type is not a text decoder the sweep can run (the message says why)."""


@dataclass
class SweepResult:
    model_type: str
    architecture: str
    path: str  # "native (<plugin>)", "fallback", or "" when it never got that far
    status: str  # one of STATUSES
    why: str  # empty for a pass
    seconds: float = 0.0


# ---- building tiny checkpoints -------------------------------------------------------------------
def causal_lm_architectures() -> list[tuple[str, str]]:
    """(model type, class name) for every entry of transformers' causal-LM auto mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        out.append((model_type, cls if isinstance(cls, str) else cls[0]))
    return sorted(out)


def tiny_config(model_type: str):
    """The config class's defaults with every known size field shrunk (see `_SIZES`); raises Skip
    for a multimodal wrapper (its text model has its own model type when transformers maps one)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    subs = [m for m in _SUB_CONFIG_MARKERS if getattr(default, m, None) is not None]
    if subs or getattr(default, "text_config", None) is not None:
        raise Skip(f"multimodal model (has {', '.join(subs) or 'text_config'}); not a text decoder on its own")
    over = _shrunk_fields(default)
    for name in getattr(default, "sub_configs", None) or {}:  # nested text configs (BLT's local/global models)
        sub = getattr(default, name, None)
        fields = _shrunk_fields(sub) if sub is not None and hasattr(sub, "to_dict") else {}
        if fields:
            over[name] = copy.deepcopy(sub)
            for k, v in fields.items():
                setattr(over[name], k, v)
    for k in _NEVER_RAISE:
        if k in over and isinstance(getattr(default, k), int):
            over[k] = min(over[k], getattr(default, k))
    if _has(default, "expand") and {"num_heads", "head_dim", "hidden_size"} <= over.keys():
        # state-space heads (Mamba 2) must tile hidden_size * expand exactly
        over["num_heads"] = over["hidden_size"] * int(default.expand) // over["head_dim"]
    if getattr(default, "languages", None) and _has(default, "default_language") and default.default_language is None:
        over["default_language"] = default.languages[0]  # X-MOD: a forward without lang_ids uses it
    if _has(default, "qk_rope_head_dim"):  # latent attention: its rotary part is the head size rotary sees
        over["head_dim"] = _SIZES["qk_rope_head_dim"]
    if _has(default, "is_decoder"):
        over["is_decoder"] = True  # an encoder family's causal-LM head: the decoder use
    if _has(default, "initializer_range"):
        over["initializer_range"] = 0.1  # peaked logits: fewer near-ties for greedy comparisons
    window = getattr(default, "sliding_window", None)
    if isinstance(window, int) and window < 64:
        over["sliding_window"] = 64  # longer than every sweep sequence: the runner caps context to it
    for name in dir(default):  # special token ids inside the tiny vocabulary
        if name.endswith("_token_id") and not name.startswith("_"):
            value = getattr(default, name, None)
            if isinstance(value, int) and value >= 512:
                over[name] = 3
            elif isinstance(value, list) and any(isinstance(v, int) and v >= 512 for v in value):
                over[name] = [3]
    over["architectures"] = None
    try:
        return AutoConfig.for_model(model_type, **over)
    except Exception as e:  # the shrunk sizes break a constraint of the config class
        first = e
    # per-layer pattern fields (layer types, block lists) must match the layer count: keep the default count
    keep_layers = {k: v for k, v in over.items() if k not in _LAYER_FIELDS}
    try:
        return AutoConfig.for_model(model_type, **keep_layers)
    except Exception:
        raise _ConfigError(f"tiny config rejected: {first!r}") from first


def _shrunk_fields(config) -> dict:
    """The size fields of `config` shrunk (`_SIZES`), KV heads keeping their relation to the heads
    (multi-query stays 1, as many as the heads stays equal, else 2 groups)."""
    over = {k: v for k, v in _SIZES.items() if _has(config, k) and not _derived(config, k)}
    heads = over.get("num_attention_heads", 4)
    for field in _KV_HEAD_FIELDS:
        if _has(config, field) and isinstance(getattr(config, field), int):
            d_heads = _first_int(config, ("num_attention_heads", "n_head", "num_heads"))
            kv = getattr(config, field)
            over[field] = 1 if kv == 1 else (heads if kv == d_heads else 2)
    return over


class _ConfigError(Exception):
    pass


def _has(config, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:
        return False


def _derived(config, name: str) -> bool:
    """A read-only property computed from other fields, or one whose setter refuses every value
    (XLNet's max_position_embeddings: it has no length limit)."""
    attr = getattr(type(config), name, None)
    if not isinstance(attr, property):
        return False
    if attr.fset is None:
        return True
    try:
        attr.fset(copy.copy(config), getattr(config, name))
    except Exception:
        return True
    return False


def _first_int(config, names: Iterable[str]) -> int | None:
    for n in names:
        v = getattr(config, n, None) if _has(config, n) else None
        if isinstance(v, int):
            return v
    return None


def build_checkpoint(model_type: str, path: str, seed: int = 0) -> str:
    """Save a tiny random checkpoint of `model_type` to `path` (float32 safetensors); 1-D
    parameters (norm weights, biases) are perturbed so their loading is checked. Returns the
    architecture name written to its config."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1 and p.dtype.is_floating_point:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    model.config.architectures = [type(model).__name__]
    model.eval()
    with torch.inference_mode():  # transformers itself must run it
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    model.save_pretrained(path)
    return type(model).__name__


# ---- running one architecture ----------------------------------------------------------------
def run_one(model_type: str, workdir: str, impl: str = "auto") -> SweepResult:
    """Build, run and classify one model type (in this process)."""
    import torch

    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only contend (restored on return)
    try:
        return _run_one(model_type, workdir, impl, start)
    finally:
        torch.set_num_threads(threads)


def _run_one(model_type: str, workdir: str, impl: str, start: float) -> SweepResult:
    arch, path = "", ""

    def done(status: str, why: str) -> SweepResult:
        return SweepResult(model_type, arch, path, status, why[:300], round(time.perf_counter() - start, 1))

    try:
        ckpt = os.path.join(workdir, model_type)
        arch = build_checkpoint(model_type, ckpt)
    except Skip as e:
        return done("skip", str(e))
    except _ConfigError as e:
        return done("ours", f"sweep: {e}")
    except Exception as e:
        return done(*_classify_build_failure(model_type, e))
    try:
        from radixserve.plugins.model_select import select_model
        from radixserve.plugins.registry import Registry

        choice = select_model(Registry.discover(), arch, impl)
        path = "fallback" if choice.fallback else f"native ({choice.spec.plugin})"
    except Exception as e:
        return done("ours", f"no model class: {e}")
    try:
        _parity(choice.cls, ckpt)
    except Exception as e:
        return done(*_classify_run_failure(ckpt, e))
    return done("pass", "")


def _parity(model_cls, ckpt: str) -> None:
    from radixserve.testing.model import check_model_parity

    check_model_parity(model_cls, ckpt, attention=_attention_backend(getattr(model_cls, "attention_type", "standard")))


def _attention_backend(attention_type: str = "standard"):
    """The attention backend the runner picks on this machine (CPU) for a model of this
    `attention_type`: the highest-priority one that supports it (latent models: not cpu_batched)."""
    from radixserve.plugins.registry import Registry
    from radixserve.plugins.stack import default_attention

    reg = Registry.discover()
    spec = default_attention(reg, "cpu", attention_type)
    return reg.load("attention", spec.name)


def _classify_build_failure(model_type: str, err: Exception) -> tuple[str, str]:
    """transformers failed to build or save the tiny model: its own bug if the unshrunk default
    config fails too (built on the meta device), else the sweep's shrinking is to blame."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    except Exception as e2:
        return "transformers", f"cannot build from its default config: {_short(e2)}"
    return "ours", f"sweep: tiny model failed to build: {_short(err)}"


def _classify_run_failure(ckpt: str, err: Exception) -> tuple[str, str]:
    feature = getattr(err, "feature", None)
    if feature == "probe-forward":  # transformers runs it (checked when built); the fallback does not
        return "ours", f"{feature}: {err}"
    if feature is not None:
        return "unsupported", f"{feature}: {err}"
    if isinstance(err, AssertionError):
        hf_issue = _hf_self_inconsistency(ckpt)
        if hf_issue:
            return "transformers", hf_issue
        return "ours", f"parity: {_short(err)}"
    return "ours", f"error: {_short(err)}"


def _hf_self_inconsistency(ckpt: str, n: int = 8) -> str | None:
    """Does transformers disagree with itself (cached greedy decode vs recomputing the whole sequence
    without a cache) beyond the top-5 rule? Then a parity failure says nothing about us."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        vocab = model.config.vocab_size
        for length in (5, 13):
            prompt = [random.Random(length).randrange(vocab) for _ in range(length)]
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([prompt]), use_cache=True)
                ids = list(prompt)
                for _ in range(n):
                    cached = out.logits[0, -1].float()
                    full = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
                    a, b = int(cached.argmax()), int(full.argmax())
                    if a != b and not (a in full.topk(5).indices.tolist() and b in cached.topk(5).indices.tolist()):
                        return f"transformers' cached decode and its uncached forward disagree (prompt length {length})"
                    ids.append(a)
                    out = model(input_ids=torch.tensor([[a]]), past_key_values=out.past_key_values, use_cache=True)
    except Exception as e:
        return f"transformers' own cached decode fails: {_short(e)}"
    return None


def _short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text[:240]


# ---- the sweep: worker processes with a time limit -------------------------------------------
def _worker(workdir: str, impl: str) -> None:
    """Read model types from stdin, one per line; print one JSON result per line."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for line in sys.stdin:
        model_type = line.strip()
        if not model_type:
            continue
        try:
            result = run_one(model_type, workdir, impl)
        except BaseException as e:  # never lose the worker's protocol
            result = SweepResult(model_type, "", "", "ours", f"sweep crashed: {_short(e)}\n{traceback.format_exc()}")
        print("RESULT " + json.dumps(asdict(result)), flush=True)


def sweep(model_types: list[str], *, timeout: float = 300.0, impl: str = "auto",
          workdir: str | None = None) -> Iterator[SweepResult]:
    """Run `model_types` in a worker process (restarted after a crash or a timeout); yield results
    in order. A model type that kills or hangs the worker is an `ours` row naming that."""
    workdir = workdir or tempfile.mkdtemp(prefix="radixserve-sweep-")
    pending = list(model_types)
    while pending:
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.testing.sweep", "--worker", "--workdir", workdir, "--impl", impl],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
        )
        try:
            while pending:
                current = pending[0]
                proc.stdin.write(current + "\n")
                proc.stdin.flush()
                result = _read_result(proc, timeout)
                pending.pop(0)
                if result is None:
                    why = "timed out" if proc.poll() is None else f"worker died (exit {proc.returncode})"
                    yield SweepResult(current, "", "", "ours", f"sweep: {why} after {timeout:.0f} s limit", timeout)
                    break
                yield result
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _read_result(proc: subprocess.Popen, timeout: float) -> SweepResult | None:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            return None
        line = proc.stdout.readline()
        if not line:
            return None  # the worker died
        if line.startswith("RESULT "):
            return SweepResult(**json.loads(line[len("RESULT "):]))


# ---- the report ------------------------------------------------------------------------------
def summary(results: list[SweepResult]) -> dict[str, int]:
    counts = {s: 0 for s in STATUSES}
    for r in results:
        counts[r.status] += 1
    return counts


def render_markdown(results: list[SweepResult], header: str) -> str:
    """The generated doc page: `header` (how it was made), the counts, then one row per model type."""
    counts = summary(results)
    native = sum(1 for r in results if r.status == "pass" and r.path.startswith("native"))
    lines = [header.rstrip(), "", "## Results", "",
             f"**{counts['pass']} architectures pass** ({native} through a native plugin, "
             f"{counts['pass'] - native} through the transformers fallback); "
             f"{counts['unsupported']} use a feature the fallback does not run yet, {counts['transformers']} fail "
             f"inside transformers, {counts['ours']} fail on RadixServe's side, {counts['skip']} are not "
             "decoder-only text models.", "",
             "| model type | architecture | path | result | why |", "|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (STATUSES.index(r.status), r.model_type)):
        why = r.why.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.model_type} | {r.architecture or '-'} | {r.path or '-'} | {r.status} | {why} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m radixserve.testing.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated model types (default: every causal-LM model type)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per model type")
    p.add_argument("--impl", default="auto", choices=["auto", "native", "transformers"], help="model.impl")
    p.add_argument("--jsonl", help="append one JSON result per line to this file")
    p.add_argument("--markdown", help="write the table to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.workdir or tempfile.mkdtemp(), args.impl)
        return 0
    types = args.only.split(",") if args.only else [t for t, _ in causal_lm_architectures()]
    results = []
    for r in sweep(types, timeout=args.timeout, impl=args.impl):
        results.append(r)
        print(f"{r.model_type:28s} {r.status:12s} {r.path:24s} {r.seconds:6.1f}s {r.why[:100]}", flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(asdict(r)) + "\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(render_markdown(results, "# Supported models (generated by the parity sweep)"))
    print(json.dumps(summary(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
