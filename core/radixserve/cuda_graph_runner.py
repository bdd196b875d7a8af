"""Decode graphs: capture the model's decode forward (and LM head) for a set of batch sizes,
then replay the smallest captured size that fits, padding the batch.

Why: at batch 1 a decode step is ~300 tiny kernels; launching them one by one from Python costs
more than the GPU work. A captured graph launches them all at once.

Bookkeeping rules:
- Every tensor a graph reads lives in the static buffers below (`self.buf_*`); replay copies the
  real batch into their first `real_bs` rows and fills padding rows with harmless values: the
  reserved `dummy_row` of the ReqToTokenPool (all zeros -> KV slot 0, the pool's padding slot),
  seq_len 1, position 0, input id 0, out_cache_loc 0. So padding writes only to slot 0 and never
  touches a real request's KV.
- The attention backend keeps its own graph metadata static through its graph hooks
  (`init_graph_state`, `init_forward_metadata_capture`, `init_forward_metadata_replay`).
- Hidden-state recording for drafters (`set_recording`): the captured forward also writes the
  final hidden rows and/or the requested layers' residual rows into static buffers
  (`buf_final` [max_bs, hidden], `buf_aux` [max_bs, len(aux_layers) * hidden], layer blocks in
  the requested order), so a verify or decode step with a drafter attached still replays;
  `recorded_rows(bs)` views the first `bs` rows after a replay (overwritten by the next one).
- `graph_factory` is injectable so the CPU tests exercise the same bookkeeping with an eager
  stand-in (`EagerGraph`) that re-runs the captured function on replay.
"""

from __future__ import annotations

import bisect
import gc
from collections.abc import Callable
from dataclasses import replace

import torch

from radixserve.state import ForwardBatch, ForwardMode


def default_capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_bs] or [1]


class EagerGraph:
    """Stand-in for torch.cuda.CUDAGraph on devices without graphs: replay re-runs the function,
    which reads the same static buffers a real graph would. `capture(fn)` returns fn's output;
    `replay()` returns it again. Drafters capturing their own steps may use it for CPU tests.
    Added in plugin API 1.5."""

    def __init__(self) -> None:
        self._fn: Callable[[], torch.Tensor] | None = None
        self.output: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._fn = fn
        self.output = fn()
        return self.output

    def replay(self) -> torch.Tensor:
        assert self._fn is not None
        self.output = self._fn()
        return self.output


class CudaGraph:
    """torch.cuda.CUDAGraph; graphs built with the same `pool` handle share one memory pool
    (the DecodeGraphRunner passes its own, so pools never outlive or cross runners).
    `capture(fn)` runs fn twice (warm-up), then captures it and returns its output (static
    tensors, rewritten by every `replay()`, which returns them). fn must read only static
    buffers and never synchronize with the host. Added in plugin API 1.5 (for drafters)."""

    def __init__(self, pool=None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.output: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        for _ in range(2):  # warm-up outside the graph (lazy inits, autotuning)
            fn()
        torch.cuda.synchronize()
        caller = torch.cuda.current_stream()
        # no cyclic GC inside the capture: a dropped graph still held in a reference cycle (a drafter
        # and its graphs form one) would be destroyed there, which the driver refuses while a stream
        # is capturing, invalidating this capture (torch >= 2.9 no longer collects before capturing)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=self.pool):
                self.output = fn()
        except BaseException:
            # torch.cuda.graph's __exit__ ends the capture before it restores the caller's stream:
            # when ending raises (an invalidated capture) this thread would stay on torch's side
            # capture stream, and whoever falls back to eager would queue everything there
            torch.cuda.set_stream(caller)
            raise
        finally:
            if collecting:
                gc.enable()
        return self.output

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        assert self.output is not None
        return self.output


def record_buffers(max_bs: int, hidden_size: int, final: bool, num_aux: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The static buffers a recording graph writes: (final [max_bs, hidden] when `final`, aux
    [max_bs, num_aux * hidden] when `num_aux`), zero-filled (padding rows stay harmless)."""
    buf_final = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device) if final else None
    buf_aux = torch.zeros(max_bs, num_aux * hidden_size, dtype=dtype, device=device) if num_aux else None
    return buf_final, buf_aux


def write_recorded_rows(buf_final: torch.Tensor | None, buf_aux: torch.Tensor | None, hidden: torch.Tensor,
                        aux_states: list[torch.Tensor] | None) -> None:
    """Copy one forward's rows into the first rows of the record buffers (inside the captured
    forward): `hidden` [bs, H] into `buf_final`; aux layer j's rows into columns [j*H, (j+1)*H) of
    `buf_aux`, the layout `torch.cat(aux_states, -1)` has (what the eager path records)."""
    bs = hidden.shape[0]
    if buf_final is not None:
        buf_final[:bs].copy_(hidden)
    if buf_aux is not None:
        if aux_states is None:
            raise RuntimeError("the graph records aux hidden states but the model captured none")
        at = 0
        for a in aux_states:
            buf_aux[:bs, at : at + a.shape[-1]].copy_(a)
            at += a.shape[-1]
        if at != buf_aux.shape[1]:
            raise RuntimeError(f"aux hidden states are {at} wide, the record buffer {buf_aux.shape[1]}")


class DecodeGraphRunner:
    def __init__(
        self,
        model,
        attn_backend,
        req_to_token_pool,
        kv_pool,
        device: torch.device,
        capture_sizes: list[int],
        dummy_row: int,
        graph_factory: Callable[[], EagerGraph | CudaGraph] | None = None,
    ) -> None:
        self.model = model
        self.backend = attn_backend
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.device = device
        self.sizes = sorted(set(capture_sizes))
        self.max_bs = self.sizes[-1]
        self.dummy_row = dummy_row
        self.graph_factory = graph_factory or (self._cuda_graph if device.type == "cuda" else EagerGraph)
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        req_to_token_pool.req_to_token[dummy_row].zero_()
        n, dev, i64 = self.max_bs, device, torch.int64
        self.buf_input_ids = torch.zeros(n, dtype=i64, device=dev)
        self.buf_positions = torch.zeros(n, dtype=i64, device=dev)
        self.buf_req_pool_indices = torch.full((n,), dummy_row, dtype=i64, device=dev)
        self.buf_seq_lens = torch.ones(n, dtype=i64, device=dev)
        self.buf_prefix_lens = torch.zeros(n, dtype=i64, device=dev)
        self.buf_extend_lens = torch.ones(n, dtype=i64, device=dev)
        self.buf_out_cache_loc = torch.zeros(n, dtype=i64, device=dev)
        self.graphs: dict[int, EagerGraph | CudaGraph] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.recording: tuple[bool, tuple[int, ...]] = (False, ())  # (final, aux layers) the graphs write
        self.buf_final: torch.Tensor | None = None
        self.buf_aux: torch.Tensor | None = None
        if self.backend.supports_cuda_graph():
            self.backend.init_graph_state(self.max_bs)
        self.capture()

    def _cuda_graph(self) -> CudaGraph:
        return CudaGraph(self._pool)

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.buf_input_ids[:bs],
            positions=self.buf_positions[:bs],
            req_pool_indices=self.buf_req_pool_indices[:bs],
            seq_lens=self.buf_seq_lens[:bs],
            prefix_lens=self.buf_prefix_lens[:bs],
            extend_lens=self.buf_extend_lens[:bs],
            out_cache_loc=self.buf_out_cache_loc[:bs],
            req_to_token_pool=self.req_to_token_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.backend,
            seq_lens_cpu=[1] * bs,
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
        )

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.model.forward(fb.input_ids, fb.positions, fb)
        write_recorded_rows(self.buf_final, self.buf_aux, hidden, self.model.aux_hidden_states
                            if self.buf_aux is not None else None)
        return self.model.compute_logits(hidden)

    def set_recording(self, final: bool, aux_layers: tuple[int, ...], hidden_size: int, dtype: torch.dtype) -> None:
        """Make the graphs write what a drafter reads (the model's aux layers must already be set
        to `aux_layers`): allocates the static record buffers and captures every size again.
        Nothing happens when the graphs already record exactly this."""
        want = (bool(final), tuple(aux_layers))
        if want == self.recording:
            return
        self.buf_final, self.buf_aux = record_buffers(self.max_bs, hidden_size, want[0], len(want[1]), dtype,
                                                      self.device)
        self.graphs, self.batches = {}, {}
        if self.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()  # the old graphs' memory goes with them
        self.capture()
        self.recording = want

    def recorded_rows(self, bs: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(final [bs, hidden] or None, aux [bs, n_aux * hidden] or None) of the last replay: views
        of the static buffers, valid until the next replay."""
        final = self.buf_final[:bs] if self.buf_final is not None else None
        aux = self.buf_aux[:bs] if self.buf_aux is not None else None
        return final, aux

    def capture(self) -> None:
        graphs_supported = self.backend.supports_cuda_graph()
        for bs in reversed(self.sizes):  # largest first: its memory is reused by the smaller ones
            fb = self._static_batch(bs)
            if graphs_supported:
                self.backend.init_forward_metadata_capture(fb)
            else:
                self.backend.init_forward_metadata(fb)
            graph = self.graph_factory()
            with torch.inference_mode():
                graph.capture(lambda fb=fb: self._forward(fb))
            self.graphs[bs] = graph
            self.batches[bs] = fb

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.mode is ForwardMode.DECODE and fb.batch_size <= self.max_bs

    def padded_size(self, bs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, bs)]

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [fb.batch_size, vocab] for a decode batch, through the captured graph."""
        bs, pbs = fb.batch_size, self.padded_size(fb.batch_size)
        # reset the padding rows, then copy the real rows in
        self.buf_req_pool_indices[bs:pbs].fill_(self.dummy_row)
        self.buf_seq_lens[bs:pbs].fill_(1)
        self.buf_input_ids[bs:pbs].zero_()
        self.buf_positions[bs:pbs].zero_()
        self.buf_out_cache_loc[bs:pbs].zero_()
        self.buf_input_ids[:bs].copy_(fb.input_ids)
        self.buf_positions[:bs].copy_(fb.positions)
        self.buf_req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.buf_seq_lens[:bs].copy_(fb.seq_lens)
        self.buf_prefix_lens[:bs].copy_(fb.prefix_lens)
        self.buf_out_cache_loc[:bs].copy_(fb.out_cache_loc)
        static = self.batches[pbs]
        pad = pbs - bs
        static = replace(
            static,
            seq_lens_cpu=list(fb.seq_lens_cpu) + [1] * pad,
            prefix_lens_cpu=list(fb.prefix_lens_cpu) + [0] * pad,
        )
        self.batches[pbs] = static
        if self.backend.supports_cuda_graph():
            self.backend.init_forward_metadata_replay(static, bs)
        else:
            self.backend.init_forward_metadata(static)
        graph = self.graphs[pbs]
        if isinstance(graph, EagerGraph):
            graph._fn = lambda: self._forward(static)
        return graph.replay()[:bs]
