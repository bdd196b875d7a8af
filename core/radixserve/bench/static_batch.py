"""Drive the ModelRunner over one static batch: prefill every prompt, then decode N steps.

No scheduler, no cache: the smallest loop that exercises the whole forward path, used by
`bench one-batch` (timings) and by tests (outputs)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from radixserve.state import ForwardMode, Req, SamplingParams, ScheduledBatch


@dataclass
class StaticBatchResult:
    output_ids: list[list[int]]
    prefill_s: float
    decode_step_s: list[float] = field(default_factory=list)
    used_cuda_graph: bool = False


class StaticBatchDriver:
    def __init__(self, runner) -> None:
        self.runner = runner

    def _sync(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()

    def run(
        self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams | None = None
    ) -> StaticBatchResult:
        r = self.runner
        params = sampling or SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
        reqs = [Req(rid=str(i), origin_input_ids=list(p), sampling_params=params) for i, p in enumerate(prompts)]
        rows: list[int] = []
        slots: list[torch.Tensor] = []
        try:
            for req in reqs:
                row = r.req_to_token_pool.alloc()
                loc = r.token_allocator.alloc(len(req.origin_input_ids))
                if row is None or loc is None:
                    raise RuntimeError("static batch does not fit the KV pool; raise scheduler.max_total_tokens")
                rows.append(row)
                slots.append(loc)
                req.req_pool_idx = row
                r.req_to_token_pool.write(row, 0, loc)
            self._sync()
            t0 = time.perf_counter()
            res = r.run_batch(
                ScheduledBatch(
                    mode=ForwardMode.EXTEND,
                    reqs=reqs,
                    input_ids=[t for p in prompts for t in p],
                    req_pool_indices=rows,
                    prefix_lens=[0] * len(reqs),
                    extend_lens=[len(p) for p in prompts],
                    out_cache_loc=torch.cat(slots),
                    sample_mask=[True] * len(reqs),
                )
            )
            self._sync()
            out = StaticBatchResult(output_ids=[[t] for t in res.next_token_ids], prefill_s=time.perf_counter() - t0)
            lens = [len(p) for p in prompts]
            for _ in range(max_new_tokens - 1):
                loc = r.token_allocator.alloc(len(reqs))
                if loc is None:
                    raise RuntimeError("static batch ran out of KV slots while decoding")
                slots.append(loc)
                for i, req in enumerate(reqs):
                    r.req_to_token_pool.write(req.req_pool_idx, lens[i], loc[i : i + 1])
                    req.output_ids = out.output_ids[i]
                    req.kv_len = lens[i]
                t0 = time.perf_counter()
                res = r.run_batch(
                    ScheduledBatch(
                        mode=ForwardMode.DECODE,
                        reqs=reqs,
                        input_ids=[o[-1] for o in out.output_ids],
                        req_pool_indices=rows,
                        prefix_lens=lens,
                        extend_lens=[1] * len(reqs),
                        out_cache_loc=loc,
                        sample_mask=[True] * len(reqs),
                    )
                )
                self._sync()
                out.decode_step_s.append(time.perf_counter() - t0)
                for i, t in enumerate(res.next_token_ids):
                    out.output_ids[i].append(t)
                lens = [n + 1 for n in lens]
            out.used_cuda_graph = bool(getattr(r, "last_run_used_cuda_graph", False))
            return out
        finally:
            for s in slots:
                r.token_allocator.free(s)
            for row in rows:
                r.req_to_token_pool.free(row)
