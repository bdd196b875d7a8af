"""Pure-torch stand-ins for the three FlashInfer wrappers the flashinfer attention plugin drives
(`BatchDecodeWithPagedKVCacheWrapper`, `BatchPrefillWithPagedKVCacheWrapper`,
`BatchPrefillWithRaggedKVCacheWrapper`), following FlashInfer's documented semantics: paged KV by
(indptr, indices, last_page_len) over an NHD cache `[pages, page_size, kv_heads, head_dim]`, causal
masks aligned to the end of each request's KV, the flattened per-request `[qo_len, kv_len]` custom
mask, and CUDA-graph mode reading the page tables from the caller's static buffers at run time.

They let the CPU tests exercise everything around the kernels (planning, page lists, masks, graph
buffers) through the attention conformance kit. Keyword arguments are checked against the names
the real 0.7 wrappers accept, so a misspelt option fails here rather than on the GPU.
"""

from __future__ import annotations

import torch
from radixserve_attention_flashinfer.kernels import FlashInferKernels

_COMMON_PLAN = {"pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type",
                "o_data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking", "fixed_split_size",
                "disable_split_kv"}
DECODE_PLAN_KW = _COMMON_PLAN | {"data_type", "block_tables", "seq_lens", "q_len_per_req", "is_causal",
                                 "window_right", "use_token_head_sf"}
PREFILL_PLAN_KW = _COMMON_PLAN | {"head_dim_vo", "custom_mask", "packed_custom_mask", "causal",
                                  "use_fp16_qk_reduction", "seq_lens", "seq_lens_q", "max_token_per_sequence",
                                  "max_sequence_kv", "uniform_q_len"}
DECODE_INIT_KW = {"use_cuda_graph", "use_tensor_cores", "paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                  "paged_kv_last_page_len_buffer", "backend", "jit_args", "jit_kwargs"}
PREFILL_INIT_KW = {"use_cuda_graph", "qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf",
                   "paged_kv_last_page_len_buf", "custom_mask_buf", "mask_indptr_buf", "backend", "jit_args",
                   "jit_kwargs"}


def _check_kw(kwargs: dict, allowed: set[str], what: str) -> None:
    unknown = set(kwargs) - allowed
    assert not unknown, f"{what} got options FlashInfer does not take: {sorted(unknown)}"


def _attend(q, k, v, mask, scale):
    """q [n, H, D], k/v [m, KVH, D], mask [n, m] bool -> [n, H, D] (float32 math, q's dtype out)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), kf) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnm,mhd->nhd", torch.softmax(scores, -1), vf).to(q.dtype)


def _pages_to_tokens(cache, indices, last_len):
    """Tokens of one request: its pages in order, the last one cut to `last_len` entries."""
    pages = cache[indices]  # [p, page_size, KVH, D]
    tokens = pages.reshape(-1, *cache.shape[2:])
    return tokens[: (len(indices) - 1) * cache.shape[1] + last_len]


class _Base:
    def __init__(self, workspace, kv_layout="NHD", **kwargs):
        assert kv_layout == "NHD"
        assert workspace.dtype == torch.uint8
        self.options = kwargs
        self.plans = 0

    def _scale(self, kw, head_dim):
        s = kw.get("sm_scale")
        return head_dim ** -0.5 if s is None else s


class ReferenceDecode(_Base):
    def __init__(self, workspace, kv_layout="NHD", **kwargs):
        _check_kw(kwargs, DECODE_INIT_KW, "BatchDecodeWithPagedKVCacheWrapper()")
        super().__init__(workspace, kv_layout, **kwargs)
        self.graph = kwargs.get("use_cuda_graph", False)
        if self.graph:
            self.indptr_buf = kwargs["paged_kv_indptr_buffer"]
            self.indices_buf = kwargs["paged_kv_indices_buffer"]
            self.last_buf = kwargs["paged_kv_last_page_len_buffer"]

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
        _check_kw(kw, DECODE_PLAN_KW, "decode plan()")
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert int(indptr[-1]) == indices.shape[0]
        if self.graph:  # as FlashInfer: the batch size is frozen, the tables live in the static buffers
            assert self.indptr_buf.shape[0] == indptr.shape[0], "a graph wrapper's batch size cannot change"
            self.indptr_buf.copy_(indptr)
            self.last_buf.copy_(last_page_len)
            self.indices_buf[: indices.shape[0]].copy_(indices)
        else:
            self.tables = (indptr.clone(), indices.clone(), last_page_len.clone())
        self.page_size, self.scale = page_size, self._scale(kw, head_dim)
        self.plans += 1

    def run(self, q, paged_kv_cache, **kw):
        k_cache, v_cache = paged_kv_cache
        indptr, indices, last = ((self.indptr_buf, self.indices_buf, self.last_buf) if self.graph else self.tables)
        indptr, last = indptr.tolist(), last.tolist()
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            pages = indices[indptr[i]: indptr[i + 1]].long()
            k = _pages_to_tokens(k_cache, pages, last[i])
            v = _pages_to_tokens(v_cache, pages, last[i])
            out[i: i + 1] = _attend(q[i: i + 1], k, v, torch.ones(1, k.shape[0], dtype=torch.bool), self.scale)
        return out


class _Prefill(_Base):
    def _masks(self, qo_lens, kv_lens):
        masks, offset = [], 0
        for n, m in zip(qo_lens, kv_lens):
            if self.custom_mask is not None:
                masks.append(self.custom_mask[offset: offset + n * m].view(n, m).cpu())
                offset += n * m
            elif self.causal:  # query a sees key j iff j <= a + (m - n): queries aligned to the KV's end
                masks.append(torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n))
            else:
                masks.append(torch.ones(n, m, dtype=torch.bool))
        return masks

    def _plan_common(self, kw, head_dim):
        _check_kw(kw, PREFILL_PLAN_KW, "prefill plan()")
        assert kw.get("packed_custom_mask") is None
        self.custom_mask = kw.get("custom_mask")
        assert self.custom_mask is None or self.options.get("backend") == "fa2", "custom masks need fa2"
        self.causal = kw.get("causal", False)
        self.scale = self._scale(kw, head_dim)
        self.plans += 1


class ReferencePagedPrefill(_Prefill):
    def __init__(self, workspace, kv_layout="NHD", **kwargs):
        _check_kw(kwargs, PREFILL_INIT_KW, "BatchPrefillWithPagedKVCacheWrapper()")
        super().__init__(workspace, kv_layout, **kwargs)
        self.graph = kwargs.get("use_cuda_graph", False)
        if self.graph:
            self.bufs = tuple(kwargs[k] for k in ("qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf",
                                                  "paged_kv_last_page_len_buf"))

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, **kw):
        assert qo_indptr.dtype == paged_kv_indptr.dtype == paged_kv_indices.dtype == torch.int32
        assert int(paged_kv_indptr[-1]) == paged_kv_indices.shape[0]
        self._plan_common(kw, head_dim_qk)
        if self.graph:  # as FlashInfer: the batch size is frozen, the tables live in the static buffers
            qo_buf, kv_buf, indices_buf, last_buf = self.bufs
            assert qo_buf.shape[0] == qo_indptr.shape[0] == kv_buf.shape[0], "a graph wrapper's batch size cannot change"
            assert paged_kv_indices.shape[0] <= indices_buf.shape[0], "the page list exceeds the indices buffer"
            qo_buf.copy_(qo_indptr)
            kv_buf.copy_(paged_kv_indptr)
            last_buf.copy_(paged_kv_last_page_len)
            indices_buf[: paged_kv_indices.shape[0]].copy_(paged_kv_indices)
        else:
            self.tables = (qo_indptr.tolist(), paged_kv_indptr.tolist(), paged_kv_indices.clone(),
                           paged_kv_last_page_len.tolist())
        self.page_size = page_size

    def run(self, q, paged_kv_cache, **kw):
        k_cache, v_cache = paged_kv_cache
        if self.graph:  # read at run time from the static buffers, as a replayed graph does
            qo_buf, kv_buf, indices_buf, last_buf = self.bufs
            self.tables = (qo_buf.tolist(), kv_buf.tolist(), indices_buf, last_buf.tolist())
        qo, kv, indices, last = self.tables
        ks, vs = [], []
        for i in range(len(qo) - 1):
            pages = indices[kv[i]: kv[i + 1]].long()
            ks.append(_pages_to_tokens(k_cache, pages, last[i]))
            vs.append(_pages_to_tokens(v_cache, pages, last[i]))
        masks = self._masks([qo[i + 1] - qo[i] for i in range(len(qo) - 1)], [k.shape[0] for k in ks])
        out = torch.empty_like(q)
        for i, (k, v, mask) in enumerate(zip(ks, vs, masks)):
            out[qo[i]: qo[i + 1]] = _attend(q[qo[i]: qo[i + 1]], k, v, mask, self.scale)
        return out


class ReferenceRaggedPrefill(_Prefill):
    def __init__(self, workspace, kv_layout="NHD", **kwargs):
        _check_kw(kwargs, PREFILL_INIT_KW - {"paged_kv_indptr_buf", "paged_kv_indices_buf",
                                             "paged_kv_last_page_len_buf"} | {"kv_indptr_buf"}, "ragged()")
        super().__init__(workspace, kv_layout, **kwargs)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, **kw):
        assert qo_indptr.dtype == kv_indptr.dtype == torch.int32
        self._plan_common(kw, head_dim_qk)
        self.tables = (qo_indptr.tolist(), kv_indptr.tolist())

    def run(self, q, k, v, **kw):
        qo, kv = self.tables
        n = len(qo) - 1
        masks = self._masks([qo[i + 1] - qo[i] for i in range(n)], [kv[i + 1] - kv[i] for i in range(n)])
        out = torch.empty_like(q)
        for i, mask in enumerate(masks):
            out[qo[i]: qo[i + 1]] = _attend(q[qo[i]: qo[i + 1]], k[kv[i]: kv[i + 1]], v[kv[i]: kv[i + 1]], mask,
                                            self.scale)
        return out


REFERENCE_KERNELS = FlashInferKernels(ReferenceDecode, ReferencePagedPrefill, ReferenceRaggedPrefill)
