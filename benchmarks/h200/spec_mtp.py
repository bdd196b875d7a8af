"""MTP drafter on the GPU (issue 17): greedy outputs with `stack.speculative=mtp` equal to those
without, on tiny random DeepSeek-V3 checkpoints with an MTP layer (built on the fly with the test
helper plugins/speculative/mtp/tests/mtp_checkpoints.py), fp32 and bf16, chains of 2 and 3,
batched with shared prefixes; plus the acceptance length of an MTP layer that copies the target.

    python benchmarks/h200/spec_mtp.py --out $OUT      (writes $OUT/spec_mtp.json)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins/speculative/mtp/tests"))

from mtp_checkpoints import write_copy_target, write_tiny_v3_with_mtp  # noqa: E402
from radixserve.config import Config  # noqa: E402
from radixserve.model_runner import ModelRunner  # noqa: E402
from radixserve.plugins.registry import Registry  # noqa: E402
from radixserve.runtime.messages import GenerateRequest  # noqa: E402
from radixserve.scheduler import Scheduler  # noqa: E402
from radixserve.scheduler.speculative.setup import build_drafter  # noqa: E402
from radixserve.state import SamplingParams  # noqa: E402
from radixserve.testing import run_to_completion  # noqa: E402


def run(path: str, device: str, dtype: str, steps: int | None, prompts: list[list[int]], n: int) -> tuple[dict, dict]:
    spec = {"stack": {"prefix_cache": "radix", "speculative": "mtp" if steps else None},
            "speculative": {"num_draft_tokens": steps or 4, "adaptive_batch_size": 0}}
    cfg = Config.build({"model": {"path": path}, "runtime": {"device": device, "dtype": dtype},
                        "scheduler": {"max_total_tokens": 20000, "max_running_requests": 64}, **spec})
    runner = ModelRunner(cfg, show_progress=False)
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    sched = Scheduler(cfg, runner, cache, reg.load("policy", "fcfs")(), drafter=build_drafter(cfg, runner, reg))
    reqs = [GenerateRequest(rid=f"r{i}", input_ids=p, sampling_params=SamplingParams(
        max_new_tokens=n, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)]
    return run_to_completion(sched, reqs), sched.stats()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    rng = random.Random(0)
    base = [rng.randrange(512) for _ in range(40)]
    prompts = [(base if i % 2 else []) + [rng.randrange(512) for _ in range(rng.randint(5, 60))] for i in range(16)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rnd = write_tiny_v3_with_mtp(Path(tmp) / "v3", seed=3)
        copy = write_copy_target(Path(tmp) / "copy", seed=7)
        for dtype in args.dtypes.split(","):
            for name, path, ps in (("random", rnd, prompts), ("copy", copy, [[rng.randrange(512) for _ in range(100)]
                                                                            for _ in range(8)])):
                plain, _ = run(path, args.device, dtype, None, ps, 32)
                for steps in (2, 3):
                    out, stats = run(path, args.device, dtype, steps, ps, 32)
                    same = sum(out[r] == plain[r] for r in plain)
                    row = {"checkpoint": name, "dtype": dtype, "k": steps, "identical": f"{same}/{len(plain)}",
                           "accept_length": round(stats["spec_accept_length"], 3), "verifies": stats["spec_verifies"]}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    Path(args.out, "spec_mtp.json").write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r["identical"].split("/")[0] != r["identical"].split("/")[1]]
    print(f"SUMMARY mtp lossless on {args.device}:", "all identical" if not bad else f"{len(bad)} rows differ", flush=True)


if __name__ == "__main__":
    main()
