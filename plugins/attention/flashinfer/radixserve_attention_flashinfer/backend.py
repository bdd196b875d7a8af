"""FlashInferAttentionBackend: FlashInfer's batch prefill and decode over the token-slot KV pool.

Each layer's pool buffers `[num_slots + 1, kv_heads, head_dim]` are viewed as FlashInfer's NHD
paged cache with page size 1 (`[num_slots + 1, 1, kv_heads, head_dim]`), so a request's page list
is its `req_to_token` row (see planning.py). Per forward, `init_forward_metadata` plans one wrapper
(outside any CUDA graph); every layer then only runs it:

- DECODE: the paged decode wrapper (tensor-core variant for GQA groups of 4 and more).
- EXTEND where every request starts from an empty prefix (fresh prompts): the ragged prefill
  wrapper over the new tokens' own k, v (causal), no page-list gather.
- any other EXTEND (cached prefixes, chunked prefill, mixed): the paged prefill wrapper over the
  whole sequence, the new tokens' KV stored into the pool first (causal: FlashInfer aligns each
  request's queries to the end of its KV, which is our prefix + new-token layout); a speculative
  verify of draft trees passes the tree as FlashInfer's custom mask instead.

CUDA graphs: one decode wrapper per captured batch size, built with FlashInfer's CUDA-graph mode
over shared static buffers (`planning.DecodeGraphBuffers`); capture and replay both re-plan it
outside the graph, from the host lengths.

FlashInfer is imported when the backend is constructed (`kernels.load_kernels`), never by the
plugin's entry point: the registry can list and resolve the backend without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from radixserve.interfaces.attention import AttentionBackend
from radixserve.state import ForwardMode

from radixserve_attention_flashinfer.kernels import FlashInferKernels, load_kernels
from radixserve_attention_flashinfer.planning import (
    DecodeGraphBuffers,
    ExtendGraphBuffers,
    gather_token_slots,
    indptr_from_lens,
    last_page_lens,
    tree_custom_mask,
)

if TYPE_CHECKING:
    from radixserve.interfaces.attention import AttentionLayerSpec
    from radixserve.state import ForwardBatch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
HEAD_DIMS = (64, 128, 256)  # the head sizes FlashInfer's prefill and decode kernels are instantiated for
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-KV partials)
# the stack has no per-backend options: this variable picks the prefill kernels for A/B runs
PREFILL_BACKEND_ENV = "RADIXSERVE_FLASHINFER_PREFILL"


@dataclass
class FlashInferMetadata:
    """What `init_forward_metadata` planned for one forward: which path and the planned wrapper."""

    path: str  # "decode", "ragged" (fresh prompts) or "paged" (prefixes, trees)
    wrapper: Any
    sm_scale: float  # the softmax scale the wrapper was planned with


class FlashInferAttentionBackend(AttentionBackend):
    """Attention with FlashInfer's batch prefill / decode kernels (CUDA; bfloat16 or float16; head_dim
    64, 128 or 256). Options (keyword-only): `kernels` (a `FlashInferKernels`; default: import
    FlashInfer), `workspace_bytes` (float workspace shared by the wrappers), `decode_tensor_cores`
    (None: on for GQA groups >= 4), `prefill_backend` ("auto", "fa2" or "fa3"; default: the
    RADIXSERVE_FLASHINFER_PREFILL variable, else "auto"; tree masks always use "fa2", the one with
    custom masks), `max_graph_kv_slots` (page-list capacity of the CUDA-graph
    decode buffers; default `graph_kv_capacity`).

    Not supported: sliding windows and logit soft-capping (the runner refuses such models, naming
    this backend), latent attention (MLA).
    """

    name = "flashinfer"
    supports_tensor_parallel = True  # plans with this rank's head counts only
    supports_tree_mask = True  # tree verify through the paged prefill's custom mask
    # forward_decode stores every row's k, v before the kernel reads the pool, and each row's page
    # list is its own seq_len: consecutive tokens of one request may share a decode batch
    decode_rows_share_requests = True

    def __init__(
        self,
        runner_info: Any,
        *,
        kernels: FlashInferKernels | None = None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        decode_tensor_cores: bool | None = None,
        prefill_backend: str | None = None,
        max_graph_kv_slots: int | None = None,
    ) -> None:
        self.device = torch.device(runner_info.device)
        self.kernels = kernels if kernels is not None else load_kernels(self.device.type)
        dtype = runner_info.dtype
        self.dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.num_heads = int(runner_info.num_heads)
        self.num_kv_heads = int(runner_info.num_kv_heads)
        self.head_dim = int(runner_info.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if prefill_backend is None:
            prefill_backend = os.environ.get(PREFILL_BACKEND_ENV, "auto")
        if prefill_backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"prefill_backend (or ${PREFILL_BACKEND_ENV}) must be 'auto', 'fa2' or 'fa3', "
                             f"got {prefill_backend!r}")
        self.kv_pool = runner_info.kv_pool
        self.kv_dtype = getattr(self.kv_pool, "dtype", self.dtype)
        self.req_to_token_pool = runner_info.req_to_token_pool
        self.max_bs = int(getattr(runner_info, "max_bs", 0) or 1)
        self.context_len = int(getattr(runner_info, "context_len", 0) or 1)
        self.default_scale = self.head_dim ** -0.5
        self.use_tensor_cores = (self.num_heads // self.num_kv_heads >= 4 if decode_tensor_cores is None
                                 else decode_tensor_cores)
        self.max_graph_kv_slots = max_graph_kv_slots
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        k = self.kernels
        self.decode_wrapper = k.decode(self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
        self.ragged_wrapper = k.ragged_prefill(self.workspace, "NHD", backend=prefill_backend)
        self.paged_wrapper = k.paged_prefill(self.workspace, "NHD", backend=prefill_backend)
        # draft-tree verify needs FlashInfer's custom mask, which only its fa2 kernels take
        self.tree_wrapper = (self.paged_wrapper if prefill_backend == "fa2"
                             else k.paged_prefill(self.workspace, "NHD", backend="fa2"))
        self.graph_buffers: DecodeGraphBuffers | None = None
        self.graph_wrappers: dict[int, Any] = {}
        self.prefill_backend = prefill_backend
        self.extend_graph_buffers: ExtendGraphBuffers | None = None  # init_extend_graph_state (plugin API 1.10)
        self.extend_graph_wrappers: dict[int, Any] = {}  # by captured token count

    @classmethod
    def supports(cls, device: str, dtype: str, head_dim: int) -> bool:
        return device.split(":")[0] == "cuda" and dtype in _DTYPES and head_dim in HEAD_DIMS

    # ---- planning (once per forward, never inside a graph) -------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.IDLE:
            batch.attn_metadata = None
        elif batch.mode is ForwardMode.DECODE:
            batch.attn_metadata = self._plan_decode(self.decode_wrapper, batch)
        elif batch.tree_mask is None and batch.prefix_lens_cpu and not any(batch.prefix_lens_cpu):
            batch.attn_metadata = self._plan_ragged(batch)
        else:
            batch.attn_metadata = self._plan_paged(batch)

    def _host_lens(self, batch: ForwardBatch) -> tuple[list[int], list[int], list[int]]:
        seq = batch.seq_lens_cpu or batch.seq_lens.tolist()
        prefix = batch.prefix_lens_cpu or batch.prefix_lens.tolist()
        extend = batch.extend_lens_cpu or batch.extend_lens.tolist()
        return list(seq), list(prefix), list(extend)

    def _page_lists(self, batch: ForwardBatch, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        total = sum(seq_lens)
        indices = gather_token_slots(batch.req_to_token_pool.req_to_token, batch.req_pool_indices,
                                     batch.seq_lens, total)
        return indptr_from_lens(seq_lens), indices

    def _plan_decode(self, wrapper: Any, batch: ForwardBatch) -> FlashInferMetadata:
        seq_lens, _, _ = self._host_lens(batch)
        if self.graph_buffers is not None and wrapper is not self.decode_wrapper:
            self.graph_buffers.check_fits(sum(seq_lens))
        kv_indptr, indices = self._page_lists(batch, seq_lens)
        wrapper.plan(kv_indptr, indices, last_page_lens(len(seq_lens)), self.num_heads, self.num_kv_heads,
                     self.head_dim, 1, q_data_type=self.dtype, kv_data_type=self.kv_dtype,
                     sm_scale=self.default_scale)
        return FlashInferMetadata("decode", wrapper, self.default_scale)

    def _plan_ragged(self, batch: ForwardBatch) -> FlashInferMetadata:
        _, _, extend = self._host_lens(batch)
        qo_indptr = indptr_from_lens(extend)
        self.ragged_wrapper.plan(qo_indptr, qo_indptr, self.num_heads, self.num_kv_heads, self.head_dim,
                                 causal=True, sm_scale=self.default_scale, q_data_type=self.dtype,
                                 kv_data_type=self.kv_dtype)
        return FlashInferMetadata("ragged", self.ragged_wrapper, self.default_scale)

    def _plan_paged(self, batch: ForwardBatch, wrapper: Any = None) -> FlashInferMetadata:
        seq_lens, prefix, extend = self._host_lens(batch)
        if wrapper is not None:  # a CUDA-graph wrapper: its page list must fit the static buffer
            self.extend_graph_buffers.kv.check_fits(sum(seq_lens))
        kv_indptr, indices = self._page_lists(batch, seq_lens)
        mask = None
        wrapper = wrapper if wrapper is not None else self.paged_wrapper
        if batch.tree_mask is not None:
            mask = tree_custom_mask(batch.tree_mask.to(self.device), prefix, extend)
            wrapper = self.tree_wrapper
        wrapper.plan(indptr_from_lens(extend), kv_indptr, indices, last_page_lens(len(seq_lens)),
                     self.num_heads, self.num_kv_heads, self.head_dim, 1, custom_mask=mask, causal=mask is None,
                     sm_scale=self.default_scale, q_data_type=self.dtype, kv_data_type=self.kv_dtype)
        return FlashInferMetadata("paged", wrapper, self.default_scale)

    # ---- forward ------------------------------------------------------------------------------
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: FlashInferMetadata = batch.attn_metadata
        q3, k3, v3 = self._split_heads(q, k, v, layer)
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k3, v3)
        q3 = self._scaled(q3, layer, meta)
        if meta.path == "ragged":  # keys are exactly the new tokens: read them directly
            out = meta.wrapper.run(q3, k3.to(self.kv_dtype), v3.to(self.kv_dtype))
        else:
            out = meta.wrapper.run(q3, self._paged_cache(batch, layer))
        return out.reshape(q.shape[0], -1)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: FlashInferMetadata = batch.attn_metadata
        q3, k3, v3 = self._split_heads(q, k, v, layer)
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k3, v3)
        out = meta.wrapper.run(self._scaled(q3, layer, meta), self._paged_cache(batch, layer))
        return out.reshape(q.shape[0], -1)

    def _paged_cache(self, batch: ForwardBatch, layer: AttentionLayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
        # the pool's [slots, kv_heads, head_dim] as NHD pages of one token: a view, no copy
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        return k_buf.unsqueeze(1), v_buf.unsqueeze(1)

    def _scaled(self, q3: torch.Tensor, layer: AttentionLayerSpec, meta: FlashInferMetadata) -> torch.Tensor:
        """q in the wrapper's dtype, pre-multiplied when the layer's softmax scale differs from the
        planned one (scores are linear in q, so this is the layer's scale exactly)."""
        q3 = q3.to(self.dtype)
        if abs(layer.scaling - meta.sm_scale) > 1e-12 * meta.sm_scale:
            q3 = q3 * (layer.scaling / meta.sm_scale)
        return q3

    @staticmethod
    def _split_heads(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # reshape (not view): q/k/v may be strided slices of a fused qkv projection
        d = layer.head_dim
        return (q.reshape(-1, layer.num_heads, d), k.reshape(-1, layer.num_kv_heads, d),
                v.reshape(-1, layer.num_kv_heads, d))

    # ---- CUDA graphs (decode) -----------------------------------------------------------------
    def supports_cuda_graph(self) -> bool:
        return True

    def graph_kv_capacity(self, max_bs: int) -> int:
        """Page-list slots of the graph buffers: what one decode batch may read in total. Default:
        `max_bs * context_len`, capped at four times the pool's slots (a batch reads more slots than
        the pool holds only through shared prefixes) so long contexts do not cost hundreds of MB."""
        if self.max_graph_kv_slots:
            return max(int(self.max_graph_kv_slots), max_bs)
        bound = max_bs * self.context_len
        slots = getattr(self.kv_pool, "num_slots", None)
        if slots:
            bound = min(bound, 4 * int(slots) + max_bs)
        return max(bound, max_bs)

    def init_graph_state(self, max_bs: int) -> None:
        capacity = self.graph_kv_capacity(max_bs)
        self.graph_buffers = DecodeGraphBuffers.allocate(max_bs, capacity, self.device)
        self.graph_wrappers = {}

    def graph_wrapper(self, bs: int) -> Any:
        """The CUDA-graph decode wrapper for batch size `bs` (built on first use, then reused)."""
        if self.graph_buffers is None:
            raise RuntimeError("init_graph_state(max_bs) must run before capturing a CUDA graph")
        if bs not in self.graph_wrappers:
            indptr, indices, last_page_len = self.graph_buffers.for_batch(bs)
            self.graph_wrappers[bs] = self.kernels.decode(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len,
            )
        return self.graph_wrappers[bs]

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        if batch.mode is not ForwardMode.DECODE:
            raise ValueError(f"the flashinfer backend captures decode batches only, got {batch.mode}")
        batch.attn_metadata = self._plan_decode(self.graph_wrapper(batch.batch_size), batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch, real_bs: int) -> None:
        # the padded batch keeps its captured size; padding rows read slot 0 with seq_len 1
        self.init_forward_metadata_capture(batch)

    # ---- CUDA graphs (extend, plugin API 1.10) -------------------------------------------------
    def supports_extend_cuda_graph(self) -> bool:
        return True

    def init_extend_graph_state(self, max_tokens: int, max_reqs: int) -> None:
        self.extend_graph_buffers = ExtendGraphBuffers.allocate(max_reqs, self.graph_kv_capacity(max_reqs), self.device)
        self.extend_graph_wrappers = {}

    def extend_graph_wrapper(self, tokens: int) -> Any:
        """The CUDA-graph paged-prefill wrapper for EXTEND batches of `tokens` new tokens (built on
        first use, then reused; all plan into `extend_graph_buffers`)."""
        bufs = self.extend_graph_buffers
        if bufs is None:
            raise RuntimeError("init_extend_graph_state(max_tokens, max_reqs) must run before capturing an extend graph")
        if tokens not in self.extend_graph_wrappers:
            kv_indptr, indices, last_page_len = bufs.kv.for_batch(bufs.max_reqs)
            self.extend_graph_wrappers[tokens] = self.kernels.paged_prefill(
                self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=bufs.qo_indptr,
                paged_kv_indptr_buf=kv_indptr, paged_kv_indices_buf=indices,
                paged_kv_last_page_len_buf=last_page_len, backend=self.prefill_backend,
            )
        return self.extend_graph_wrappers[tokens]

    def init_extend_metadata_capture(self, batch: ForwardBatch) -> None:
        # always the paged path (stores the new KV, then reads everything through the page list): the
        # ragged path for fresh prompts is a host decision a graph cannot replay
        if batch.mode is not ForwardMode.EXTEND or batch.tree_mask is not None:
            raise ValueError(f"extend graphs take EXTEND batches without a tree mask, got {batch.mode}")
        wrapper = self.extend_graph_wrapper(batch.num_tokens)
        if batch.batch_size != self.extend_graph_buffers.max_reqs:
            raise ValueError(f"an extend graph batch has {self.extend_graph_buffers.max_reqs} request slots "
                             f"(padded), got {batch.batch_size}")
        batch.attn_metadata = self._plan_paged(batch, wrapper)

    def init_extend_metadata_replay(self, batch: ForwardBatch, real_bs: int) -> None:
        # the padded batch keeps its captured token count and request slots; plan() rewrites the buffers
        self.init_extend_metadata_capture(batch)
