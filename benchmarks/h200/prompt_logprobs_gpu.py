"""Prompt logprobs on CUDA (SamplingParams.prompt_logprobs): a tiny random Llama through the scheduler
on the GPU against transformers (fp32, on the CPU), with the extend CUDA graphs off and on (a batch that
scores a prompt must run eagerly: the graphs keep only each request's last row), chunked or not, with
a plain request batched beside the scored ones. Prints one JSON line per case; exit 0 when all agree.

    python benchmarks/h200/prompt_logprobs_gpu.py [--attention triton|flashinfer]"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile

import torch
from radixserve.config import Config
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.state import SamplingParams
from radixserve.testing import tiny_checkpoint


def run(path: str, device: str, attention: str, chunk: int | None, graph_tokens: int, prompts: list[list[int]]) -> dict:
    cfg = Config.build({
        "model": {"path": path},
        "stack": {"attention": attention},
        "runtime": {"device": device, "dtype": "float32", "cuda_graph_extend_max_tokens": graph_tokens},
        "scheduler": {"max_total_tokens": 4096, "max_running_requests": 8, "chunked_prefill_size": chunk},
    })
    sched = Scheduler.from_config(cfg, ModelRunner(cfg, show_progress=False), Registry.discover())
    for i, p in enumerate(prompts):
        sched.add_request(GenerateRequest(rid=f"p{i}", input_ids=p, sampling_params=SamplingParams(
            max_new_tokens=4, temperature=0, prompt_logprobs=3)))
    sched.add_request(GenerateRequest(rid="plain", input_ids=prompts[-1], sampling_params=SamplingParams(
        max_new_tokens=4, temperature=0)))
    outs: dict[str, list] = {}
    while sched.has_work():
        for out in sched.step():
            outs.setdefault(out.rid, []).append(out)
    return outs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--device", default="cuda")  # cpu (with --attention cpu_batched): a check of the script
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("llama", tempfile.mkdtemp())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = random.Random(0)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (2, 37, 150)]
    refs = []
    with torch.no_grad():
        for p in prompts:
            lp = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1)
            refs.append((lp[torch.arange(len(p) - 1), torch.tensor(p[1:])], lp[:-1].topk(3).indices))
    ok = True
    for chunk in (None, 32):
        for graphs in (0, 256):
            outs = run(path, args.device, args.attention, chunk, graphs, prompts)
            err, tops_equal = 0.0, True
            for i, (ref, ref_top) in enumerate(refs):
                first = outs[f"p{i}"][0]
                err = max(err, (torch.tensor(first.prompt_token_logprobs) - ref).abs().max().item())
                tops_equal &= [[t for t, _ in alts] for alts in first.prompt_top_logprobs] == ref_top.tolist()
            same_output = [t for o in outs["plain"] for t in o.new_ids] == [t for o in outs[f"p{len(prompts) - 1}"]
                                                                            for t in o.new_ids]
            case_ok = err < 2e-2 and tops_equal and same_output  # fp32 on CUDA may run matmuls as TF32
            ok &= case_ok
            print(json.dumps({"attention": args.attention, "chunk": chunk, "extend_graph_tokens": graphs,
                              "max_abs_err": err, "top3_ids_equal": tops_equal,
                              "plain_request_unchanged": same_output, "ok": case_ok}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
