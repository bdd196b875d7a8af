"""The flashinfer attention plugin on the H200 (run by benchmarks/h200/s5_flashinfer.sh after
flashinfer_setup.sh). Each mode prints progress lines and writes JSON under $OUT:

  kit HQ HKV D DTYPE [PREFILL_BACKEND]  the attention conformance kit on CUDA against exact attention
                                        (extend with and without prefixes, decode, tree verify); the
                                        first run of a shape JIT-compiles its kernels (time printed)
  graph                                 decode through the CUDA-graph wrappers: capture, then replay
                                        with longer sequences, against exact attention
  engine                                greedy ids through the Engine on a tiny Llama (head_dim 64,
                                        GQA): flashinfer vs triton vs torch_native, bf16, CUDA graphs
  kernels                               per-layer kernel times beside triton's, Llama-3.1-8B shape:
                                        prefill 1x2048 fresh, 8x1024 after 1024-token prefixes; decode
                                        bs 1/64 x ctx 1k/8k (in CUDA graphs, KV beyond L2)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from functools import partial

import torch

OUT = os.environ.get("OUT", ".")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def dump(name: str, record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(os.path.join(OUT, name), "a") as f:
        f.write(json.dumps(record) + "\n")


def kit(hq: str, hkv: str, d: str, dtype: str, prefill_backend: str = "auto") -> int:
    from radixserve.testing.attention import check_attention_backend
    from radixserve_attention_flashinfer.backend import FlashInferAttentionBackend

    shape = (int(hq), int(hkv), int(d))
    t0 = time.time()
    rec = {"mode": "kit", "heads": shape, "dtype": dtype, "prefill_backend": prefill_backend}
    try:
        backend = partial(FlashInferAttentionBackend, prefill_backend=prefill_backend)
        check_attention_backend(backend, device="cuda", dtype=getattr(torch, dtype), heads=(shape,),
                                seeds=(0,), tree_steps=2)
        rec["ok"] = True
    except Exception as e:  # report, keep the other parts going
        rec["ok"], rec["error"] = False, f"{type(e).__name__}: {e}"[:2000]
    rec["seconds"] = round(time.time() - t0, 1)
    dump("fi_kit.jsonl", rec)
    return 0 if rec["ok"] else 1


def graph() -> int:
    """Capture a decode step in a CUDA graph, then replay it for the next step (every request one
    token longer): the replay must read the re-planned page lists from the static buffers."""
    import attention_kernels as ak
    from radixserve.state import ForwardMode
    from radixserve_attention_flashinfer.backend import FlashInferAttentionBackend

    final = [51, 8, 901]
    s = ak.build([n - 1 for n in final], [1, 1, 1], 1, ForwardMode.DECODE)  # the pool holds the final lengths
    s.info.context_len = 2048
    b = FlashInferAttentionBackend(s.info)
    s.batch.attn_backend = b
    r2t = s.batch.req_to_token_pool.req_to_token
    # step 1 (captured): one token shorter; its new token sits at position final-2
    s.batch.seq_lens.copy_(torch.tensor([n - 1 for n in final], device="cuda"))
    s.batch.out_cache_loc.copy_(torch.stack([r2t[i, n - 2] for i, n in enumerate(final)]))
    s.batch.seq_lens_cpu = [n - 1 for n in final]
    b.init_graph_state(max_bs=4)
    b.init_forward_metadata_capture(s.batch)
    layer = ak.Layer(0)
    b.forward(s.q, s.k, s.v, layer, s.batch)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = b.forward(s.q, s.k, s.v, layer, s.batch)
    # step 2 (replayed): the final lengths, new token at position final-1, fresh q/k/v
    s.batch.seq_lens.copy_(torch.tensor(final, device="cuda"))
    s.batch.out_cache_loc.copy_(torch.stack([r2t[i, n - 1] for i, n in enumerate(final)]))
    s.batch.seq_lens_cpu = list(final)
    s.batch.extend_lens_cpu = [1, 1, 1]
    s.q.normal_(), s.k.normal_(), s.v.normal_()
    b.init_forward_metadata_replay(s.batch, real_bs=3)
    g.replay()
    torch.cuda.synchronize()
    err = ak.rel_err(out, ak.reference(s))
    rec = {"mode": "graph", "rel_err": err, "ok": err < 2e-2}
    dump("fi_graph.jsonl", rec)
    return 0 if rec["ok"] else 1


def engine() -> int:
    from radixserve import Engine
    from radixserve.testing import tiny_checkpoint

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (5, 130, 2, 77, 300, 17)]
    greedy = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    results, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_checkpoint("llama", os.path.join(tmp, "tiny"), hidden_size=256, intermediate_size=512,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
                               max_position_embeddings=1024)
        # the tiny checkpoint's own tokenizer needs sentencepiece (absent on the device): use SmolLM2's
        # (the carried .gpu2/tok-smollm2; the prompts are ids < 1024, it only detokenizes)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(".gpu2/tok-smollm2", name), path)
        for attention in ("flashinfer", "triton", "torch_native"):
            t0 = time.time()
            eng = Engine(path, stack={"attention": attention},
                         runtime={"device": "cuda", "dtype": "bfloat16"})
            try:
                first = eng.generate(input_ids=prompts[0], sampling_params=greedy)["output_ids"]
                rest = [r["output_ids"] for r in eng.generate(input_ids=prompts[1:], sampling_params=greedy)]
                # the same prompts again: prefixes now come from the radix cache (paged prefill path)
                again = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=greedy)]
            finally:
                eng.shutdown()
            results[attention] = [first] + rest
            same = again == results[attention]
            print(f"{attention}: {time.time() - t0:.1f}s, cached rerun identical: {same}", flush=True)
            ok &= same
    for other in ("triton", "torch_native"):
        equal = sum(a == b for a, b in zip(results["flashinfer"], results[other]))
        first_diff = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                      for a, b in zip(results["flashinfer"], results[other])]
        dump("fi_engine.jsonl", {"mode": "engine", "vs": other, "prompts": len(prompts), "identical": equal,
                                 "first_divergence": first_diff})
    return 0 if ok else 1


def kernels() -> int:
    import attention_kernels as ak
    import triton.testing
    from radixserve.state import ForwardMode
    from radixserve_attention_flashinfer.backend import FlashInferAttentionBackend
    from radixserve_attention_triton.backend import TritonAttentionBackend

    def make(cls, s, **kw):
        s.info.context_len = max(s.batch.seq_lens_cpu) + 1
        b = cls(s.info, **kw)
        s.batch.attn_backend = b
        return b

    rc = 0
    for label, prefix, ext in (("prefill 1x2048 fresh", [0], [2048]), ("prefill 8x1024 after 1024 prefix", [1024] * 8, [1024] * 8)):
        s = ak.build(prefix, ext, 1, ForwardMode.EXTEND)
        rec = {"mode": "kernels", "case": label}
        for name, cls, kw in (("triton", TritonAttentionBackend, {}), ("flashinfer", FlashInferAttentionBackend, {}),
                              ("flashinfer_fa2", FlashInferAttentionBackend, {"prefill_backend": "fa2"})):
            try:
                b = make(cls, s, **kw)
                t0 = time.perf_counter()
                b.init_forward_metadata(s.batch)
                torch.cuda.synchronize()
                plan_us = (time.perf_counter() - t0) * 1e6
                out = b.forward_extend(s.q, s.k, s.v, ak.Layer(0), s.batch)
                err = ak.rel_err(out, ak.reference(s))
                us = triton.testing.do_bench(lambda b=b, s=s: b.forward_extend(s.q, s.k, s.v, ak.Layer(0), s.batch)) * 1e3
                rec[name] = {"us": round(us, 1), "plan_us": round(plan_us, 1), "rel_err": err,
                             "tflops": round(sum(map(ak.causal_flops, prefix, ext)) / us / 1e6, 1)}
            except Exception as e:
                rec[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
                rc = 1
        dump("fi_kernels.jsonl", rec)
    for bs, ctx in ((1, 1024), (1, 8192), (64, 1024), (64, 8192)):
        layers = max(1, min(32, int(4 * 60e6 // (bs * ctx * 8 * 128 * 2 * 2)) + 1))
        s = ak.build([ctx - 1] * bs, [1] * bs, layers, ForwardMode.DECODE)
        rec = {"mode": "kernels", "case": f"decode bs{bs} ctx{ctx}", "layers": layers}
        for name, cls in (("triton", TritonAttentionBackend), ("flashinfer", FlashInferAttentionBackend)):
            try:
                b = make(cls, s)
                b.init_graph_state(bs)
                t0 = time.perf_counter()
                b.init_forward_metadata_capture(s.batch)
                torch.cuda.synchronize()
                plan_us = (time.perf_counter() - t0) * 1e6
                out = b.forward_decode(s.q, s.k, s.v, ak.Layer(0), s.batch)
                err = ak.rel_err(out, ak.reference(s))
                us = ak.graph_time_per_layer_us(b, s, layers)
                kv_bytes = bs * ctx * 8 * 128 * 2 * 2
                rec[name] = {"us_per_layer": round(us, 2), "plan_us": round(plan_us, 1), "rel_err": err,
                             "kv_TBps": round(kv_bytes / us / 1e6, 2)}
            except Exception as e:
                rec[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
                rc = 1
        dump("fi_kernels.jsonl", rec)
    return rc


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    sys.exit({"kit": kit, "graph": graph, "engine": engine, "kernels": kernels}[mode](*args))
