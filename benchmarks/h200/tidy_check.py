"""The small-batch MoE kernels' equalities on the GPU after the session-8 tidy (shared @triton.jit steps
`small_m_steps.route_token` / `sum_rows_if_last`, the env switches gone). No timing: correctness only.

- experts (Qwen3-30B-A3B's shape: 128 experts, top 8, H 2048, I 768; and a masked shape: 64 experts,
  top 4, H 2000, I 700), bf16, 1 / 2 / 4 / 8 tokens: one launch == two launches with the down kernel's
  fused row sum == two launches with the `sum_rows` launch (bit for bit, `SmallMBlocks.one_launch` /
  `.fused_sum`), close to fp32 torch, deterministic over 3 calls, the counter buffers all zero after;
- router: `fused_select_experts` against torch `select_experts` (softmax + renormalise; sigmoid +
  correction bias + scaling): same ids, close weights; `fused_gate_select_experts` (gate linear and
  top-k in one launch) against the linear layer + `fused_select_experts`: same ids, close weights, the
  same result over 50 launches (the arrival counters), counters zero; `fused_norm_gate_select_experts`
  against `triton_ops.rmsnorm` + `fused_gate_select_experts`: the residual bit-equal, same ids.

    python benchmarks/h200/tidy_check.py --out DIR      (DIR/tidy_check.jsonl; exit 1 on any failure)

DIR/tidy_digests.json holds a sha256 of every kernel output: the same script run on a tree without
the tidy (the base) must give the same digests (`--ref FILE` compares against such a file)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import time

import torch
from radixserve.layers.moe import RoutingConfig, select_experts, small_m

T0 = time.time()
DIGESTS: dict[str, str] = {}


def log(msg: str) -> None:
    print(f"[tidy_check {time.time() - T0:5.1f}s] {msg}", flush=True)


def digest(name: str, *tensors: torch.Tensor) -> None:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    DIGESTS[name] = h.hexdigest()[:16]


def blocks(**change) -> small_m.SmallMBlocks:
    """DEFAULT_BLOCKS with `change`; `fused_sum` is a field since the tidy (before it: small_m.FUSED_SUM)."""
    if "fused_sum" in change and not hasattr(small_m.DEFAULT_BLOCKS, "fused_sum"):
        small_m.FUSED_SUM = change.pop("fused_sum")  # the base tree: its module switch
    return dataclasses.replace(small_m.DEFAULT_BLOCKS, **change)


def experts_reference(x, w13, w2, weights, ids):
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e].float() @ x[t].float()
            out[t] += weights[t, j].float() * (w2[e].float() @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    return out


def check_experts(emit, gen) -> bool:
    ok = True
    for name, (e, k, h, i) in {"qwen3-30b-a3b": (128, 8, 2048, 768), "masked": (64, 4, 2000, 700)}.items():
        w13 = torch.randn(e, 2 * i, h, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(e, h, i, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        cfg = RoutingConfig(top_k=k, scoring="softmax", renormalize=True)
        for m in (1, 2, 4, 8):
            if not small_m.use_small_m(m * k, e):
                continue
            x = torch.randn(m, h, device="cuda", generator=gen, dtype=torch.bfloat16)
            weights, ids = select_experts(torch.randn(m, e, device="cuda", generator=gen), cfg)
            run = {}
            for key, change in {"one": {"one_launch": True}, "two_fused_sum": {"one_launch": False, "fused_sum": True},
                                "two_sum_rows": {"one_launch": False, "fused_sum": False}}.items():
                b = blocks(**change)
                run[key] = small_m.small_m_fused_experts(x, w13, w2, weights, ids, blocks=b)
                digest(f"experts/{name}/{m}/{key}", run[key])
            repeat = [small_m.small_m_fused_experts(x, w13, w2, weights, ids, blocks=blocks(one_launch=True))
                      for _ in range(3)]
            blocks(fused_sum=True)  # the base tree's switch back to its default
            torch.cuda.synchronize()
            want = experts_reference(x, w13, w2, weights, ids)
            rel = ((run["one"].float() - want).abs().max() / want.abs().max()).item()
            row = {"check": "experts", "shape": name, "tokens": m,
                   "one_equals_two": bool(torch.equal(run["one"], run["two_fused_sum"])),
                   "fused_sum_equals_sum_rows": bool(torch.equal(run["two_fused_sum"], run["two_sum_rows"])),
                   "deterministic": all(torch.equal(r, run["one"]) for r in repeat),
                   "counters_zero": not any(bool(buf.any()) for buf in small_m._ARRIVALS.get(x.device, [])),
                   "max_rel_err_vs_fp32": round(rel, 5)}
            row["ok"] = (row["one_equals_two"] and row["fused_sum_equals_sum_rows"] and row["deterministic"]
                         and row["counters_zero"] and rel < 2e-2)
            ok &= row["ok"]
            emit(row)
    return ok


def choice_values(logits: torch.Tensor, cfg: RoutingConfig, bias) -> torch.Tensor:
    """What the top-k ranks: the scores (+ the correction bias), fp32."""
    lf = logits.float()
    scores = torch.sigmoid(lf) if cfg.scoring == "sigmoid" else torch.softmax(lf, dim=-1)
    return scores + bias if bias is not None else scores


def same_top_k(ids_a: torch.Tensor, ids_b: torch.Tensor, choice: torch.Tensor, tol: float = 2e-3) -> bool:
    """The same experts per row, or where the two differ every expert in only one of them ranks within
    `tol` of the row's k-th value (a near-tie that a last-bit difference of the logits may flip)."""
    for row in range(ids_a.shape[0]):
        a, b = set(ids_a[row].tolist()), set(ids_b[row].tolist())
        if a == b:
            continue
        kth = choice[row].topk(ids_a.shape[1]).values[-1]
        if any(abs(choice[row, j] - kth).item() > tol for j in a ^ b):
            return False
    return True


def check_routers(emit, gen) -> bool:
    from radixserve.layers import triton_ops

    ok = True
    e, h = 128, 2048
    cases = {"softmax-renorm": (RoutingConfig(top_k=8, scoring="softmax", renormalize=True), False),
             "sigmoid-bias-scaled": (RoutingConfig(top_k=8, scoring="sigmoid", renormalize=True,
                                                   routed_scaling_factor=2.5), True)}
    arrivals = torch.zeros(small_m.SMALL_M_MAX_PAIRS, dtype=torch.int32, device="cuda")
    gate_w = torch.randn(e, h, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05
    norm_w = (1 + 0.1 * torch.randn(h, device="cuda", generator=gen)).to(torch.bfloat16)
    for name, (cfg, with_bias) in cases.items():
        bias = torch.randn(e, device="cuda", generator=gen) * 0.1 if with_bias else None
        for m in (1, 4, 8):
            logits = torch.randn(m, e, device="cuda", generator=gen) * 2  # fp32: no ties
            want_w, want_ids = select_experts(logits, cfg, bias)
            got_w, got_ids = small_m.fused_select_experts(logits, cfg, bias)
            digest(f"router/{name}/{m}", got_w, got_ids)
            x = torch.randn(m, h, device="cuda", generator=gen, dtype=torch.bfloat16)
            lin_logits = x @ gate_w.t()  # the linear layer, then the router
            lin_w, lin_ids = small_m.fused_select_experts(lin_logits, cfg, bias)
            gate_runs = [small_m.fused_gate_select_experts(x, gate_w, cfg, arrivals, bias) for _ in range(50)]
            g_w, g_ids = gate_runs[0]
            digest(f"gate_router/{name}/{m}", g_w, g_ids)
            hs = torch.randn(m, h, device="cuda", generator=gen, dtype=torch.bfloat16)
            res_in = torch.randn(m, h, device="cuda", generator=gen, dtype=torch.bfloat16)
            nx, nres = triton_ops.rmsnorm(hs, norm_w, 1e-6, res_in)
            n_want_w, n_want_ids = small_m.fused_gate_select_experts(nx, gate_w, cfg, arrivals, bias)
            fx, fres, n_w, n_ids = small_m.fused_norm_gate_select_experts(hs, res_in, norm_w, 1e-6, gate_w, cfg,
                                                                          arrivals, bias)
            digest(f"norm_gate_router/{name}/{m}", fx, fres, n_w, n_ids)
            torch.cuda.synchronize()
            row = {"check": "routers", "routing": name, "tokens": m,
                   "router_ids_equal_torch": bool(torch.equal(got_ids.long(), want_ids.long())),
                   "router_max_weight_diff": round((got_w - want_w.float()).abs().max().item(), 6),
                   "gate_ids_equal_linear_router": bool(torch.equal(g_ids, lin_ids)),
                   "gate_same_top_k_up_to_ties": same_top_k(g_ids, lin_ids, choice_values(lin_logits, cfg, bias)),
                   "gate_max_weight_diff": round((g_w.sort(1).values - lin_w.sort(1).values).abs().max().item(), 5),
                   "gate_same_over_50_launches": all(torch.equal(w, g_w) and torch.equal(i, g_ids)
                                                     for w, i in gate_runs),
                   "norm_residual_bit_equal": bool(torch.equal(fres, nres)),
                   "norm_ids_equal": bool(torch.equal(n_ids, n_want_ids)),
                   "norm_same_top_k_up_to_ties": same_top_k(n_ids, n_want_ids,
                                                            choice_values(nx.float() @ gate_w.float().t(), cfg, bias)),
                   "norm_max_weight_diff": round((n_w - n_want_w).abs().max().item(), 5),
                   "counters_zero": not bool(arrivals.any())}
            row["ok"] = (row["router_ids_equal_torch"] and row["router_max_weight_diff"] < 1e-4
                         and row["gate_same_top_k_up_to_ties"] and row["gate_same_over_50_launches"]
                         and row["norm_residual_bit_equal"] and row["norm_same_top_k_up_to_ties"]
                         and row["counters_zero"])
            ok &= row["ok"]
            emit(row)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ref", help="a tidy_digests.json of another tree: every digest must be the same")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tidy_check.jsonl")

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    gen = torch.Generator(device="cuda").manual_seed(0)
    log("experts: one launch vs two (fused row sum, sum_rows launch)")
    ok = check_experts(emit, gen)
    log("routers: fused top-k, gate + top-k in one launch, the norm in the router's launch")
    ok &= check_routers(emit, gen)
    with open(os.path.join(args.out, "tidy_digests.json"), "w") as f:
        json.dump(DIGESTS, f, indent=1)
    if args.ref:
        ref = json.load(open(args.ref))
        differ = sorted(k for k in ref if DIGESTS.get(k) != ref[k])
        emit({"check": "digests_vs_ref", "ref": args.ref, "compared": len(ref), "differ": differ, "ok": not differ})
        ok &= not differ
    log(f"tidy check {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
