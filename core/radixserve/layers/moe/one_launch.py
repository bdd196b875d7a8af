"""The small-batch routed experts in ONE kernel launch: gate_up tiles, then down tiles, ordered by tickets.

`small_m` runs the experts as two launches (gate_up, then down with the per-token sum in its last
programs). At one token of Qwen3-30B-A3B each launch is a short kernel (~17 us and ~9 us on the
H200) whose ramp-up and tail are a sizeable part of it, plus the gap between the two launches.
Here both phases share one grid:

- each program takes a ticket (an atomic counter) and the ticket, not the program id, says which
  tile it computes: tickets [0, G) are the G gate_up tiles (pair, BLOCK_N columns of I), the rest
  are the down tiles (pair, BLOCK_N columns of H, split of I). Tickets are handed out in order, so
  a down tile is only ever taken after every gate_up tile has been taken by a running program;
- a gate_up tile writes silu(gate) * up for its columns (fp32), then bumps its pair's ready counter
  (release);
- a down tile loads its first weight tile (expert weights never depend on this launch), then waits
  until its pair's ready counter shows all of the pair's gate_up tiles, reads the activations past
  L1 and finishes as `small_m`'s down kernel does (the last of a token's rows sums them in a fixed
  order into the output).
So the down tiles' weight reads overlap the gate_up tail and there is one launch fewer per layer.
The waits cannot deadlock: a waiting program only waits on tiles whose tickets were taken by
programs already running, and those wait on nothing. The last program to exit zeroes the ticket and
the ready counters, so the counter buffer is all zero between launches (CUDA-graph safe, as is
every size: all are known from the tensors' shapes).

The sums have the order of the two-launch path (the same tiles, the same reductions), so the result
is bit-identical to it with the same blocks, and deterministic.

`small_m_fused_experts` takes it for at most `small_m.ONE_LAUNCH_MAX_TOKENS` tokens (or as
`SmallMBlocks.one_launch` says). On the H200 (Qwen3-30B-A3B experts, CUDA-graph replay) it took 25.4
against 26.2 us at 1 token and 43.3 against 46.3 us at 2, but lost at 4 (0.98x) and 8 tokens (0.92x).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from radixserve.layers.moe import small_m
from radixserve.layers.triton_support import interpreting as _interpreting
from radixserve.layers.triton_support import pdl_launch, trigger_dependents

triton = tl = None  # imported by `_kernels` on first use (CPU machines may lack Triton)
sum_rows_if_last = None  # small_m_steps' @triton.jit steps, set by `_kernels` (kernels see module globals)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    del interpret  # cache key only: @triton.jit picks interpreter mode when it decorates
    global triton, tl, sum_rows_if_last
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401 - tl.extra.cuda.gdc_* (PDL)

    from radixserve.layers.moe.small_m_steps import sum_rows_if_last

    @triton.jit
    def experts_kernel(x_ptr, w13_ptr, w2_ptr, act_ptr, partial_ptr, final_ptr, weight_ptr, ids_ptr, sync_ptr,
                       INTER, H: tl.constexpr, k_per_split: tl.constexpr, top_k, stride_xm,
                       stride_13e, stride_13n, stride_2e, stride_2n, PAIRS, GU_BLOCKS, DN_BLOCKS, SPLITS,
                       ROWS: tl.constexpr, GU_N: tl.constexpr, GU_K: tl.constexpr, DN_N: tl.constexpr,
                       DN_K: tl.constexpr, EVEN_GU_K: tl.constexpr, EVEN_DN_K: tl.constexpr,
                       BLOCK_P: tl.constexpr, TRIGGER: tl.constexpr, GDC: tl.constexpr):
        """sync (int32, zero on entry and exit): [0] ticket, [1] exits, [2, 2 + PAIRS) gate_up tiles
        done per pair, then the per-(token, down column block) arrivals of the row sum."""
        if TRIGGER:
            # the next layer's PDL-launched qkv GEMV (runtime.batch1_gemv_pdl) may start once every
            # program here has started: its first weight tile loads under this launch's tail, and it
            # waits for this grid's completion before it reads the output. No deadlock with the waits
            # below: its programs launch only after all of these are resident or done.
            tl.extra.cuda.gdc_launch_dependents()
        if GDC:
            # PDL-launched (small_m.moe_experts_pdl): resident while the router still runs, then every memory
            # access after the wait, the ticket included (taken before it, a launch right after another of
            # this kernel took tickets the earlier one had not zeroed yet: session 22, an illegal address)
            tl.extra.cuda.gdc_wait()
        tile = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        gu_tiles = PAIRS * GU_BLOCKS
        ready_ptr = sync_ptr + 2
        if tile < gu_tiles:
            # act[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, INTER + n])
            g_pair = tile // GU_BLOCKS
            g_offs_n = (tile % GU_BLOCKS) * GU_N + tl.arange(0, GU_N)
            g_n_ok = g_offs_n < INTER
            g_expert = tl.load(ids_ptr + g_pair).to(tl.int64)
            g_offs_k = tl.arange(0, GU_K)
            g_w_gate = w13_ptr + g_expert * stride_13e + g_offs_n[:, None].to(tl.int64) * stride_13n
            g_w_up = g_w_gate + INTER * stride_13n
            g_x_row = x_ptr + (g_pair // top_k).to(tl.int64) * stride_xm
            g_acc_gate = tl.zeros((GU_N, GU_K), dtype=tl.float32)
            g_acc_up = tl.zeros((GU_N, GU_K), dtype=tl.float32)
            for k0 in range(0, H, GU_K):
                g_kk = k0 + g_offs_k
                # every load of the step before any cast (a cast between them waits on x's latency)
                if EVEN_GU_K:
                    g_xv = tl.load(g_x_row + g_kk)
                    g_mask = g_n_ok[:, None]
                else:
                    g_k_ok = g_kk < H
                    g_xv = tl.load(g_x_row + g_kk, mask=g_k_ok, other=0.0)
                    g_mask = g_n_ok[:, None] & g_k_ok[None, :]
                g_wg = tl.load(g_w_gate + g_kk[None, :], mask=g_mask, other=0.0, eviction_policy="evict_first")
                g_wu = tl.load(g_w_up + g_kk[None, :], mask=g_mask, other=0.0, eviction_policy="evict_first")
                g_xf = g_xv.to(tl.float32)[None, :]
                g_acc_gate += g_wg.to(tl.float32) * g_xf
                g_acc_up += g_wu.to(tl.float32) * g_xf
            g_gate = tl.sum(g_acc_gate, axis=1)
            g_up = tl.sum(g_acc_up, axis=1)
            tl.store(act_ptr + g_pair * INTER + g_offs_n, g_gate / (1.0 + tl.exp(-g_gate)) * g_up, mask=g_n_ok)
            tl.debug_barrier()  # every thread's stores before the release below
            tl.atomic_add(ready_ptr + g_pair, 1, sem="release", scope="gpu")
        else:
            # partial[pair * SPLITS + split, n] = weight[pair] * act[pair, k of the split] . w2[e, n, k of the split]
            d_d = tile - gu_tiles
            d_pair = d_d // (DN_BLOCKS * SPLITS)
            d_pid_n = (d_d // SPLITS) % DN_BLOCKS
            d_split = d_d % SPLITS
            d_offs_n = d_pid_n * DN_N + tl.arange(0, DN_N)
            d_n_ok = d_offs_n < H
            d_expert = tl.load(ids_ptr + d_pair).to(tl.int64)
            d_offs_k = tl.arange(0, DN_K)
            d_w_rows = w2_ptr + d_expert * stride_2e + d_offs_n[:, None].to(tl.int64) * stride_2n
            d_act_row = act_ptr + d_pair.to(tl.int64) * INTER
            d_k_start = d_split * k_per_split  # a whole number of DN_K per split: splits do not overlap
            d_kk = d_k_start + d_offs_k
            if EVEN_DN_K:
                d_w = tl.load(d_w_rows + d_kk[None, :], mask=d_n_ok[:, None], other=0.0, eviction_policy="evict_first")
            else:
                d_w = tl.load(d_w_rows + d_kk[None, :], mask=d_n_ok[:, None] & (d_kk < INTER)[None, :], other=0.0,
                            eviction_policy="evict_first")
            # the pair's activations: wait for all of its gate_up tiles (their tickets are all taken)
            d_ready = tl.atomic_add(ready_ptr + d_pair, 0, sem="acquire", scope="gpu")
            while d_ready < GU_BLOCKS:
                d_ready = tl.atomic_add(ready_ptr + d_pair, 0, sem="acquire", scope="gpu")
            if EVEN_DN_K:
                d_av = tl.load(d_act_row + d_kk, cache_modifier=".cg")
            else:
                d_av = tl.load(d_act_row + d_kk, mask=d_kk < INTER, other=0.0, cache_modifier=".cg")
            d_acc = d_w.to(tl.float32) * d_av[None, :]
            for d_k0 in range(DN_K, k_per_split, DN_K):
                d_kk = d_k_start + d_k0 + d_offs_k
                if EVEN_DN_K:
                    d_w = tl.load(d_w_rows + d_kk[None, :], mask=d_n_ok[:, None], other=0.0, eviction_policy="evict_first")
                    d_av = tl.load(d_act_row + d_kk, cache_modifier=".cg")
                else:
                    d_k_ok = d_kk < INTER
                    d_w = tl.load(d_w_rows + d_kk[None, :], mask=d_n_ok[:, None] & d_k_ok[None, :], other=0.0,
                                eviction_policy="evict_first")
                    d_av = tl.load(d_act_row + d_kk, mask=d_k_ok, other=0.0, cache_modifier=".cg")
                d_acc += d_w.to(tl.float32) * d_av[None, :]
            d_out = tl.sum(d_acc, axis=1) * tl.load(weight_ptr + d_pair)
            tl.store(partial_ptr + (d_pair * SPLITS + d_split).to(tl.int64) * H + d_offs_n, d_out, mask=d_n_ok)
            # the token's last row of this column block sums the token's rows in index order
            d_token = d_pair // top_k
            sum_rows_if_last(ready_ptr + PAIRS + d_token * DN_BLOCKS + d_pid_n, partial_ptr, final_ptr, d_token,
                             d_offs_n, d_n_ok, H, ROWS, DN_N)
        # the launch's last program to exit zeroes the ticket and the ready counters (everyone else
        # has taken its ticket and passed its wait by then)
        if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == gu_tiles + PAIRS * DN_BLOCKS * SPLITS - 1:
            tl.store(sync_ptr, 0)
            tl.store(sync_ptr + 1, 0)
            offs_p = tl.arange(0, BLOCK_P)
            tl.store(ready_ptr + offs_p, tl.zeros((BLOCK_P,), dtype=tl.int32), mask=offs_p < PAIRS)

    return SimpleNamespace(experts=experts_kernel)


def one_launch_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                             topk_ids: torch.Tensor, splits: int | None = None,
                             blocks: small_m.SmallMBlocks | None = None) -> torch.Tensor:
    """`small_m.small_m_fused_experts` (same arguments, same result bit for bit with the same blocks and
    splits) in one kernel launch. Meant for few pairs; correct at any size (the counters grow
    with the pairs)."""
    b = blocks or small_m.DEFAULT_BLOCKS
    call = small_m.prepare_expert_call(x, w13, w2, topk_weights, topk_ids, splits, b)
    out = call.out
    if call.pairs == 0:
        return out
    t, hidden, inter, top_k, pairs = call.tokens, call.hidden, call.inter, call.top_k, call.pairs
    x, ids, weights, splits, k_per_split = call.x, call.ids, call.weights, call.splits, call.k_per_split
    gu_blocks, dn_blocks = small_m._cdiv(inter, b.gate_up_n), small_m._cdiv(hidden, b.down_n)
    sync = small_m._sum_arrivals(x.device, 2 + pairs + t * dn_blocks)
    act = torch.empty((pairs, inter), dtype=torch.float32, device=x.device)
    partial = torch.empty((pairs * splits, hidden), dtype=torch.float32, device=x.device)
    grid = (pairs * gu_blocks + pairs * dn_blocks * splits,)
    _kernels(_interpreting()).experts[grid](
        x, w13, w2, act, partial, out, weights, ids, sync, inter, hidden, k_per_split, top_k, x.stride(0),
        w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), pairs, gu_blocks, dn_blocks, splits,
        ROWS=top_k * splits, GU_N=b.gate_up_n, GU_K=b.gate_up_k, DN_N=b.down_n, DN_K=b.down_k,
        EVEN_GU_K=hidden % b.gate_up_k == 0, EVEN_DN_K=k_per_split * splits == inter,
        BLOCK_P=max(64, small_m._pow2(pairs)),  # one compiled kernel for every batch of the small path
        TRIGGER=trigger_dependents(out), num_warps=b.num_warps, **pdl_launch(small_m.moe_experts_pdl(x)))
    return out
