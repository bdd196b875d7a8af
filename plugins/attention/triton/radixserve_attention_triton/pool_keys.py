"""The KV-pool pass shared by the triton backend's kernels: a request's keys and values read through its
`req_to_token` row (page size 1) and folded into an online softmax, BLOCK_N slots at a time."""

from __future__ import annotations

import triton
import triton.language as tl
from radixserve.layers.triton_softmax import dot_qk, online_softmax_step, scores_log2


@triton.jit
def attend_pool_keys(q, q_rel, m_i, l_i, acc, r2t_row, K_buf, V_buf, kvh, prefix_lo, prefix_len, sm_scale, logit_cap,
                   window, stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_n, offs_d, mask_d,
                   BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, KV_FP8: tl.constexpr,
                   IEEE: tl.constexpr):
    """Fold a request's pooled keys [prefix_lo, prefix_len), gathered slot by slot through its
    req_to_token row, into the running softmax of the query tile `q` (rows at positions
    prefix_len + q_rel: a window hides keys at or before position - window; without HAS_WINDOW
    q_rel is not read; IEEE: exact fp32 products, as dot_qk). The extend kernel's prefix pass and the decode
    kernel's split both run it."""
    for start in range(prefix_lo, prefix_len, BLOCK_N):
        n = start + offs_n
        mask_n = n < prefix_len
        slot = tl.load(r2t_row + n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_buf + slot[:, None] * stride_kbs + kvh * stride_kbh + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)  # exact; the k scale is in sm_scale
        qk = scores_log2(dot_qk(q, k, IEEE), sm_scale, logit_cap, HAS_CAP)
        seen = mask_n[None, :]
        if HAS_WINDOW:
            seen = seen & (n[None, :] > prefix_len + q_rel[:, None] - window)
        qk = tl.where(seen, qk, float("-inf"))
        v = tl.load(V_buf + slot[:, None] * stride_vbs + kvh * stride_vbh + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, IEEE)
    return m_i, l_i, acc


@triton.jit
def prefetch_rows_l2(rows, ROW_BYTES: tl.constexpr):
    """Ask L2 for every 128-byte line of the pool rows starting at the pointers `rows` (one
    `prefetch.global.L2` each, no registers filled, nothing waited for). CUDA only: the interpreter
    has no inline assembly, and its callers run it only behind their PDL switch, off there."""
    step: tl.constexpr = 128 * 8 // rows.dtype.element_ty.primitive_bitwidth  # elements per line
    for line in tl.static_range(0, (ROW_BYTES + 127) // 128):
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [rows + line * step],
                                  dtype=tl.int32, is_pure=False, pack=1)
