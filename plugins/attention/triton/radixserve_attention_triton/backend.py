"""TritonAttentionBackend: extend and decode attention with this plugin's Triton kernels.

Per forward, `init_forward_metadata` builds the small index tensors every layer reuses (extend: start
offset of each request's new tokens; decode: KV split count per request plus the split scratch
buffers), all on the device and without reading lengths back from it. For CUDA graphs, decode
metadata lives in static buffers sized for `max_bs` and is refreshed in place before each replay.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from radixserve.interfaces.attention import AttentionBackend
from radixserve.layers.extend_layout import extend_starts, tree_mask_starts
from radixserve.layers.kv_splits import SplitKVDecodeMetadata, split_planning_defaults
from radixserve.layers.triton_interpreter import interpreter_enabled
from radixserve.memory.fp8_kv import dequantize_fp8
from radixserve.state import ForwardMode

from radixserve_attention_triton.decode_kernel import (
    DecodeConfig,
    compute_num_kv_splits,
    decode_attention,
    decode_merge_pdl,
    decode_pdl,
)
from radixserve_attention_triton.decode_work import DecodeWork, plan_decode_work, work_items_bound, worth_a_work_list
from radixserve_attention_triton.extend_kernel import (
    ExtendConfig,
    ExtendWork,
    extend_attention,
    extend_config,
    planned_extend_work,
    write_extend_plan,
)
from radixserve_attention_triton.fresh_prompts import (
    cumulative_lengths,
    per_request_sdpa,
    varlen_attention,
    varlen_available,
)
from radixserve_attention_triton.rotary_store_kernel import rotary_and_store, rotary_store_pdl

if TYPE_CHECKING:
    from radixserve.interfaces.attention import AttentionLayerSpec
    from radixserve.state import ForwardBatch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ExtendMetadata:
    extend_start: torch.Tensor  # int64 [bs]: offset of request i's first new token in the packed tokens
    max_extend_len: int  # host int: the longest request's new tokens
    work: ExtendWork | None = None  # the kernel's blocks (planned from host lengths; static in a graph)
    # speculative verify of draft trees: the flat mask as uint8 and where request i's block starts
    tree_mask: torch.Tensor | None = None
    mask_start: torch.Tensor | None = None  # int64 [bs]
    depths: torch.Tensor | None = None  # int32 [num_tokens]: each draft token's depth (places it in a window)
    # host lengths of the new tokens when every request starts from an empty prefix (a fresh
    # prompt's first chunk) and no tree mask: such a batch may use PyTorch's flash SDPA
    fresh_prompt_lens: list[int] | None = None
    # int32 [bs + 1] on the device: the fresh prompts' cumulative lengths, when they take one varlen
    # flash call (fresh_prompts.varlen_attention) instead of one SDPA call each
    fresh_cu_seqlens: torch.Tensor | None = None


@dataclass
class DecodeMetadata(SplitKVDecodeMetadata):
    """mid_o: float32 [bs, H, max_kv_splits, head_dim]; `work`: the split kernel's work list when the
    backend uses one for this batch size (`decode_work_list`), planned with the split counts."""

    work: DecodeWork | None = None


def _max_batch_size(info: Any) -> int:
    for name in ("max_bs", "max_batch_size", "max_running_requests"):
        value = getattr(info, name, None)
        if value:
            return int(value)
    return 1


class TritonAttentionBackend(AttentionBackend):
    """Attention over the page-size-1 KV pool with Triton kernels (CUDA; the CPU interpreter in tests).

    `runner_info` must provide: device, dtype, num_heads, num_kv_heads, head_dim, req_to_token_pool,
    kv_pool, and a max batch size (max_bs / max_batch_size / max_running_requests).
    Tuning knobs (keyword-only) control decode splitting: at most `max_kv_splits` splits per request,
    none shorter than `min_split_tokens`, and about `sm_count * programs_per_sm` decode programs in
    flight (`sm_count` defaults to the GPU's multiprocessor count); `extend_config` / `decode_config`
    override the kernels' tile sizes. `prefill_sdpa` (default True): an extend batch in which every
    request starts from an empty prefix (no cached tokens, no tree mask, no window or soft-cap in the
    layer) runs PyTorch's flash attention (measured ~2x this plugin's extend kernel on Hopper:
    benchmarks/results/h200-attention-kernels.md): with `prefill_varlen` (default True) one
    `varlen_attn` call for the whole batch where torch has it (CUDA, fp16 / bf16), else
    `scaled_dot_product_attention` per request (`fresh_prompts`); every other extend batch runs the
    Triton kernel. Decode (batch-1 latency, each saving launches
    per layer): `fuse_rotary_store` (default True) applies rotary to q and k in the kernel that
    stores k, v into the pool (`forward_decode_rotary`, when the pool has q's dtype). `decode_work_list`
    (default True): at batch sizes where it is at most a quarter of the plain grid, the split kernel runs one
    program per planned (request, split) item (`decode_work.py`); same partials bit for bit, fewer empty
    programs (H100, 320 rows x 1100 context: the split kernel 16.89 -> 15.68 ms a step,
    benchmarks/results/h100-session30.md).
    CUDA graphs: decode batches (`init_graph_state` ...) and extend batches (`init_extend_graph_state`
    ...: a fixed-size work table of the extend kernel, refreshed from the host lengths before each
    replay; such batches never take the SDPA path).
    """
    supports_tensor_parallel = True  # reads per-rank head counts only

    name = "triton"
    supports_tree_mask = True  # the extend kernel takes ForwardBatch.tree_mask (verify of draft trees)
    # forward_decode stores every row's k, v before the kernel reads the pool, and each row reads
    # its own seq_len: rows may be consecutive tokens of one request (chain verify in decode graphs)
    decode_rows_share_requests = True
    supports_sliding_window = True  # per-layer windows and soft-capping in both kernels (plugin API 1.3)
    supports_logit_cap = True
    # fp8 pools (plugin API 1.5): both kernels load float8_e4m3fn tiles and apply the layer's scales
    supports_fp8_kv_cache = True
    fuses_rotary_with_kv_store = True  # forward_decode_rotary (plugin API 1.5); off: fuse_rotary_store=False
    fuses_qk_norm_with_rotary = True  # forward_decode_rotary(..., qk_norm=) (plugin API 1.6): in the same kernel

    def __init__(
        self,
        runner_info: Any,
        *,
        max_kv_splits: int = 32,
        min_split_tokens: int | None = None,
        sm_count: int | None = None,
        programs_per_sm: int = 4,
        extend_config: ExtendConfig | None = None,
        decode_config: DecodeConfig | None = None,
        prefill_sdpa: bool = True,
        prefill_varlen: bool = True,
        sdpa_max_requests: int = 64,
        fuse_rotary_store: bool = True,
        decode_work_list: bool = True,
    ) -> None:
        self.device = torch.device(runner_info.device)
        dtype = runner_info.dtype
        self.dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.num_heads = int(runner_info.num_heads)
        self.num_kv_heads = int(runner_info.num_kv_heads)
        self.head_dim = int(runner_info.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        self.max_bs = _max_batch_size(runner_info)
        self.req_to_token_pool = runner_info.req_to_token_pool
        self.kv_pool = runner_info.kv_pool
        self.interpret = interpreter_enabled()
        if getattr(self.kv_pool, "is_fp8", False) and self.device.type == "cuda" and not self.interpret:
            major, minor = torch.cuda.get_device_capability(self.device)
            if (major, minor) < (8, 9):  # Triton converts float8_e4m3fn only on Ada / Hopper and newer
                raise ValueError(f"runtime.kv_cache_dtype=fp8_e4m3: the triton attention backend needs compute "
                                 f"capability 8.9+ for fp8 KV (this GPU: {major}.{minor}); use stack.attention="
                                 "torch_native or runtime.kv_cache_dtype=auto")
        self.max_kv_splits = max_kv_splits
        self.min_split_tokens, self.sm_count = split_planning_defaults(self.device, min_split_tokens, sm_count,
                                                                       self.interpret)
        self.programs_per_sm = programs_per_sm
        self.extend_config = extend_config  # None: per-head-dim defaults (extend_kernel.extend_config)
        self.decode_config = decode_config
        self.prefill_sdpa = prefill_sdpa
        self.sdpa_max_requests = sdpa_max_requests  # one SDPA call per request: bounded host work per layer
        self.prefill_varlen = prefill_varlen and varlen_available(self.device, self.dtype, self.head_dim)
        self._graph: DecodeMetadata | None = None
        self._extend_graph: ExtendMetadata | None = None  # static extend metadata (init_extend_graph_state)
        self.fuse_rotary_store = fuse_rotary_store
        self.decode_work_list = decode_work_list
        self._graph_work: DecodeWork | None = None  # the work lists' static buffers (CUDA graphs)

    def set_decode_fusions(self, *, rotary_store: bool) -> None:
        """Turn the decode fusion of rotary with the KV store on or off (the constructor's
        `fuse_rotary_store`); CUDA graphs captured before keep what they recorded. For A/B
        measurements (benchmarks/h200/profile_decode.py)."""
        self.fuse_rotary_store = rotary_store

    @classmethod
    def supports(cls, device: str, dtype: str, head_dim: int) -> bool:
        on_device = device.split(":")[0] == "cuda" or interpreter_enabled()
        return on_device and dtype in _DTYPES and 16 <= head_dim <= 256

    # ---- metadata -----------------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            batch.attn_metadata = self._decode_metadata(batch, DecodeMetadata.allocate(
                batch.batch_size, self.num_heads, self.max_kv_splits, self.head_dim, self.device))
            return
        if batch.mode is ForwardMode.IDLE:
            batch.attn_metadata = None
            return
        extend_start, lens = extend_starts(batch)
        meta = ExtendMetadata(extend_start=extend_start, max_extend_len=max(lens, default=0))
        fresh = batch.tree_mask is None and batch.prefix_lens_cpu and not any(batch.prefix_lens_cpu)
        if fresh and self.prefill_sdpa and self.prefill_varlen and batch.batch_size > 0:
            meta.fresh_prompt_lens = list(lens)  # one call for the batch: no bound on its requests
            meta.fresh_cu_seqlens = cumulative_lengths(lens, self.device)
        elif fresh and self.prefill_sdpa and 0 < batch.batch_size <= self.sdpa_max_requests:
            meta.fresh_prompt_lens = list(lens)
        else:  # the kernel's blocks; fresh prompts take SDPA (a windowed or capped layer: the dense table)
            prefix = batch.prefix_lens_cpu or batch.prefix_lens.tolist()
            meta.work = planned_extend_work(prefix, lens, self._extend_block_m(), self.device,
                                            pack_single_tokens=batch.tree_mask is None)
        if batch.tree_mask is not None:
            meta.tree_mask, meta.mask_start = tree_mask_starts(batch, self.device)
            if batch.tree_mask_cpu is not None:  # host lists: no device sync (verify batches are small)
                depths = [sum(row) - 1 for block in batch.tree_mask_cpu for row in block]
                meta.depths = torch.tensor(depths, dtype=torch.int32).to(self.device, non_blocking=True)
        batch.attn_metadata = meta

    def _decode_metadata(self, batch: ForwardBatch, meta: DecodeMetadata, static_work: DecodeWork | None = None
                         ) -> DecodeMetadata:
        """Plan the split counts into `meta`, and the work list when this batch size takes one (into views
        of `static_work` for a CUDA graph, else fresh buffers)."""
        target = self.programs_per_sm * self.sm_count
        compute_num_kv_splits(batch.seq_lens, meta.num_kv_splits, self.num_kv_heads, self.max_kv_splits,
                              self.min_split_tokens, target_programs=target)
        bs = batch.batch_size
        if self.decode_work_list and worth_a_work_list(bs, self.max_kv_splits, self.num_kv_heads, target):
            items = work_items_bound(bs, self.num_kv_heads, target)
            meta.work = (static_work.first(bs, items) if static_work is not None
                         else DecodeWork.allocate(bs, items, self.device))
            plan_decode_work(meta.num_kv_splits, meta.work)
        return meta

    # ---- forward ------------------------------------------------------------------------------
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: ExtendMetadata = batch.attn_metadata
        q3, k3, v3 = self._split_heads(q, k, v, layer)
        pool = batch.kv_pool
        # the new tokens as the pool stores them (fp8: quantized), for the store and for the kernel
        k_st, v_st = pool.quantize_kv(layer.layer_id, k3, v3)
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k_st, v_st)
        k_scale, v_scale = pool.kv_scales(layer.layer_id)
        window, cap = getattr(layer, "sliding_window", None), getattr(layer, "logit_cap", None)
        if meta.fresh_prompt_lens is not None and not window and not cap:
            if pool.is_fp8:  # attend the stored values, as every later step will
                k3, v3 = dequantize_fp8(k_st, k_scale, q3.dtype), dequantize_fp8(v_st, v_scale, q3.dtype)
            out = None
            if meta.fresh_cu_seqlens is not None:
                out = varlen_attention(q3, k3, v3, layer.scaling, meta.fresh_cu_seqlens, meta.max_extend_len)
            if out is None:
                out = per_request_sdpa(q3, k3, v3, layer.scaling, meta.fresh_prompt_lens)
            return out.view(q.shape[0], -1)
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        out = torch.empty_like(q3)
        extend_attention(
            q3,
            k_st,
            v_st,
            out,
            k_buf,
            v_buf,
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            batch.prefix_lens,
            batch.extend_lens,
            meta.extend_start,
            meta.max_extend_len,
            layer.scaling,
            interpret=self.interpret,
            config=self.extend_config,
            tree_mask=meta.tree_mask,
            mask_start=meta.mask_start,
            sliding_window=window,
            logit_cap=cap,
            depths=meta.depths,
            k_scale=k_scale,
            v_scale=v_scale,
            work=meta.work,
        )
        return out.view(q.shape[0], -1)

    def _extend_block_m(self) -> int:
        """The query block of the extend kernel this backend launches (what its work tables are planned for)."""
        return (self.extend_config or extend_config(self.head_dim, self.dtype, self.interpret)).block_m

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        q3, k3, v3 = self._split_heads(q, k, v, layer)
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k3, v3)
        return self._decode_from_pool(q3, layer, batch)

    def forward_decode_rotary(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, rotary: Any,
        layer: AttentionLayerSpec, batch: ForwardBatch, qk_norm: Any = None,
    ) -> torch.Tensor:
        """One kernel (per-head q/k RMSNorm when `qk_norm` is given,) rotates q and k and stores k, v
        (`rotary_store_kernel`), then decode attention; the unfused path (norms, rotary, then
        `forward_decode`) when the switch is off or the pool's dtype differs from q's (the fused
        store does not cast)."""
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        norm = None
        if qk_norm is not None:
            norm = (qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps)
        if (not self.fuse_rotary_store or not q.dtype == k.dtype == v.dtype == k_buf.dtype == v_buf.dtype
                or rotary.head_dim != layer.head_dim or k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1
                or (norm is not None and not norm[0].dtype == norm[1].dtype == q.dtype)):
            if qk_norm is not None:
                q, k = qk_norm(q, k)
            q, k = rotary(positions, q, k)
            return self.forward_decode(q, k, v, layer, batch)
        cos, sin = rotary.cos_sin_tables(positions)
        pdl = decode_pdl(q)  # the split kernel right after the store kernel: it may start while that one runs
        q_rot = rotary_and_store(q, k, v, positions, cos, sin, rotary.rotary_dim, k_buf, v_buf, batch.out_cache_loc,
                                 qk_norm=norm, trigger=pdl, pdl=rotary_store_pdl(q))
        return self._decode_from_pool(q_rot.view(-1, layer.num_heads, layer.head_dim), layer, batch, pdl=pdl)

    def _decode_from_pool(self, q3: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch,
                          pdl: bool = False) -> torch.Tensor:
        meta: DecodeMetadata = batch.attn_metadata
        pool = batch.kv_pool
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        k_scale, v_scale = pool.kv_scales(layer.layer_id)
        out = torch.empty_like(q3)
        decode_attention(
            q3 if pool.is_fp8 else q3.to(k_buf.dtype),
            out,
            k_buf,
            v_buf,
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            meta.num_kv_splits,
            meta.mid_o,
            meta.mid_lse,
            layer.scaling,
            interpret=self.interpret,
            config=self.decode_config,
            sliding_window=getattr(layer, "sliding_window", None),
            logit_cap=getattr(layer, "logit_cap", None),
            k_scale=k_scale,
            v_scale=v_scale,
            pdl=pdl,
            merge_pdl=decode_merge_pdl(q3),
            work=meta.work,
        )
        return out.view(q3.shape[0], -1)

    @staticmethod
    def _split_heads(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # reshape (not view): q/k/v may be strided slices of a fused qkv projection
        d = layer.head_dim
        return (
            q.reshape(-1, layer.num_heads, d),
            k.reshape(-1, layer.num_kv_heads, d),
            v.reshape(-1, layer.num_kv_heads, d),
        )

    # ---- CUDA graphs (decode) -----------------------------------------------------------------
    def supports_cuda_graph(self) -> bool:
        return True

    def init_graph_state(self, max_bs: int) -> None:
        self._graph = DecodeMetadata.allocate(max_bs, self.num_heads, self.max_kv_splits, self.head_dim, self.device,
                                              zeroed=True)
        if self.decode_work_list:
            items = work_items_bound(max_bs, self.num_kv_heads, self.programs_per_sm * self.sm_count)
            self._graph_work = DecodeWork.allocate(max_bs, items, self.device)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        if self._graph is None:
            raise RuntimeError("init_graph_state(max_bs) must run before capturing a CUDA graph")
        batch.attn_metadata = self._decode_metadata(batch, self._graph.graph_slice(batch, "triton"), self._graph_work)

    def init_forward_metadata_replay(self, batch: ForwardBatch, real_bs: int) -> None:
        # The padded batch has the captured size; its seq_lens are refreshed in place by the runner,
        # so recomputing the split counts into the same static slice is all a replay needs.
        self.init_forward_metadata_capture(batch)

    # ---- CUDA graphs (extend) -----------------------------------------------------------------
    def supports_extend_cuda_graph(self) -> bool:
        return True

    def init_extend_graph_state(self, max_tokens: int, max_reqs: int) -> None:
        # a request adds at most one partial block to the full blocks of all the tokens
        block_m = self._extend_block_m()
        capacity = -(-max_tokens // block_m) + max_reqs
        self._extend_graph = ExtendMetadata(
            extend_start=torch.zeros(max_reqs, dtype=torch.int64, device=self.device), max_extend_len=max_tokens,
            work=ExtendWork(torch.full((2, capacity), -1, dtype=torch.int32, device=self.device), block_m))

    def init_extend_metadata_capture(self, batch: ForwardBatch) -> None:
        static = self._extend_graph
        if static is None:
            raise RuntimeError("init_extend_graph_state(max_tokens, max_reqs) must run before capturing an extend graph")
        if batch.batch_size > static.extend_start.shape[0]:
            raise ValueError(f"an extend graph batch of {batch.batch_size} requests exceeds the static "
                             f"{static.extend_start.shape[0]}")
        # no fresh-prompt SDPA here: its per-request launches depend on host lengths a graph cannot replay
        batch.attn_metadata = ExtendMetadata(extend_start=static.extend_start[: batch.batch_size],
                                             max_extend_len=static.max_extend_len, work=static.work)
        self._write_extend_plan(batch)

    def init_extend_metadata_replay(self, batch: ForwardBatch, real_bs: int) -> None:
        self.init_extend_metadata_capture(batch)

    def _write_extend_plan(self, batch: ForwardBatch) -> None:
        meta: ExtendMetadata = batch.attn_metadata
        lens = list(batch.extend_lens_cpu)
        starts = list(itertools.accumulate(lens[:-1], initial=0))
        meta.extend_start.copy_(torch.tensor(starts, dtype=torch.int64), non_blocking=True)
        write_extend_plan(meta.work, list(batch.prefix_lens_cpu), lens)
