"""EAGLE draft overhead on the GPU (issue 13: the draft's steps per verify cost at most 25% of the
verify step at batch 1). Llama-3.1-8B shape with dummy weights; a random EAGLE head of the
published layout is written on the fly (EAGLE-3 by default: fc over 3 x 4096, one 2H-wide
decoder layer, a 32k draft vocabulary; `--layout eagle2` for EAGLE-2).

Each verify step is split into the drafter's `propose` (all draft work: the rows verified last
step run into the draft KV, then `num_steps` tree levels) and the rest of the scheduler step (the
verify forward, acceptance, bookkeeping). A random head is rarely accepted, so each propose runs
one new row plus the tree; the cost of the tree steps does not depend on acceptance.

CUDA graphs: the target's decode graphs record the hidden rows the draft reads (recaptured when
the drafter asks), so chain verifies (decode rows on triton) and plain decode steps replay them;
the draft's verified-row step, its chain steps and its tree levels replay the drafter's own graphs
(`--draft-cuda-graph off` runs the draft eagerly, for comparison). Reported per layout: propose
ms, verify step ms (the step without its propose), the plain decode step ms (no drafter), the
ratio, the share of verify steps that replayed a target graph and the draft graph replays. Also
`collect_ms` (the drafter's `on_accepted`: collecting the verified rows' hidden states, draft work
done after the verify), `draft_ms` = propose + collect, `verify_net_ms` = the step less both,
`draft_over_verify` (the issue's ratio with all draft work counted; `target_met` uses it), and
end-to-end decode tokens/s with and without speculation (`decode_tok_s`, `plain_decode_tok_s`).
`--runtime KEY=VALUE` overrides a runtime config key for the run (A/B of a target-side switch).

    python benchmarks/h200/spec_eagle.py --out $OUT [--layout eagle3] [--topk 1] [--num-steps 4]
    python benchmarks/h200/spec_eagle.py --out $OUT --rows eagle3:1:4:4,eagle3:4:4:16,eagle2:1:4:4

`--rows` measures several layouts (layout:topk:num_steps:num_draft_tokens) on one target load: the
target's hidden-state recording is switched off between rows (a benchmark-only reset; a server's
drafter never changes), so each row records only what its head reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


MODEL = "benchmarks/model-configs/llama-3.1-8b"


def write_head(path: Path, layout: str, target: dict, draft_vocab: int) -> str:
    from safetensors.torch import save_file

    h, inter = target["hidden_size"], target["intermediate_size"]
    nh, nkv, hd = target["num_attention_heads"], target["num_key_value_heads"], target["head_dim"]
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (0.02 * torch.randn(*shape, generator=g)).to(torch.bfloat16)

    width = 2 * h if layout == "eagle3" else h
    pre = "midlayer" if layout == "eagle3" else "layers.0"
    t = {
        f"{pre}.self_attn.q_proj.weight": rnd(nh * hd, width),
        f"{pre}.self_attn.k_proj.weight": rnd(nkv * hd, width),
        f"{pre}.self_attn.v_proj.weight": rnd(nkv * hd, width),
        f"{pre}.self_attn.o_proj.weight": rnd(h, nh * hd),
        f"{pre}.mlp.gate_proj.weight": rnd(inter, h),
        f"{pre}.mlp.up_proj.weight": rnd(inter, h),
        f"{pre}.mlp.down_proj.weight": rnd(h, inter),
        f"{pre}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    cfg = {k: target[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                                  "rope_scaling")}
    if layout == "eagle3":
        t.update({
            "fc.weight": rnd(h, 3 * h),
            f"{pre}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{pre}.hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
            "norm.weight": torch.ones(h, dtype=torch.bfloat16),
            "lm_head.weight": rnd(draft_vocab, h),
            "d2t": torch.zeros(draft_vocab, dtype=torch.int64),  # the first draft_vocab target ids
            "t2d": torch.arange(target["vocab_size"]) < draft_vocab,
        })
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab, num_hidden_layers=1)
    else:
        t.update({"fc.weight": rnd(h, 2 * h), "fc.bias": rnd(h)})
        cfg.update(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(path / "model.safetensors"))
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layout", choices=("eagle2", "eagle3"), default="eagle3")
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--num-steps", type=int, default=4)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--model", default=MODEL)  # a config dir (dummy weights); tiny ones smoke-test on CPU
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--draft-cuda-graph", choices=("on", "off"), default="on")
    ap.add_argument("--rows", default=None, help="layout:topk:num_steps:num_draft_tokens,... (overrides the above)")
    ap.add_argument("--runtime", action="append", default=[], metavar="KEY=VALUE",
                    help="a runtime config override for the whole run (e.g. batch1_gemv_fuse_norm=false)")
    args = ap.parse_args()
    rows = [(args.layout, args.topk, args.num_steps, args.num_draft_tokens, args.draft_cuda_graph == "on", True)]
    tree_eager = [False]  # per row: tree verifies kept off the decode graphs (the eager tree-mask extend)
    if args.rows:  # further fields: "eager" (the draft without its CUDA graphs), "nogemv" (its one-row
        # matmuls on cuBLAS: speculative.options.batch1_gemv=off, the A/B of the draft's batch-1 GEMV)
        rows = [(f[0], int(f[1]), int(f[2]), int(f[3]), "eager" not in f[4:], "nogemv" not in f[4:]) for f in
                (r.split(":") for r in args.rows.split(","))]
        # "treeeager": the target verifies trees eagerly (tree-mask EXTEND) instead of as decode rows
        # replaying its graphs (the A/B of issue 13's tree graphs; the scratch rows are reserved at load
        # when the first row is a tree)
        tree_eager = ["treeeager" in r.split(":")[4:] for r in args.rows.split(",")]

    from radixserve.config import Config
    from radixserve.model_runner import ModelRunner
    from radixserve.plugins.registry import Registry
    from radixserve.runtime.messages import GenerateRequest
    from radixserve.scheduler import Scheduler
    from radixserve.scheduler.speculative.setup import build_drafter
    from radixserve.state import SamplingParams

    target = json.loads(Path(args.model, "config.json").read_text())
    target.setdefault("head_dim", target["hidden_size"] // target["num_attention_heads"])
    target.setdefault("rope_theta", 10000.0)
    target.setdefault("rope_scaling", None)
    tmp = Path(tempfile.mkdtemp())
    heads = {lay: write_head(tmp / lay, lay, target, args.draft_vocab) for lay in {r[0] for r in rows}}
    cuda = args.device == "cuda"
    base = {
        "model": {"path": args.model, "load_format": "dummy", "context_length": 4096},
        "stack": {"attention": args.attention, "prefix_cache": "radix"},
        # batch 1: graphs up to 16 rows cover the plain step and a chain verify (1 + drafts rows)
        "runtime": {"device": args.device, "dtype": "bfloat16" if cuda else "float32", "cuda_graph_max_bs": 16,
                    **dict(_override(kv) for kv in args.runtime)},
    }

    def spec_config(layout: str, topk: int, num_steps: int, num_draft_tokens: int, draft_graphs: bool,
                    draft_gemv: bool = True) -> Config:
        spec = {"num_draft_tokens": num_draft_tokens, "topk": topk, "num_steps": num_steps,
                "draft_model_path": heads[layout], "adaptive_batch_size": 0,
                "options": {"cuda_graph": draft_graphs and cuda, "batch1_gemv": "auto" if draft_gemv else "off"}}
        return Config.build({**base, "stack": {**base["stack"], "speculative": "eagle"}, "speculative": spec})

    cfg = spec_config(*rows[0])
    registry = Registry.from_config(cfg)
    t_load = time.perf_counter()
    runner = ModelRunner(cfg, registry, show_progress=False)
    runner.warmup()
    print(f"target loaded, graphs captured, warmed up in {time.perf_counter() - t_load:.1f} s", flush=True)
    prompt = [int(x) for x in torch.randint(0, min(30000, target["vocab_size"]), (args.input_len,), generator=torch.Generator().manual_seed(1))]

    graph_steps: list[bool] = []  # per step of the last run: its (last) forward replayed a target graph
    tree_verifies = [0, 0]  # in the last run: tree verifies, and those that replayed a target decode graph
    inner_forward = runner._forward

    def counted_forward(sb, greedy_ids):
        out = inner_forward(sb, greedy_ids)
        if sb.spec is not None and sb.spec.has_tree:
            tree_verifies[0] += 1
            tree_verifies[1] += bool(runner.last_run_used_cuda_graph)
        return out

    runner._forward = counted_forward
    tree_rows = runner.tree_rows
    print(f"tree scratch rows reserved: {len(tree_rows.scratch_rows) if tree_rows else 0}", flush=True)

    collects: list[float] = []  # per step of the last run: ms in the drafter's on_accepted

    def timed_run(sched) -> tuple[list[float], list[float]]:
        """(step ms, propose ms within it, or 0 for steps without a propose) for one request;
        `collects` gets each step's time in the drafter's `on_accepted` (draft work after the verify:
        collecting the verified rows' hidden states)."""
        graph_steps.clear()
        collects.clear()
        tree_verifies[:] = [0, 0]
        proposes: list[float] = []
        accepted: list[float] = []
        drafter = sched.drafter
        if drafter is not None:
            inner = drafter.propose
            inner_acc = drafter.on_accepted

            def on_accepted(req, acc):
                sync()
                t0 = time.perf_counter()
                out = inner_acc(req, acc)
                sync()
                accepted.append((time.perf_counter() - t0) * 1e3)
                return out

            drafter.on_accepted = on_accepted

            def propose(reqs, k):
                sync()
                t0 = time.perf_counter()
                out = inner(reqs, k)
                sync()
                proposes.append((time.perf_counter() - t0) * 1e3)
                return out

            drafter.propose = propose
        sched.add_request(GenerateRequest(rid="r", input_ids=prompt, sampling_params=SamplingParams(
            max_new_tokens=args.output_len, temperature=0, ignore_eos=True)))
        steps, props = [], []
        while sched.has_work():
            n_before, a_before = len(proposes), len(accepted)
            sync()
            t0 = time.perf_counter()
            sched.step()
            sync()
            steps.append((time.perf_counter() - t0) * 1e3)
            graph_steps.append(bool(runner.last_run_used_cuda_graph))
            props.append(proposes[-1] if len(proposes) > n_before else 0.0)
            collects.append(sum(accepted[a_before:]))
        sched.flush_cache()
        del collects[0]
        return steps[1:], props[1:]  # the prefill step is not a decode / verify step

    def scheduler(with_drafter: bool):
        c = cfg if with_drafter else Config.build(base)
        cache = registry.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
        drafter = build_drafter(c, runner, registry) if with_drafter else None
        return Scheduler(c, runner, cache, registry.load("policy", "fcfs")(), drafter=drafter)

    timed_run(scheduler(False))  # untimed
    plain_steps, _ = timed_run(scheduler(False))  # no drafter yet: nothing recorded
    print(f"plain decode: {statistics.median(plain_steps):.2f} ms/step", flush=True)
    for (layout, topk, num_steps, num_draft_tokens, draft_graphs, draft_gemv), eager_trees in zip(rows, tree_eager,
                                                                                                 strict=True):
        runner.tree_rows = None if eager_trees else tree_rows
        stop_recording(runner)
        cfg = spec_config(layout, topk, num_steps, num_draft_tokens, draft_graphs, draft_gemv)
        t0 = time.perf_counter()
        timed_run(scheduler(True))  # untimed pass: compiles, captures the draft graphs, warms the draft pool
        sched = scheduler(True)
        steps, props = timed_run(sched)
        print(f"{layout} topk {topk}: two passes in {time.perf_counter() - t0:.1f} s", flush=True)
        report(args, layout, topk, num_steps, num_draft_tokens, draft_graphs, runner, sched, plain_steps, steps,
               props, graph_steps, cuda, list(collects),
               {"tree_verify": "eager" if eager_trees else "decode rows", "tree_verifies": tree_verifies[0],
                "tree_verifies_graph_replayed": tree_verifies[1]})


def _override(kv: str) -> tuple[str, object]:
    key, _, value = kv.partition("=")
    low = value.lower()
    if low in ("true", "false"):
        return key, low == "true"
    return key, int(value) if value.lstrip("-").isdigit() else value


def stop_recording(runner) -> None:
    """Benchmark-only: forget what an earlier row's drafter asked the target to record (and give
    the decode graphs back their plain form), so the next row records only what its head reads."""
    ts = runner.target_states
    if not ts.recording:
        return
    ts.final, ts.aux_layers = False, ()
    if ts.supports_aux_layers:
        runner.model.set_aux_hidden_state_layers(())
    if runner.graph_runner is not None:
        runner.graph_runner.set_recording(False, (), 0, runner.dtype)


def report(args, layout, topk, num_steps, num_draft_tokens, draft_graphs, runner, sched, plain_steps, steps, props,
           graph_steps, cuda, collects, extra=None) -> None:
    graphed = [g for g, p in zip(graph_steps[1:], props, strict=True) if p > 0]
    verify = [s - p for s, p in zip(steps, props, strict=True) if p > 0]
    # all draft work of a step: its propose and its on_accepted (collecting the verified rows)
    draft = [p + c for p, c in zip(props, collects, strict=True) if p > 0]
    verify_net = [s - p - c for s, p, c in zip(steps, props, collects, strict=True) if p > 0]
    coll = [c for p, c in zip(props, collects, strict=True) if p > 0]
    decode_s = sum(steps) / 1e3  # the decode / verify steps after the prefill: output_len - 1 tokens
    spec_steps = [s for s, p in zip(steps, props, strict=True) if p > 0]  # whole steps with a propose
    props = [p for p in props if p > 0]
    res = {
        "layout": layout, "topk": topk, "num_steps": num_steps,
        "num_draft_tokens": num_draft_tokens, "input_len": args.input_len,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "plain_decode_step_ms": statistics.median(plain_steps),
        "propose_ms": statistics.median(props), "verify_step_ms": statistics.median(verify),
        "verify_steps": len(verify), "draft_cuda_graph": draft_graphs and cuda,
        "verify_steps_graph_replayed": sum(graphed) / max(1, len(graphed)),
        "target_graph_records": list(runner.graph_runner.recording) if runner.graph_runner is not None else None,
    }
    dg = getattr(sched.drafter, "graphs", None)
    head = getattr(sched.drafter, "head", None)
    res["draft_gemv_weights"] = sum(t is not None for m in (head, *head.layers) for t in m.tiles.values()) if head else 0
    res["draft_graph_replays"] = dg.replays if dg is not None else 0
    res["draft_graphs"] = sorted(str(k) for k in [*dg.chains, *dg.pendings, *dg.trees]) if dg is not None else []
    # a failed capture turns the draft eager for the rest of the run (EagleGraphs._get logs why)
    res["draft_graph_capture_failed"] = bool(dg.failed) if dg is not None else False
    res["draft_graph_capture_error"] = getattr(dg, "failure", None)  # "(key): error", or None
    res["propose_over_verify"] = res["propose_ms"] / res["verify_step_ms"]
    res["collect_ms"] = statistics.median(coll)  # the drafter's on_accepted (synchronized: adds its syncs)
    res["draft_ms"] = statistics.median(draft)
    res["verify_net_ms"] = statistics.median(verify_net)  # the step less all draft work
    res["draft_over_verify"] = res["draft_ms"] / res["verify_net_ms"]
    res["step_ms"] = statistics.median(spec_steps)
    res["decode_tok_s"] = (args.output_len - 1) / decode_s
    res["plain_decode_tok_s"] = (args.output_len - 1) / (sum(plain_steps) / 1e3)
    res["target_met"] = res["draft_over_verify"] <= 0.25
    res.update(extra or {})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "spec_eagle.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    json.dump(res, sys.stdout)
    print()


if __name__ == "__main__":
    main()
