"""Extend graphs: capture the model's forward of EXTEND batches (prefill chunks, and prefill chunks
with decode rows mixed in) for a set of token counts, then replay the smallest captured count that
fits, padding the batch.

Why: an eager forward of an 8B model launches ~20 kernels a layer one by one from Python; on a
Hopper GPU that host work (25-50 ms a step, benchmarks/results/h100-session16.md) exceeds the
kernels' time for prompts up to ~1k tokens, and every decode row riding in such a step waits for it
(issue 18's ITL p99). A captured graph launches them all at once.

Bookkeeping rules (the decode runner's, in radixserve.cuda_graph_runner, extended to requests of
any length):
- A graph is captured per token count T, always for `max_reqs` request slots. Every tensor it reads
  lives in the static buffers below; `run` copies a real batch of n <= T tokens in bs < max_reqs
  requests into their first rows.
- Padding: the T - n padding tokens belong to one padding request right after the real ones (prefix
  0, the reserved `dummy_row` of the ReqToTokenPool, input id 0, position 0, KV slot 0 for each, the
  pool's padding slot); the remaining request slots are empty (no new tokens, prefix 0). Padding
  rows attend only to each other, so they never touch a real request's KV or output.
- The model must not read host lengths in its EXTEND forward (the graph replays what it did at
  capture); the attention backend refreshes its static metadata through its extend-graph hooks
  (`init_extend_graph_state`, `init_extend_metadata_capture`, `init_extend_metadata_replay`,
  plugin API 1.10).
- The graph ends with the LM head on each request's last new token (`buf_logit_rows`), so it returns
  logits [max_reqs, vocab]; `run` hands back the real requests' rows.
- `graph_factory` is injectable: the CPU tests run the same bookkeeping with `EagerGraph`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import replace

import torch

from radixserve.cuda_graph_runner import CudaGraph, EagerGraph
from radixserve.state import ForwardBatch, ForwardMode


def default_extend_token_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture up to `max_tokens`: steps of 64 to 512, of 128 to 2048, of 256
    beyond (a step pads by at most ~12%), and `max_tokens` itself."""
    steps = list(range(64, 513, 64)) + list(range(640, 2049, 128)) + list(range(2304, 16385, 256))
    return sorted({s for s in steps if s < max_tokens} | {max_tokens})


class ExtendGraphRunner:
    def __init__(
        self,
        model,
        attn_backend,
        req_to_token_pool,
        kv_pool,
        device: torch.device,
        token_sizes: list[int],
        max_reqs: int,
        dummy_row: int,
        graph_factory: Callable[[], EagerGraph | CudaGraph] | None = None,
    ) -> None:
        if not attn_backend.supports_extend_cuda_graph():
            raise ValueError(f"attention backend {type(attn_backend).__name__} has no extend CUDA-graph support")
        if max_reqs < 2:
            raise ValueError(f"extend graphs need at least 2 request slots (one is the padding request), got {max_reqs}")
        width = int(req_to_token_pool.req_to_token.shape[1])
        if max(token_sizes) > width:  # the padding request holds up to that many tokens in one row
            raise ValueError(f"extend graphs of up to {max(token_sizes)} tokens need ReqToTokenPool rows that long; "
                             f"they hold {width} (the context length)")
        self.model = model
        self.backend = attn_backend
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.device = device
        self.sizes = sorted(set(token_sizes))
        self.max_tokens = self.sizes[-1]
        self.max_reqs = max_reqs
        self.dummy_row = dummy_row
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graph_factory = graph_factory or (self._cuda_graph if device.type == "cuda" else EagerGraph)
        req_to_token_pool.req_to_token[dummy_row].zero_()
        t, r, dev, i64 = self.max_tokens, max_reqs, device, torch.int64
        self.buf_input_ids = torch.zeros(t, dtype=i64, device=dev)
        self.buf_positions = torch.zeros(t, dtype=i64, device=dev)
        self.buf_out_cache_loc = torch.zeros(t, dtype=i64, device=dev)
        self.buf_req_pool_indices = torch.full((r,), dummy_row, dtype=i64, device=dev)
        # the per-request lengths and each request's last-token row: one block, refreshed by one copy
        self.buf_lengths = torch.zeros(4, r, dtype=i64, device=dev)
        self.buf_seq_lens, self.buf_prefix_lens, self.buf_extend_lens, self.buf_logit_rows = self.buf_lengths
        self.graphs: dict[int, EagerGraph | CudaGraph] = {}
        self.batches: dict[int, ForwardBatch] = {}
        attn_backend.init_extend_graph_state(self.max_tokens, max_reqs)
        self.capture()

    def _cuda_graph(self) -> CudaGraph:
        return CudaGraph(self._pool)

    def _static_batch(self, tokens: int) -> ForwardBatch:
        r = self.max_reqs
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            batch_size=r,
            input_ids=self.buf_input_ids[:tokens],
            positions=self.buf_positions[:tokens],
            req_pool_indices=self.buf_req_pool_indices,
            seq_lens=self.buf_seq_lens,
            prefix_lens=self.buf_prefix_lens,
            extend_lens=self.buf_extend_lens,
            out_cache_loc=self.buf_out_cache_loc[:tokens],
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.backend,
            # at capture: all tokens in the padding request (slot 0)
            seq_lens_cpu=[tokens] + [0] * (r - 1),
            prefix_lens_cpu=[0] * r,
            extend_lens_cpu=[tokens] + [0] * (r - 1),
        )

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.model.forward(fb.input_ids, fb.positions, fb)
        return self.model.compute_logits(hidden.index_select(0, self.buf_logit_rows))

    def capture(self) -> None:
        for tokens in reversed(self.sizes):  # largest first: its memory is reused by the smaller ones
            fb = self._static_batch(tokens)
            self._write_lengths(fb)
            self.backend.init_extend_metadata_capture(fb)
            graph = self.graph_factory()
            with torch.inference_mode():
                graph.capture(lambda fb=fb: self._forward(fb))
            self.graphs[tokens] = graph
            self.batches[tokens] = fb

    def _write_lengths(self, fb: ForwardBatch) -> None:
        """Copy the static batch's host lengths (and each request's last-token row) to the device."""
        rows, start = [], 0
        for e in fb.extend_lens_cpu:
            rows.append(start + e - 1 if e else 0)
            start += e
        host = torch.tensor([fb.seq_lens_cpu, fb.prefix_lens_cpu, fb.extend_lens_cpu, rows], dtype=torch.int64)
        self.buf_lengths.copy_(host, non_blocking=True)

    def can_run(self, fb: ForwardBatch) -> bool:
        """An EXTEND batch without a tree mask whose tokens fit the largest graph and whose requests
        leave a slot for the padding request."""
        return (fb.mode is ForwardMode.EXTEND and fb.tree_mask is None and fb.batch_size < self.max_reqs
                and 0 < fb.num_tokens <= self.max_tokens and len(fb.extend_lens_cpu) == fb.batch_size)

    def padded_size(self, tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, tokens)]

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [fb.batch_size, vocab], one row per request (its last new token), through the
        captured graph of the smallest token count that fits."""
        n, bs = fb.num_tokens, fb.batch_size
        tokens = self.padded_size(n)
        pad, empty = tokens - n, self.max_reqs - bs - 1
        self.buf_input_ids[:n].copy_(fb.input_ids)
        self.buf_positions[:n].copy_(fb.positions)
        self.buf_out_cache_loc[:n].copy_(fb.out_cache_loc)
        if pad:
            self.buf_input_ids[n:tokens].zero_()
            self.buf_positions[n:tokens].zero_()
            self.buf_out_cache_loc[n:tokens].zero_()
        self.buf_req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.buf_req_pool_indices[bs:].fill_(self.dummy_row)
        static = replace(
            self.batches[tokens],
            seq_lens_cpu=list(fb.seq_lens_cpu) + [pad] + [0] * empty,
            prefix_lens_cpu=list(fb.prefix_lens_cpu) + [0] * (empty + 1),
            extend_lens_cpu=list(fb.extend_lens_cpu) + [pad] + [0] * empty,
        )
        self._write_lengths(static)
        self.backend.init_extend_metadata_replay(static, bs)
        graph = self.graphs[tokens]
        if isinstance(graph, EagerGraph):
            graph._fn = lambda: self._forward(static)
        return graph.replay()[:bs]
