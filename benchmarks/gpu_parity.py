"""Greedy parity with transformers on the GPU (bf16): our runner (triton attention, CUDA graphs)
against HF on the same checkpoint, with the top-5 rule at the first divergence.

    python benchmarks/gpu_parity.py [--gguf SmolLM2.gguf] [--device cuda] [--attention triton]

Builds tiny random Llama (GQA, llama3 rope) and Qwen3 checkpoints itself; prints one line per
prompt and a summary; exits non-zero if any prompt breaks the top-5 rule."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from hf_reference import first_divergence, hf_greedy, top5_rule_holds  # noqa: E402
from radixserve.config import Config  # noqa: E402
from radixserve.model_runner import ModelRunner  # noqa: E402
from runner_driver import greedy_generate  # noqa: E402

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=1024,
            initializer_range=0.1)
CHAT = [
    "What is the capital of France?", "Write a haiku about autumn.", "What is 12 times 7?",
    "Name three colors of the rainbow.", "Explain gravity in one sentence.", "What is Python?",
    "Translate 'thank you' into French.", "Give one tip for better sleep.",
]


def build_tiny(arch: str, out: str, **extra) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **{**TINY, **extra})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


def compare(name: str, path: str, prompts: list[list[int]], new_tokens: int, args, hf_path=None, hf_kwargs=None) -> bool:
    from transformers import AutoModelForCausalLM

    options = {"dequantize": True} if path.endswith(".gguf") else {}  # the fp32 weights transformers reads
    cfg = Config.build({
        "model": {"path": path, "weight_source_options": options},
        "runtime": {"device": args.device, "dtype": args.dtype, "cuda_graph": not args.disable_cuda_graph},
        "stack": {"attention": args.attention},
        "scheduler": {"max_total_tokens": 8192, "max_running_requests": 16},
    })
    runner = ModelRunner(cfg, show_progress=False)
    if args.batch1_gemv_all:
        ours = gemv_all_batch1(runner, prompts, new_tokens, args)
    else:
        ours = greedy_generate(runner, prompts, new_tokens, keep_logits=True)
    if args.dump_tokens:  # one JSON line per checkpoint: to compare two runs' greedy outputs exactly
        import json

        with open(args.dump_tokens, "a") as f:
            f.write(json.dumps({"name": name, "tokens": [o.tokens for o in ours]}) + "\n")
    fusions_ok = True
    if args.decode_fusions_ab and hasattr(runner.attn_backend, "set_decode_fusions"):
        # the same runner with the triton backend's decode fusions off (graphs recaptured): exact equality
        if runner.graph_runner is not None:
            runner.req_to_token_pool.free(runner.graph_runner.dummy_row)
            runner.graph_runner = None
        runner.attn_backend.set_decode_fusions(rotary_store=False)
        if not args.disable_cuda_graph:
            runner._init_cuda_graphs()
        unfused = greedy_generate(runner, prompts, new_tokens)
        same = [o.tokens for o in ours] == [o.tokens for o in unfused]
        print(f"SUMMARY {name} decode fusions: greedy tokens {'identical' if same else 'DIFFER'} with them off "
              f"(rotary+KV store fused)")
        fusions_ok = same
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(hf_path or path, dtype=dtype, **(hf_kwargs or {})).to(args.device).eval()
    ok_all, exact = True, 0
    for i, p in enumerate(prompts):
        ref, ref_logits = hf_greedy(hf, p, new_tokens)
        div = first_divergence(ours[i].tokens, ref)
        ok = top5_rule_holds(ours[i].tokens, [x.float().cpu() for x in ours[i].logits], ref,
                             [x.float().cpu() for x in ref_logits])
        exact += div is None
        ok_all &= ok
        print(f"{name} prompt {i} (len {len(p)}): {'identical' if div is None else f'diverges at {div}'}"
              f" top5-rule={'ok' if ok else 'BROKEN'} used_graph={runner.last_run_used_cuda_graph}")
    print(f"SUMMARY {name}: {exact}/{len(prompts)} identical over {new_tokens} tokens; top-5 rule "
          f"{'holds' if ok_all else 'BROKEN'} ({args.device}, {args.dtype}, attention={args.attention})")
    return ok_all and fusions_ok


def gemv_all_batch1(runner, prompts: list[list[int]], new_tokens: int, args) -> list:
    """Every plain-weight projection on the Triton GEMV (the tiny shapes are below the envelope that
    runtime.batch1_gemv=auto routes, so the tile is forced here), graphs recaptured, and each prompt
    generated alone so that its decode steps are batch 1 and run through the GEMV."""
    import dataclasses

    from radixserve.layers import gemv_selection

    rt = runner.config.runtime
    pdl = gemv_selection.batch1_gemv_pdl_enabled(rt.batch1_gemv_pdl, runner.device)  # as served

    def force(with_pdl: bool) -> int:
        routed = 0
        for layer in runner.model.modules():
            if hasattr(layer, "gemv_config"):  # the layers attach_batch1_gemv considered (plain weights)
                layer.gemv_config = dataclasses.replace(gemv_selection.SM90_UNMEASURED, pdl=with_pdl)
                layer.gemv_fuse_norm = rt.batch1_gemv_fuse_norm  # the norms fused as served
                routed += 1
        if runner.graph_runner is not None:
            runner.req_to_token_pool.free(runner.graph_runner.dummy_row)
            runner.graph_runner = None
        if not args.disable_cuda_graph:
            runner._init_cuda_graphs()
        return routed

    routed = force(pdl)
    print(f"batch-1 GEMV forced on {routed} linear layers (fused norm: {rt.batch1_gemv_fuse_norm}, PDL: {pdl});"
          " prompts generated one at a time")
    outs = [greedy_generate(runner, [p], new_tokens, keep_logits=True)[0] for p in prompts]
    if pdl:  # PDL changes no bit: the same greedy tokens with it off
        force(False)
        plain = [greedy_generate(runner, [p], new_tokens)[0] for p in prompts]
        same = [o.tokens for o in outs] == [o.tokens for o in plain]
        print(f"SUMMARY batch-1 GEMV PDL: greedy tokens {'identical' if same else 'DIFFER'} with it off")
    return outs


def scheduled_outputs(path: str, prompts: list[list[int]], new_tokens: int, args, overlap: bool):
    """Greedy outputs through the real Scheduler (continuous batching), with or without overlap."""
    from radixserve.plugins.registry import Registry
    from radixserve.runtime.messages import GenerateRequest
    from radixserve.scheduler import Scheduler
    from radixserve.state import SamplingParams

    cfg = Config.build({
        "model": {"path": path},
        "runtime": {"device": args.device, "dtype": args.dtype, "cuda_graph": not args.disable_cuda_graph,
                    "overlap": overlap},
        "stack": {"attention": args.attention},
        "scheduler": {"max_total_tokens": 8192, "max_running_requests": 16},
    })
    sched = Scheduler.from_config(cfg, ModelRunner(cfg, show_progress=False), Registry.discover())
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=new_tokens + 5 * i, temperature=0, ignore_eos=True)
        sched.add_request(GenerateRequest(rid=str(i), input_ids=p, sampling_params=sp))
    got: dict[str, list[int]] = {}
    while sched.has_work():
        for out in sched.step():
            got.setdefault(out.rid, []).extend(out.new_ids)
    return got, sched.metrics.overlapped_batches


def compare_overlap(name: str, path: str, prompts: list[list[int]], new_tokens: int, args) -> bool:
    plain, _ = scheduled_outputs(path, prompts, new_tokens, args, overlap=False)
    ahead, n_ahead = scheduled_outputs(path, prompts, new_tokens, args, overlap=True)
    same = plain == ahead and n_ahead > 0
    print(f"SUMMARY {name} overlap: outputs {'identical' if plain == ahead else 'DIFFER'} with and without "
          f"overlap scheduling ({n_ahead} decode batches launched ahead)")
    return same


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--gguf", help="SmolLM2 GGUF file for the real-model comparison")
    ap.add_argument("--skip-tiny", action="store_true", help="only the GGUF comparison")
    ap.add_argument("--dump-tokens", help="append each checkpoint's greedy tokens to this file (JSON lines)")
    ap.add_argument("--decode-fusions-ab", action="store_true",
                    help="also generate with the triton backend's decode fusions off; fail unless the tokens are equal")
    ap.add_argument("--batch1-gemv-all", action="store_true",
                    help="every plain projection on the batch-1 Triton GEMV, prompts one at a time (batch-1 decode)")
    ap.add_argument("--families", action="store_true",
                    help="only the native families beyond Llama (tests/family_cases.py: Gemma 2/3, Phi-3, OLMo 2, "
                         "Mistral with a window, Mixtral, Qwen2/3-MoE)")
    ap.add_argument("--deepseek", action="store_true",
                    help="only the tiny DeepSeek-V2/V3 checkpoints (plugins/models/deepseek/tests/deepseek_cases.py); "
                         "pair with --attention mla_triton or torch_native")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(1)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        if args.skip_tiny:
            return 0 if not args.gguf else compare_gguf(args)
        if args.families:
            return 0 if compare_families(tmp, args) else 1
        if args.deepseek:
            return 0 if compare_deepseek(tmp, args) else 1
        llama = build_tiny("llama", os.path.join(tmp, "llama"), tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))
        qwen3 = build_tiny("qwen3", os.path.join(tmp, "qwen3"))
        prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (5, 130, 2, 77)]
        ok &= compare("tiny-llama", llama, prompts, 32, args)
        ok &= compare("tiny-qwen3", qwen3, prompts, 32, args)
        if not args.batch1_gemv_all:  # (scheduled batches > 1 would not exercise the GEMV)
            ok &= compare_overlap("tiny-llama", llama, prompts, 32, args)
    if args.gguf:
        ok &= compare_gguf(args) == 0
    return 0 if ok else 1


def compare_families(tmp: str, args) -> bool:
    """Each family's tiny checkpoint (windows of 4-5 tokens, shorter than the prompts) against
    transformers (eager attention: its SDPA path ignores Gemma 2's attention soft-capping). Prompts
    plus new tokens stay under 64 positions: Phi-3's LongRoPE case switches factors there, per
    position here and per sequence in transformers."""
    from family_cases import DENSE_CASES, MOE_CASES
    from radixserve.testing import tiny_checkpoint

    gen = torch.Generator().manual_seed(2)
    ok = True
    for name, (model_type, overrides) in {**DENSE_CASES, **MOE_CASES}.items():
        path = tiny_checkpoint(model_type, os.path.join(tmp, name), **overrides)
        vocab = config_vocab_size(path)
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 31, 2, 17)]
        ok &= compare(name, path, prompts, 24, args, hf_kwargs={"attn_implementation": "eager"})
    return ok


def compare_deepseek(tmp: str, args) -> bool:
    """The DeepSeek plugin's tiny checkpoints (latent attention, YaRN, V2/V3 routing) against
    transformers, with the latent pool and the selected latent backend; the last case also through
    the real scheduler with and without overlap."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "plugins", "models", "deepseek", "tests"))
    from deepseek_cases import CASES, write_checkpoint

    gen = torch.Generator().manual_seed(3)
    ok = True
    for name in CASES:
        path = write_checkpoint(name, os.path.join(tmp, name))
        vocab = config_vocab_size(path)
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 130, 2, 77)]
        ok &= compare(name, path, prompts, 32, args, hf_kwargs={"attn_implementation": "eager"})
    ok &= compare_overlap(name, path, prompts, 32, args)
    return ok


def config_vocab_size(path: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).vocab_size)


def compare_gguf(args) -> int:
    from radixserve.tokenizer import apply_chat_template, load_tokenizer

    tok = load_tokenizer(args.gguf)
    prompts = [apply_chat_template(tok, [{"role": "user", "content": c}]) for c in CHAT]
    d, f = os.path.split(args.gguf)
    return 0 if compare("smollm2", args.gguf, prompts, 64, args, hf_path=d, hf_kwargs={"gguf_file": f}) else 1


if __name__ == "__main__":
    sys.exit(main())
