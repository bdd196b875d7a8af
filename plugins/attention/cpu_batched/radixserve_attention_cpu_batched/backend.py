"""cpu_batched: attention for the whole batch in one call per layer.

Why: the reference backend loops over requests in Python and repeats K/V for every query head
(GQA); at batch 64 on a 2-core CPU that is a third of a decode step. For fp32 models a native
kernel (csrc/attention.cpp, compiled on first use by `radixserve.native`) stores the new tokens'
K/V and reads each request's keys and values in place through its slot row, serving every query
head of a KV group (and, in extend, a block of up to 16 of the request's new tokens) from one read
of each row. The pool may be fp32 or bf16 (`runtime.kv_cache_dtype: bfloat16`, half the bytes a
step streams: a decode step's attention is bound by them once the KV is out of cache). On AVX-512
CPUs the scores are taken 16 keys at a time and the value sums kept in registers. Under
`runtime.cpu_matmul_precision: medium` (`AttentionRunnerInfo.matmul_precision`, plugin API 1.9) a
bf16 pool's products run on AVX-512 BF16 where the CPU has it: each query rounded to bf16 once, the
softmax weights rounded to bf16 for the value sums, fp32 sums (as the model's linears then do);
decode and extend still give a token the same bits (speculative decoding relies on it).

Extend batches go through the kernel when every request adds at most NATIVE_MAX_EXTEND tokens
(NATIVE_MAX_EXTEND_AVX512 in a build with AVX-512, whose per-row loop beats the reference path's
gather and SDPA up to ~2,000 new tokens: 1.2-3x at 300-1,024); longer ones take the reference path,
whose SDPA does the quadratic work faster than the kernel's per-row loop. With bf16
products every extend goes through the kernel: a request adding at least FLASH_MIN_EXTEND tokens
(a long prompt or chunk) runs its tiled flash path (csrc/flash_bf16.h), ~2x SDPA's rate on long
prompts; speculative verifies are shorter than that and keep the per-row path. Without a compiler (or for other
dtypes) decode gathers each request's KV into one padded [bs, kv_heads, max_len, head_dim] tensor
and runs a single scaled_dot_product_attention with the query heads of a KV group as its query
rows, and extend uses the reference path.

Speculative verify of draft trees (`supports_tree_mask`): the native kernel takes the batch's
tree mask and hides, for each new token, the draft tokens that are not its ancestors; without the
kernel a per-request SDPA with the same mask does it (`_masked_extend`).

Per-layer sliding windows and logit soft-capping (plugin API 1.3): the native kernel takes both
(for a tree it also takes each draft token's depth, which places it in the window); without the
kernel, windowed or capped layers run the torch_native reference path (decode included), which
implements both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from radixserve import native
from radixserve.interfaces.attention import AttentionLayerSpec
from radixserve.state import ForwardBatch, ForwardMode
from radixserve_attention_torch_native.backend import TorchNativeBackend

_SOURCE = Path(__file__).parent / "csrc" / "attention.cpp"
NATIVE_HEAD_DIMS = (64, 128, 256)  # the head sizes the kernel is compiled for
NATIVE_MAX_EXTEND = 256  # longest per-request extend the native kernel takes (see the docstring)
NATIVE_MAX_EXTEND_AVX512 = 2048  # the same for a build with AVX-512 (benchmarks/results/cpu-long-prompt.md)
# Shortest per-request extend that runs the flash path (bf16 products only). Above the longest
# speculative verify (speculative.num_draft_tokens <= 64, plus the verified token), whose rows must keep
# the per-row kernel's bits (equal to decode's); below it the per-row kernel is as fast.
FLASH_MIN_EXTEND = 96


def load_kernels():
    """The compiled attention module, or None (no compiler, or RADIXSERVE_NATIVE=0)."""
    return native.load_extension("radixserve_cpu_attention", _SOURCE)


_NO_MASK = torch.empty(0, dtype=torch.bool)
_NO_OFFSETS = torch.empty(0, dtype=torch.int64)


@dataclass
class _NativeExtendMeta:
    extend_lens: torch.Tensor  # [bs] int64 CPU: new tokens per request, packed in request order
    tree_mask: torch.Tensor = _NO_MASK  # flat bool CPU (a verify of draft trees), else empty
    mask_offsets: torch.Tensor = _NO_OFFSETS  # [bs] int64: where request i's [e, e] block starts
    depths: torch.Tensor = _NO_OFFSETS  # [num_tokens] int64: each draft token's depth (trees only)


@dataclass
class _MaskedExtendMeta:
    """Tree-masked extend without the native kernel: per request, its slots and full attention mask."""

    views: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (q_start, q_len, kv slots, [q_len, seq_len] bool)
    reference: list  # torch_native's per-request views of the same batch, for windowed or capped layers


@dataclass
class _PaddedDecodeMeta:
    slots: torch.Tensor  # [bs, max_len] int64 KV slots; padding points at slot 0 (reserved)
    mask: torch.Tensor  # [bs, 1, 1, max_len] bool, True where a key exists
    reference: list | None = None  # torch_native's views, built when a windowed or capped layer runs


class CPUBatchedBackend(TorchNativeBackend):
    supports_tensor_parallel = True  # reads per-rank head counts only
    name = "cpu_batched"
    supports_tree_mask = True
    supports_sliding_window = True  # native kernel, or the reference path (see the module docstring)
    supports_logit_cap = True
    supports_bf16_kv_cache = True  # the native kernel reads a bf16 pool; the torch paths widen (.to(q.dtype))

    def __init__(self, runner_info=None, use_native: bool = True) -> None:
        super().__init__(runner_info)
        self._kernels = None
        self._bf16_products = False  # the kernels' bf16 products (see the module docstring)
        self.max_native_extend = NATIVE_MAX_EXTEND  # longest per-request extend of the per-row path
        if use_native and self._native_applies(runner_info):
            self._kernels = load_kernels()
            self._bf16_products = (self._kernels is not None and runner_info.matmul_precision == "medium"
                                   and runner_info.kv_pool.dtype == torch.bfloat16
                                   and getattr(self._kernels, "bf16_products_available", False))
            if getattr(self._kernels, "avx512", False):
                self.max_native_extend = NATIVE_MAX_EXTEND_AVX512

    @classmethod
    def build_native_kernels(cls, device: str) -> None:
        if device == "cpu":
            load_kernels()

    @staticmethod
    def _native_applies(info) -> bool:
        return info is not None and (info.device.type == "cpu" and info.dtype == torch.float32 and info.head_dim in NATIVE_HEAD_DIMS
                and info.num_heads // info.num_kv_heads <= 64)

    @property
    def uses_native_kernel(self) -> bool:
        return self._kernels is not None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is not ForwardMode.DECODE:
            if self._kernels is not None and (self._bf16_products and batch.tree_mask is None
                                              or max(batch.extend_lens_cpu) <= self.max_native_extend):
                meta = _NativeExtendMeta(extend_lens=batch.extend_lens.to("cpu", torch.int64))
                if batch.tree_mask is not None:
                    meta.tree_mask = batch.tree_mask.to("cpu", torch.bool).contiguous()
                    sizes = [0] + [e * e for e in batch.extend_lens_cpu[:-1]]
                    meta.mask_offsets = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
                    # a draft token's depth: its ancestors in the tree, itself included, minus one
                    meta.depths = torch.tensor([sum(row) - 1 for block in batch.tree_mask_cpu for row in block],
                                               dtype=torch.int64)
                batch.attn_metadata = meta
            elif batch.tree_mask is not None:
                batch.attn_metadata = self._masked_extend_meta(batch)
            else:
                super().init_forward_metadata(batch)
            return
        if self._kernels is not None:
            batch.attn_metadata = None  # the kernel reads the slot table itself
            return
        table = batch.req_to_token_pool.req_to_token
        max_len = max(batch.seq_lens_cpu)
        slots = table[batch.req_pool_indices, :max_len]
        valid = torch.arange(max_len, device=table.device)[None, :] < batch.seq_lens[:, None].to(table.device)
        batch.attn_metadata = _PaddedDecodeMeta(slots=torch.where(valid, slots, 0), mask=valid[:, None, None, :])

    def forward_extend(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        meta = batch.attn_metadata
        if isinstance(meta, _MaskedExtendMeta):
            return self._masked_extend(q, k, v, layer, batch, meta)
        if not isinstance(meta, _NativeExtendMeta):
            return super().forward_extend(q, k, v, layer, batch)
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        # the kernel stores the new k, v at out_cache_loc itself (what KVPool.set_kv would do)
        return self._kernels.extend_attention(
            q, k, v, batch.out_cache_loc, k_buf, v_buf, batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices, batch.seq_lens, meta.extend_lens, meta.tree_mask, meta.mask_offsets, meta.depths,
            layer.scaling, *_native_options(layer), self._bf16_products,
            FLASH_MIN_EXTEND if self._bf16_products else 0,
        )

    @staticmethod
    def _masked_extend_meta(batch: ForwardBatch) -> _MaskedExtendMeta:
        table = batch.req_to_token_pool.req_to_token
        reference = TorchNativeBackend()
        reference.init_forward_metadata(batch)  # windowed layers use its per-request views
        views = []
        q_start = mask_start = 0
        for row, seq_len, ext in zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu, batch.extend_lens_cpu,
                                     strict=True):
            mask = torch.ones(ext, seq_len, dtype=torch.bool, device=table.device)  # the prefix: all visible
            block = batch.tree_mask[mask_start : mask_start + ext * ext].view(ext, ext)
            mask[:, seq_len - ext :] = block.to(table.device)
            views.append((q_start, ext, table[row, :seq_len], mask))
            q_start += ext
            mask_start += ext * ext
        return _MaskedExtendMeta(views, batch.attn_metadata)

    def _masked_extend(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch,
                       meta: _MaskedExtendMeta) -> torch.Tensor:
        if _has_options(layer):
            return self._reference(q, k, v, layer, batch, meta.reference)
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        out = torch.empty(q.shape[0], hq, d, dtype=q.dtype, device=q.device)
        for q_start, q_len, slots, mask in meta.views:
            queries = q[q_start : q_start + q_len].view(q_len, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [hkv, g, t, d]
            keys = k_buf.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(1)  # [hkv, 1, s, d]
            values = v_buf.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(1)
            o = F.scaled_dot_product_attention(queries, keys.expand(-1, hq // hkv, -1, -1),
                                               values.expand(-1, hq // hkv, -1, -1), attn_mask=mask, scale=layer.scaling)
            out[q_start : q_start + q_len] = o.permute(2, 0, 1, 3).reshape(q_len, hq, d)
        return out.reshape(q.shape[0], hq * d)

    def forward_decode(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        if self._kernels is not None:  # fp32 pool and activations (checked at construction)
            # the kernel stores the new k, v at out_cache_loc itself (what KVPool.set_kv would do)
            return self._kernels.decode_attention(
                q, k, v, batch.out_cache_loc, k_buf, v_buf, batch.req_to_token_pool.req_to_token,
                batch.req_pool_indices, batch.seq_lens, layer.scaling, *_native_options(layer), self._bf16_products,
            )
        if _has_options(layer):
            return self._reference(q, k, v, layer, batch, None)
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        return self._padded_sdpa(q, k_buf, v_buf, layer, batch.attn_metadata)

    def _reference(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch, views) -> torch.Tensor:
        """torch_native's path (it implements windows and capping) for this layer of the batch."""
        meta = batch.attn_metadata
        if views is None:  # decode: the reference views are built on first use, once per forward
            if getattr(meta, "reference", None) is None:
                TorchNativeBackend.init_forward_metadata(self, batch)
                meta.reference = batch.attn_metadata
                batch.attn_metadata = meta
            views = meta.reference
        batch.attn_metadata = views
        try:
            return self._attend(q, k, v, layer, batch)
        finally:
            batch.attn_metadata = meta

    def _padded_sdpa(self, q, k_buf, v_buf, layer: AttentionLayerSpec, meta: _PaddedDecodeMeta) -> torch.Tensor:
        bs, hq, hkv, d = q.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
        # index_select, not k_buf[slots]: advanced indexing is ~6x slower for this gather on CPU
        flat = meta.slots.view(-1)
        keys = k_buf.index_select(0, flat).view(bs, -1, hkv, d).to(q.dtype).transpose(1, 2)  # [bs, hkv, L, d]
        values = v_buf.index_select(0, flat).view(bs, -1, hkv, d).to(q.dtype).transpose(1, 2)
        queries = q.view(bs, hkv, hq // hkv, d)  # query heads of one KV group share its keys
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask, scale=layer.scaling)
        return out.reshape(bs, hq * d)


def _has_options(layer: AttentionLayerSpec) -> bool:
    return bool(getattr(layer, "sliding_window", None) or getattr(layer, "logit_cap", None))


def _native_options(layer: AttentionLayerSpec) -> tuple[int, float]:
    """(window, cap) as the native kernel takes them: 0 for none."""
    return int(getattr(layer, "sliding_window", None) or 0), float(getattr(layer, "logit_cap", None) or 0.0)
