"""AttentionBackend: computes attention over the token-slot KV pool.

The memory a backend works on (see docs/contracts.md for the full picture):

- `KVPool` (`radixserve.memory.KVPool`): per layer, `k_buffers[layer_id]` and `v_buffers[layer_id]`
  of shape `[num_slots + 1, num_kv_heads, head_dim]` in the pool dtype (the runner's dtype: float32,
  bfloat16 or float16). Slot 0 is a reserved padding slot: no request owns it, padded CUDA-graph
  rows may write to it, nobody reads it as real data. `set_kv(layer_id, loc, k, v)` stores k, v
  (`[n, num_kv_heads*head_dim]` or `[n, num_kv_heads, head_dim]`, cast to the pool dtype) at slots
  `loc`; `get_kv(layer_id)` returns the two buffers (views, writable in place).
- `ReqToTokenPool`: `req_to_token[row, pos]` (int64, on the runner's device) is the KV slot of the
  token at position `pos` of the request that owns `row`. Entries at or beyond a request's
  `seq_len` are stale garbage a backend must never read.
- FP8 pools (plugin API 1.5, `runtime.kv_cache_dtype: fp8_e4m3`): `kv_pool.dtype` is
  `torch.float8_e4m3fn` and each layer has a k and a v scale (`kv_pool.kv_scales(layer_id)`); only a
  backend with `supports_fp8_kv_cache = True` is given one (see that flag).
- bf16 pools of fp32 models (plugin API 1.8, `runtime.kv_cache_dtype: bfloat16`): `kv_pool.dtype`
  is `torch.bfloat16` while q, k, v are fp32; only a backend with `supports_bf16_kv_cache = True` is
  given one.
- `LatentKVPool` (`radixserve.memory.LatentKVPool`, plugin API 1.4) instead of `KVPool` for a model
  with `attention_type = "latent"` (MLA): per layer one row of `kv_lora_rank + qk_rope_head_dim`
  values per slot; see radixserve.interfaces.latent_attention and docs/mla.md.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from radixserve.state import ForwardMode

if TYPE_CHECKING:
    import torch

    from radixserve.interfaces.latent_attention import LatentAttentionDims, LatentAttentionLayerSpec
    from radixserve.memory.kv_pool import KVPool
    from radixserve.memory.latent_pool import LatentKVPool
    from radixserve.memory.req_to_token import ReqToTokenPool
    from radixserve.state import ForwardBatch


@dataclass
class AttentionRunnerInfo:
    """What an attention backend receives at construction: `Backend(runner_info)`.

    The pools are the ones every later `ForwardBatch` carries (`batch.kv_pool`,
    `batch.req_to_token_pool`), so a backend may size static buffers from them once.

    Added in plugin API 1.0. Import it from `radixserve.interfaces` (its old home,
    `radixserve.model_runner`, re-exports it).
    """

    device: torch.device  # where the pools live and every batch tensor is
    dtype: torch.dtype  # activations and the KV pool (float32, bfloat16 or float16; an fp8 pool: kv_pool.dtype)
    num_layers: int  # layers of the model: valid layer_ids are 0..num_layers-1
    num_heads: int  # query heads of the model (this TP rank)
    num_kv_heads: int  # KV heads (this TP rank); num_heads is a multiple of it (GQA/MQA)
    head_dim: int
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool | LatentKVPool  # LatentKVPool for a latent-attention model (plugin API 1.4)
    max_bs: int  # most requests one batch can hold (rows of req_to_token_pool)
    context_len: int  # longest sequence (prefix + new tokens) of any request
    # Latent attention (plugin API 1.4): the model's LatentAttentionDims when its attention_type is
    # "latent"; kv_pool is then a LatentKVPool, num_kv_heads is 1 and head_dim the latent row width.
    # None for standard attention.
    latent: LatentAttentionDims | None = None
    # runtime.cpu_matmul_precision on a CPU runner, "highest" on any other device (plugin API 1.9):
    # "medium" lets the backend compute its score and value products from bf16-rounded inputs with
    # fp32 sums (as the model's linears then do); "highest" asks for the fp32 queries and weights and
    # the pool's stored values, exactly as given. A backend may always ignore it.
    matmul_precision: Literal["highest", "medium"] = "highest"


class AttentionLayerSpec(Protocol):
    """What a backend may read from the attention layer that calls it
    (`radixserve.layers.attention.RadixAttention` implements it)."""

    layer_id: int  # index into the KV pool's per-layer buffers
    num_heads: int  # query heads on this TP rank
    num_kv_heads: int  # KV heads on this TP rank (GQA when < num_heads)
    head_dim: int
    scaling: float  # softmax scale, usually head_dim ** -0.5
    # Per-layer options (added in plugin API 1.3; read them with getattr(layer, name, None), a layer
    # object of an older model may lack them):
    # sliding_window: None = full causal attention; W >= 1 = the query at position t sees only keys at
    #   positions p with t - W < p <= t (its W most recent tokens, itself included; HF's convention).
    #   Positions are absolute positions in the request: prefix tokens sit at their index, a new
    #   token at prefix_len + j (a draft-tree token at prefix_len + its depth in the tree).
    # logit_cap: None = off; c > 0 = each score s = scaling * q.k becomes c * tanh(s / c) before the
    #   mask and the softmax (Gemma 2's attention soft-capping).
    sliding_window: int | None
    logit_cap: float | None


def _standard_unsupported(self, q, k, v, layer, batch):
    raise NotImplementedError(f"{type(self).__name__} is latent-only (supports_standard_attention is False)")


class AttentionBackend(abc.ABC):
    """Attention over a paged (page size 1) KV pool.

    Life cycle: constructed once per ModelRunner as `Backend(runner_info)` (an
    `AttentionRunnerInfo`). For every forward the runner calls `init_forward_metadata(batch)`
    once, then each attention layer calls `forward(q, k, v, layer, batch)`, which dispatches to
    `forward_extend` or `forward_decode` by `batch.mode`.

    Restrictions:
    - Heavy imports (triton, CUDA extensions) belong in the module that defines the class: the
      registry imports it only when the backend is selected.
    - No host/device synchronisation in `forward_*` (read lengths from `batch.*_cpu` lists).
    - A backend that supports CUDA graphs keeps every tensor a graph reads in static buffers
      (see `supports_cuda_graph`).

    Check a backend with `radixserve.testing.check_attention_backend(MyBackend)`.

    Added in plugin API 1.0.
    """

    supports_tensor_parallel: bool = False
    """Class flag: this component works when `runtime.tp_size > 1` (each rank's backend sees only
    that rank's q/k/v heads (`AttentionRunnerInfo.num_heads`/`num_kv_heads` are per rank) and its
    own KV pool, and must make no assumption about the whole model's head count). The stack
    resolution refuses a tp_size > 1 config that selects a component leaving it False, naming it.
    Added in plugin API 1.3."""

    # Metadata read by the registry without importing the module is declared at registration;
    # these class attributes repeat it for components built directly.
    name: str = "base"
    # True when forward_extend honours `batch.tree_mask` (speculative verify of tree drafts: the
    # new tokens attend each other by the mask instead of causally; see ForwardBatch.tree_mask).
    # A backend that leaves it False is only given chain drafts. Added in plugin API 1.1.
    supports_tree_mask: bool = False
    # True when forward_decode stores every row's k, v (at out_cache_loc) before any row's attention
    # reads the pool, so several rows of one DECODE batch may be consecutive tokens of the same
    # request (same req_pool_index, each row's seq_len one more than the previous row's). The
    # runner then verifies chain drafts as such a decode batch, which runs in the decode CUDA
    # graphs; False: chain drafts are verified as an EXTEND batch (eager). Added in plugin API 1.1.
    # With CUDA graphs the runner also verifies tree drafts as decode rows: a node off its request's
    # first chain reads a scratch row of the ReqToTokenPool (the prefix, then its path's slots),
    # so rows of one request may have different req_pool_indices (radixserve/tree_decode_rows.py).
    decode_rows_share_requests: bool = False
    # True when forward_extend and forward_decode honour `layer.sliding_window` and `layer.logit_cap`
    # (see AttentionLayerSpec), tree masks included. The runner refuses to run a model that has a
    # windowed (or soft-capped) layer on a backend that leaves the matching flag False, naming it.
    # Added in plugin API 1.3.
    supports_sliding_window: bool = False
    supports_logit_cap: bool = False
    # Latent attention (MLA; plugin API 1.4). supports_latent_attention: the backend implements
    # forward_latent_extend / forward_latent_decode below and works on a LatentKVPool.
    # supports_standard_attention: it implements forward_extend / forward_decode; a latent-only
    # backend sets it False and then need not define forward_extend / forward_decode (they raise
    # NotImplementedError). The runner refuses a model whose attention type the selected backend
    # does not support, naming both.
    supports_latent_attention: bool = False
    supports_standard_attention: bool = True
    # FP8 KV cache (plugin API 1.5): True when forward_extend / forward_decode work on a KVPool whose
    # dtype is torch.float8_e4m3fn (`runtime.kv_cache_dtype: fp8_e4m3`): they store k, v quantized
    # (`kv_pool.set_kv`, or `kv_pool.quantize_kv` then the same bytes) and dequantize what they read
    # with the layer's `kv_pool.kv_scales(layer_id)` (real value = stored.float() * scale). The
    # stack resolution refuses fp8_e4m3 with a backend that leaves it False, naming the ones that
    # declare it. Standard attention only: latent (MLA) pools stay in the model dtype.
    supports_fp8_kv_cache: bool = False
    # bf16 KV cache of an fp32 (or fp16) model (plugin API 1.8, `runtime.kv_cache_dtype: bfloat16`):
    # True when forward_extend / forward_decode work on a KVPool whose dtype is torch.bfloat16 while
    # q, k, v come in the model dtype: they store k, v rounded to bf16 (`kv_pool.set_kv` does it) and
    # compute with the stored values widened (`kv_pool.read_kv(layer_id, slots, q.dtype)`). The stack
    # resolution refuses bfloat16 for a non-bf16 model with a backend that leaves it False.
    supports_bf16_kv_cache: bool = False
    # True when the backend overrides `forward_decode_rotary` (rotary applied in the kernel that
    # stores k, v into the pool). False: the layer applies rotary itself and calls `forward`, so a
    # backend that leaves it False sees no change. Added in plugin API 1.5.
    fuses_rotary_with_kv_store: bool = False
    # True when `forward_decode_rotary` also takes `qk_norm` (a radixserve.layers.attention.QKNorm,
    # only a `fusable` one) and applies the per-head q/k norms before the rotation, in the same
    # kernel. False: the layer applies them first. Added in plugin API 1.6.
    fuses_qk_norm_with_rotary: bool = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.supports_standard_attention:  # latent-only: the standard methods are no longer abstract
            for method in ("forward_extend", "forward_decode"):
                if getattr(getattr(cls, method), "__isabstractmethod__", False):
                    setattr(cls, method, _standard_unsupported)

    @classmethod
    def supports(cls, device: str, dtype: str, head_dim: int) -> bool:
        """Whether this backend can run this configuration.

        :param device: torch device type, e.g. "cpu" or "cuda".
        :param dtype: the runner's dtype name without "torch.", e.g. "bfloat16".
        :param head_dim: the model's head size; for a latent-attention model (plugin API 1.4) the
            latent row width `kv_lora_rank + qk_rope_head_dim` (`AttentionRunnerInfo.head_dim`).
        :return: False makes the runner refuse the selected backend with a message naming the
            configuration. The default accepts everything.

        Added in plugin API 1.0.
        """
        return True

    @classmethod
    def build_native_kernels(cls, device: str) -> None:
        """Compile (or load from the cache) the native kernels this backend will use on `device`.

        :param device: torch device type the runner will use, e.g. "cpu".

        Called by the runner once per process, in a background thread, right after the stack is
        resolved and before the model loads: a first-ever start then compiles the backend's kernels
        next to the weight load instead of after it. Restrictions: idempotent and safe to run while
        the model loads (`radixserve.native.load_extension` is both); an exception is only logged
        (at debug level) and the backend's own later call must report the problem. Default: nothing.

        Added in plugin API 1.1.
        """
        return None

    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare what every layer of this forward reuses.

        :param batch: the whole batch (mode, lengths on device and host, the pools). Request i
            owns rows `extend_lens[i]` consecutive packed tokens; its KV slots are
            `req_to_token[req_pool_indices[i], :seq_lens[i]]`, of which the first `prefix_lens[i]`
            are already filled and the rest are `out_cache_loc` (already written into the row).
        :return: nothing; the backend stores what it computed (index tensors, split plans) in
            `batch.attn_metadata`, which belongs to the backend for this forward.

        Called exactly once per forward, before any layer runs. Must not write to the KV pool.

        Added in plugin API 1.0.
        """

    @abc.abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        """Attention for an EXTEND batch: prefill, chunked prefill, or a mix of requests with
        different prefix and extend lengths (some may extend by a single token).

        :param q: `[num_tokens, num_heads*head_dim]`, the new tokens' queries, packed by request.
        :param k: `[num_tokens, num_kv_heads*head_dim]`, keys of the new tokens only.
        :param v: like `k`, values. q, k and v may be strided views (column slices of the fused qkv
            projection's output): only the last dim's stride is 1, so read `stride(0)` or make them
            contiguous; never assume a row stride of the row's width.
        :param layer: the calling layer (`layer_id`, head counts, `scaling`).
        :param batch: the batch passed to `init_forward_metadata` (with `attn_metadata`).
        :return: `[num_tokens, num_heads*head_dim]` in q's dtype: for each new token, softmax-
            weighted values over its request's prefix KV plus the new tokens up to and including
            itself (causal), query head h reading KV head h // (num_heads // num_kv_heads).
            With `layer.sliding_window` set only the window's keys count; with `layer.logit_cap` the
            scores are soft-capped first (see AttentionLayerSpec; added in plugin API 1.3).

        Restrictions: first store k, v into `batch.kv_pool` at `batch.out_cache_loc` for
        `layer.layer_id` (as `KVPool.set_kv` would); change no other slot of any layer.

        Added in plugin API 1.0.
        """

    @abc.abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        """Attention for a DECODE batch: exactly one new token per request
        (`extend_lens == 1`, `prefix_lens == seq_lens - 1`).

        Parameters, return value and restrictions as `forward_extend` (num_tokens == batch size).

        Added in plugin API 1.0.
        """

    def forward_decode_rotary(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, rotary,
        layer: AttentionLayerSpec, batch: ForwardBatch, qk_norm=None,
    ) -> torch.Tensor:
        """`forward_decode` of q and k before rotary: the result must equal
        `forward_decode(*rotary(positions, q, k), v, layer, batch)`, and the pool must end up holding
        the rotated k, as that call leaves it; a backend overrides it to do the rotation in the same
        kernel that stores k and v. Called (by `RadixAttention.forward_rotary`) only for DECODE
        batches, only when `fuses_rotary_with_kv_store` is True, and only with a stock rotary.
        `qk_norm` (a `QKNorm`, passed only to a backend declaring `fuses_qk_norm_with_rotary`): q
        and k are also not yet normalised; the result must equal the call above on `qk_norm(q, k)`
        up to rounding (the norm's fp32 statistic may be summed in another order).

        :param q: / `k`, `v`: as `forward_decode`, q and k not yet rotated.
        :param positions: int64 `[num_tokens]`, each token's position (`batch.positions`).
        :param rotary: a `radixserve.layers.rotary.RotaryEmbedding` that does not override `forward`
            (neox / rotate-half layout on the first `rotary.rotary_dim` of each head's
            `rotary.head_dim` values); `rotary.cos_sin_tables(positions)` gives its fp32 cos and
            sin caches `[>= max position + 1, rotary_dim]` (the rotation rounds each to q's dtype,
            as the torch code does); `rotary(positions, q, k)` is the unfused computation.
        :return: as `forward_decode`.

        Default: exactly the unfused computation. Added in plugin API 1.5; `qk_norm` in 1.6.
        """
        if qk_norm is not None:
            q, k = qk_norm(q, k)
        q, k = rotary(positions, q, k)
        return self.forward_decode(q, k, v, layer, batch)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        """Dispatch on `batch.mode`; backends normally do not override it."""
        if batch.mode is ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    # ---- latent attention (MLA), plugin API 1.4 ----------------------------------------------
    def forward_latent_extend(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
        layer: LatentAttentionLayerSpec, batch: ForwardBatch,
    ) -> torch.Tensor:
        """Latent attention for an EXTEND batch (same batch shapes and masking rules as
        `forward_extend`: causal over the request's prefix and new tokens, or `batch.tree_mask` when
        the backend declares `supports_tree_mask`).

        :param q_nope: `[num_tokens, num_heads, qk_nope_head_dim]`, the queries' non-rotary part.
        :param q_pe: `[num_tokens, num_heads, qk_rope_head_dim]`, rotary already applied.
        :param c_kv: `[num_tokens, kv_lora_rank]`, the new tokens' normalised latents.
        :param k_pe: `[num_tokens, qk_rope_head_dim]`, their shared rotary key part, rotary applied.
        :param layer: the calling layer (`LatentAttentionLayerSpec`: dims, `scaling`, `w_uk`, `w_uv`).
        :param batch: the batch passed to `init_forward_metadata`; `batch.kv_pool` is a LatentKVPool.
        :return: `[num_tokens, num_heads * v_head_dim]` in q_nope's dtype: per head h the attention of
            query `[q_nope[h], q_pe[h]]` over keys `[c_kv @ w_uk[h].T, k_pe]` and values
            `c_kv @ w_uv[h].T` of the request's prefix and new tokens (see latent_attention.py).

        Restrictions: first store the new rows (`LatentKVPool.set_latent(layer_id, out_cache_loc,
        c_kv, k_pe)` or the same bytes); change no other slot. Called only when
        `supports_latent_attention` is True.

        Added in plugin API 1.4.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support latent attention (MLA)")

    def forward_latent_decode(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
        layer: LatentAttentionLayerSpec, batch: ForwardBatch,
    ) -> torch.Tensor:
        """Latent attention for a DECODE batch (one new token per request). Parameters, return
        value and restrictions as `forward_latent_extend`; with `decode_rows_share_requests` the
        same promise as for `forward_decode` (all rows stored before any row reads).

        Added in plugin API 1.4.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support latent attention (MLA)")

    def forward_latent(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
        layer: LatentAttentionLayerSpec, batch: ForwardBatch,
    ) -> torch.Tensor:
        """Dispatch on `batch.mode`; backends normally do not override it. Added in plugin API 1.4."""
        if batch.mode is ForwardMode.DECODE:
            return self.forward_latent_decode(q_nope, q_pe, c_kv, k_pe, layer, batch)
        return self.forward_latent_extend(q_nope, q_pe, c_kv, k_pe, layer, batch)

    # ---- optional CUDA graph support -------------------------------------------------------
    def supports_cuda_graph(self) -> bool:
        """True when the four graph hooks below are implemented. Default False: decode then
        runs eagerly.

        Added in plugin API 1.0.
        """
        return False

    def init_graph_state(self, max_bs: int) -> None:
        """Allocate static buffers for decode batches of up to `max_bs` requests. Called once,
        before any capture.

        Added in plugin API 1.0.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """Like `init_forward_metadata` for a DECODE batch, but writing into the static buffers;
        called while a graph for `batch.batch_size` is captured.

        Added in plugin API 1.0.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay(self, batch: ForwardBatch, real_bs: int) -> None:
        """Refresh the static buffers in place before a replay. `batch` is padded to the captured
        size: rows from `real_bs` on are padding (their slots point at slot 0, seq_len 1).

        Added in plugin API 1.0.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    # ---- optional CUDA graphs of EXTEND batches (runtime.cuda_graph_extend_max_tokens) ----------
    def supports_extend_cuda_graph(self) -> bool:
        """True when the three extend-graph hooks below are implemented. Default False: prefill
        and mixed prefill + decode batches then run eagerly (one host launch per kernel).

        Added in plugin API 1.10.
        """
        return False

    def init_extend_graph_state(self, max_tokens: int, max_reqs: int) -> None:
        """Allocate static metadata for EXTEND batches of up to `max_tokens` new tokens in up to
        `max_reqs` requests. Called once, before any extend capture.

        Added in plugin API 1.10.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support extend CUDA graphs")

    def init_extend_metadata_capture(self, batch: ForwardBatch) -> None:
        """Like `init_forward_metadata` for an EXTEND batch, writing into the static metadata, from
        the batch's host lists (`prefix_lens_cpu`, `extend_lens_cpu`, `seq_lens_cpu`, one entry per
        request slot). Called before a graph for `batch.num_tokens` tokens is captured. The captured
        `forward_extend` must launch the same kernels with the same grids for any lengths that fit
        (no per-request launches, no host reads of device values): what it launches is recorded
        once and replayed for every later batch of that token count.

        The runner's padding (radixserve.extend_graph_runner): `batch.batch_size` is always the
        static `max_reqs`; after the real requests comes one padding request owning the padding
        tokens (prefix 0, its tokens' slots all slot 0, its row of `req_to_token` all zeros), then
        empty requests (extend length 0, prefix 0). Nothing the padding computes reaches a real
        request.

        Added in plugin API 1.10.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support extend CUDA graphs")

    def init_extend_metadata_replay(self, batch: ForwardBatch, real_bs: int) -> None:
        """Refresh the static metadata in place from the batch's host lists before a replay; the
        first `real_bs` requests are real, the rest padding as described above.

        Added in plugin API 1.10.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support extend CUDA graphs")
