"""MlaTritonBackend: latent attention (MLA, DeepSeek-V2/V3) with absorbed weights and Triton kernels.

Both paths work in latent space ("absorbed"): the query is moved into it with one batched matmul
per forward (`q_lat[h] = q_nope[h] @ W_UK[h]`, torch.bmm over heads), the Triton kernel attends
over the request's LatentKVPool rows `[c_kv, k_pe]` (scores `q_lat . c_kv + q_pe . k_pe`, output
accumulated over `c_kv`), and a second bmm moves the latent output out (`o[h] = o_lat[h] @ W_UV[h].T`).
No per-head key or value is ever materialised; every latent row is read once per block of heads.

- decode: split-KV (see decode_kernel.py); the split count per request is planned on the device
  from the batch's lengths (`radixserve.layers.kv_splits.compute_num_kv_splits`, shared with the triton plugin) in `init_forward_metadata`
  / `init_forward_metadata_replay`, outside any CUDA graph, into buffers sized for `max_kv_splits`.
- extend (prefill, chunked prefill, speculative verify, tree masks included): the absorbed extend
  kernel (extend_kernel.py) over prefix + new rows, causal or by `batch.tree_mask`.

New rows are stored into the pool (`LatentKVPool.set_latent`) before any kernel reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from radixserve.interfaces.attention import AttentionBackend
from radixserve.layers.extend_layout import extend_starts, tree_mask_starts
from radixserve.layers.kv_splits import SplitKVDecodeMetadata, compute_num_kv_splits, split_planning_defaults
from radixserve.layers.triton_interpreter import interpreter_enabled
from radixserve.state import ForwardMode

from radixserve_attention_mla_triton.decode_kernel import (
    LatentDecodeConfig,
    latent_decode_attention,
    latent_decode_config,
    num_head_blocks,
)
from radixserve_attention_mla_triton.extend_kernel import (
    LatentExtendConfig,
    latent_extend_attention,
    latent_extend_config,
)

if TYPE_CHECKING:
    from radixserve.interfaces.latent_attention import LatentAttentionLayerSpec
    from radixserve.state import ForwardBatch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LatentExtendMetadata:
    extend_start: torch.Tensor  # int64 [bs]: offset of request i's first new token in the packed tokens
    max_extend_len: int  # host int: sizes the grid's token-block axis
    tree_mask: torch.Tensor | None = None  # uint8 flat (speculative verify of draft trees)
    mask_start: torch.Tensor | None = None  # int64 [bs]: where request i's [e_i, e_i] block starts


LatentDecodeMetadata = SplitKVDecodeMetadata  # mid_o: float32 [bs, H, max_kv_splits, kv_lora_rank]


class MlaTritonBackend(AttentionBackend):
    """Latent-only attention backend (CUDA; Triton's CPU interpreter under TRITON_INTERPRET=1 in tests).

    `runner_info` is an `AttentionRunnerInfo` whose `latent` holds the model's LatentAttentionDims
    and whose `kv_pool` is a LatentKVPool. Keyword-only knobs: at most `max_kv_splits` decode
    splits per request (it sizes the split scratch: max_bs * heads * max_kv_splits * kv_lora_rank
    fp32 values), none shorter than `min_split_tokens`, about `sm_count * programs_per_sm` decode
    programs in flight; `decode_config` / `extend_config` override the kernels' tiles.

    Added in plugin API 1.4.
    """

    name = "mla_triton"
    supports_tensor_parallel = True  # reads per-rank head counts only
    supports_latent_attention = True
    supports_standard_attention = False
    supports_tree_mask = True  # the extend kernel takes ForwardBatch.tree_mask
    # forward_latent_decode stores every row before the kernel reads the pool and each row reads
    # its own seq_len: rows may be consecutive tokens of one request (chain verify in decode graphs)
    decode_rows_share_requests = True

    def __init__(
        self,
        runner_info: Any,
        *,
        max_kv_splits: int = 16,
        min_split_tokens: int | None = None,
        sm_count: int | None = None,
        programs_per_sm: int = 4,
        decode_config: LatentDecodeConfig | None = None,
        extend_config: LatentExtendConfig | None = None,
    ) -> None:
        dims = getattr(runner_info, "latent", None)
        if dims is None:
            raise ValueError("the mla_triton attention backend runs latent attention (MLA) only, but the runner "
                             "gave no LatentAttentionDims (AttentionRunnerInfo.latent is None: a standard-attention "
                             "model); pick another attention backend, e.g. triton")
        if max_kv_splits < 1:
            raise ValueError(f"max_kv_splits must be >= 1, got {max_kv_splits}")
        self.dims = dims
        self.device = torch.device(runner_info.device)
        dtype = runner_info.dtype
        self.dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.num_heads = int(dims.num_heads)
        self.kv_lora_rank = int(dims.kv_lora_rank)
        self.max_bs = int(getattr(runner_info, "max_bs", 0) or 1)
        self.interpret = interpreter_enabled()
        self.max_kv_splits = max_kv_splits
        self.min_split_tokens, self.sm_count = split_planning_defaults(self.device, min_split_tokens, sm_count,
                                                                       self.interpret)
        self.programs_per_sm = programs_per_sm
        self.decode_config = decode_config or latent_decode_config(self.num_heads, self.kv_lora_rank, self.interpret)
        self.extend_config = extend_config or latent_extend_config(self.num_heads, self.kv_lora_rank, self.interpret)
        self._graph: LatentDecodeMetadata | None = None

    @classmethod
    def supports(cls, device: str, dtype: str, head_dim: int) -> bool:
        # head_dim is the latent row width here (kv_lora_rank + rope): any width the kernels tile
        on_device = device.split(":")[0] == "cuda" or interpreter_enabled()
        return on_device and dtype in _DTYPES

    # ---- metadata -----------------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            batch.attn_metadata = self._plan_decode(batch, LatentDecodeMetadata.allocate(
                batch.batch_size, self.num_heads, self.max_kv_splits, self.kv_lora_rank, self.device))
            return
        if batch.mode is ForwardMode.IDLE:
            batch.attn_metadata = None
            return
        extend_start, lens = extend_starts(batch)
        meta = LatentExtendMetadata(extend_start=extend_start, max_extend_len=max(lens, default=0))
        if batch.tree_mask is not None:
            meta.tree_mask, meta.mask_start = tree_mask_starts(batch, self.device)
        batch.attn_metadata = meta

    def _plan_decode(self, batch: ForwardBatch, meta: LatentDecodeMetadata) -> LatentDecodeMetadata:
        # every (request, head block, split) is one program: spread the batch's rows over ~target programs
        compute_num_kv_splits(
            batch.seq_lens,
            meta.num_kv_splits,
            num_head_blocks(self.num_heads, self.decode_config),
            self.max_kv_splits,
            self.min_split_tokens,
            target_programs=self.programs_per_sm * self.sm_count,
        )
        return meta

    # ---- forward ------------------------------------------------------------------------------
    def forward_latent_extend(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
        layer: LatentAttentionLayerSpec, batch: ForwardBatch,
    ) -> torch.Tensor:
        meta: LatentExtendMetadata = batch.attn_metadata
        return self._run_absorbed(
            latent_extend_attention, q_nope, q_pe, c_kv, k_pe, layer, batch,
            batch.prefix_lens, batch.extend_lens, meta.extend_start, meta.max_extend_len, layer.scaling,
            self.extend_config, tree_mask=meta.tree_mask, mask_start=meta.mask_start,
        )

    def forward_latent_decode(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
        layer: LatentAttentionLayerSpec, batch: ForwardBatch,
    ) -> torch.Tensor:
        meta: LatentDecodeMetadata = batch.attn_metadata
        return self._run_absorbed(
            latent_decode_attention, q_nope, q_pe, c_kv, k_pe, layer, batch,
            batch.seq_lens, meta.num_kv_splits, meta.mid_o, meta.mid_lse, layer.scaling, self.decode_config,
        )

    def _run_absorbed(self, kernel, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                      k_pe: torch.Tensor, layer: LatentAttentionLayerSpec, batch: ForwardBatch,
                      *args, **kwargs) -> torch.Tensor:
        """Store the new rows, move q_nope into latent space, run `kernel(q_lat, q_pe, o_lat, latent,
        kv_lora_rank, req_to_token, req_pool_indices, *args, **kwargs)` and expand its output."""
        latent = self._store(c_kv, k_pe, layer, batch)
        q_lat = self._absorb(q_nope, layer, latent.dtype)
        o_lat = torch.empty_like(q_lat)
        kernel(
            q_lat.transpose(0, 1),
            self._rope_query(q_pe, layer, latent.dtype),
            o_lat.transpose(0, 1),
            latent,
            layer.kv_lora_rank,
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            *args,
            **kwargs,
        )
        return self._expand(o_lat, layer, q_nope.dtype)

    @staticmethod
    def _store(c_kv: torch.Tensor, k_pe: torch.Tensor, layer: LatentAttentionLayerSpec,
               batch: ForwardBatch) -> torch.Tensor:
        """Write the new tokens' rows into the pool (before any read) and return the layer's buffer."""
        batch.kv_pool.set_latent(layer.layer_id, batch.out_cache_loc, c_kv, k_pe)
        return batch.kv_pool.get_latent(layer.layer_id)

    @staticmethod
    def _rope_query(q_pe: torch.Tensor, layer: LatentAttentionLayerSpec, dtype: torch.dtype) -> torch.Tensor:
        """`[T, H, rope]` in the pool dtype with a contiguous last dim (the kernels' only stride rule)."""
        q = q_pe.reshape(-1, layer.num_heads, layer.qk_rope_head_dim).to(dtype)
        return q if q.stride(-1) == 1 else q.contiguous()

    @staticmethod
    def _absorb(q_nope: torch.Tensor, layer: LatentAttentionLayerSpec, dtype: torch.dtype) -> torch.Tensor:
        """`[H, T, kv_lora_rank]`: q_nope moved into latent space head by head (one bmm)."""
        w_uk = layer.w_uk  # [H, nope, L]
        q = q_nope.reshape(-1, layer.num_heads, layer.qk_nope_head_dim).transpose(0, 1)  # [H, T, nope]
        return torch.bmm(q.to(w_uk.dtype), w_uk).to(dtype)

    @staticmethod
    def _expand(o_lat: torch.Tensor, layer: LatentAttentionLayerSpec, dtype: torch.dtype) -> torch.Tensor:
        """`[T, H * v_head_dim]` from the latent outputs `[H, T, kv_lora_rank]` (one bmm with W_UV.T)."""
        w_uv = layer.w_uv  # [H, v, L]
        out = torch.bmm(o_lat.to(w_uv.dtype), w_uv.transpose(1, 2))  # [H, T, v]
        return out.transpose(0, 1).reshape(o_lat.shape[1], -1).to(dtype)

    # ---- CUDA graphs (decode) -----------------------------------------------------------------
    def supports_cuda_graph(self) -> bool:
        return True

    def init_graph_state(self, max_bs: int) -> None:
        self._graph = LatentDecodeMetadata.allocate(max_bs, self.num_heads, self.max_kv_splits, self.kv_lora_rank,
                                                    self.device, zeroed=True)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        if self._graph is None:
            raise RuntimeError("init_graph_state(max_bs) must run before capturing a CUDA graph")
        batch.attn_metadata = self._plan_decode(batch, self._graph.graph_slice(batch, "mla_triton"))

    def init_forward_metadata_replay(self, batch: ForwardBatch, real_bs: int) -> None:
        # the runner refreshes the padded batch's seq_lens in place; re-planning the splits into the
        # same static slices (outside the graph) is all a replay needs
        self.init_forward_metadata_capture(batch)
