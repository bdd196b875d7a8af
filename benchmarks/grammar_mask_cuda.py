"""GPU check of structured-output masking: xgrammar's fused bitmask kernel (what
`XGrammarBackend.apply_bitmask_inplace` uses on CUDA) against the core's torch reference
(`radixserve.interfaces.grammar.apply_bitmask_torch`): identical logits, and the time of each for
the 8B shape (vocabulary 128256) at batch 1, 16 and 64, next to one bitmask fill per row on the host.

    python benchmarks/grammar_mask_cuda.py            # writes $OUT/grammar_mask_cuda.json (or ./)

Needs a CUDA device, torch with CUDA, xgrammar 0.1.27 and transformers (for the tokenizer-free
TokenizerInfo built from a synthetic vocabulary).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import xgrammar as xgr
from radixserve.interfaces.grammar import apply_bitmask_torch, bitmask_width

VOCAB = 128256


def timed(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / reps


def fill_time_ms(bs: int) -> float:
    """Host time of filling `bs` rows from a JSON-schema matcher on a synthetic byte vocabulary."""
    vocab = [bytes([i % 256]).decode("latin-1") * (1 + i // 256 % 4) for i in range(VOCAB)]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[0])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}})
    )
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(bs)]
    bitmask = xgr.allocate_token_bitmask(bs, VOCAB)
    t0 = time.perf_counter()
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(bitmask, i)
    return 1000 * (time.perf_counter() - t0)


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA device"
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    results = {"device": torch.cuda.get_device_name(0), "vocab": VOCAB, "rows": []}
    for bs in (1, 16, 64):
        logits = torch.randn(bs, VOCAB, generator=g).to(dev)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (bs, bitmask_width(VOCAB)), dtype=torch.int32, generator=g).to(dev)
        want = logits.clone()
        apply_bitmask_torch(want, bitmask, VOCAB)
        got = logits.clone()
        xgr.apply_token_bitmask_inplace(got, bitmask, vocab_size=VOCAB)
        same = bool(torch.equal(got, want))
        work = logits.clone()
        ref_ms = timed(lambda w=work, b=bitmask: apply_bitmask_torch(w, b, VOCAB))
        fused_ms = timed(lambda w=work, b=bitmask: xgr.apply_token_bitmask_inplace(w, b, vocab_size=VOCAB))
        row = {"batch": bs, "identical": same, "torch_reference_ms": round(ref_ms, 4),
               "xgrammar_fused_ms": round(fused_ms, 4), "host_fill_ms": round(fill_time_ms(bs), 3)}
        results["rows"].append(row)
        print(row)
    out = Path(os.environ.get("OUT", ".")) / "grammar_mask_cuda.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    assert all(r["identical"] for r in results["rows"]), "the fused kernel differs from the reference"


if __name__ == "__main__":
    main()
