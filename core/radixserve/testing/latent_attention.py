"""Conformance kit for latent attention (MLA): a backend's `forward_latent_*` against an exact
float64 reference that decompresses the latent rows (keys `[c_kv @ w_uk[h].T, k_pe]`, values
`c_kv @ w_uv[h].T`), on twin copies of a `LatentKVPool`, step by step.

The scenarios are those of the standard kit (radixserve.testing.attention): requests with cached
prefixes (some sharing another's slots), prompts prefilled in chunks inside mixed EXTEND batches
(some requests adding one token), DECODE batches over random subsets; then, when the backend
declares them, speculative verifies with draft trees (`supports_tree_mask`) and chain verifies as
decode rows sharing a request (`decode_rows_share_requests`). After every step the outputs must
match per request and both pools must be identical (the new rows at `out_cache_loc` of the called
layer, nothing else changed)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from radixserve.interfaces.attention import AttentionBackend, AttentionRunnerInfo
from radixserve.interfaces.latent_attention import LatentAttentionDims, LatentAttentionLayerSpec
from radixserve.layers.latent_attention import RadixLatentAttention
from radixserve.memory import LatentKVPool
from radixserve.plugins.attention_class import attention_class_problem
from radixserve.state import ForwardBatch
from radixserve.testing._threads import single_threaded
from radixserve.testing.attention import (
    _LAYER_ID,
    _MAX_CHAIN,
    _MAX_DECODE_ROWS,
    _MAX_PREFIX,
    _MAX_PROMPT,
    _MAX_TREE,
    _NUM_LAYERS,
    DEFAULT_LONG_POSITIONS,
    DEFAULT_TOLERANCE,
    _check_long_positions,
    _check_step_counts,
    _fused_views,
    _long_scenario_sizes,
    _Scenario,
    _scenario_sizes,
    _Twin,
    exact_attention_per_request,
)

# (num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim): v unlike nope, nope
# unlike rope, so a backend that mixes them up fails; the first has DeepSeek's proportions, scaled down
DEFAULT_LATENT_DIMS = ((4, 64, 32, 16, 32), (3, 32, 16, 8, 24))


class ReferenceLatentAttentionBackend(AttentionBackend):
    """Exact latent attention in float64, decompressed, one request at a time: the latent kit's
    reference, and the default backend of `check_model_parity` for a latent model (slow; not
    registered). Added in plugin API 1.4."""

    name = "reference_latent"
    supports_latent_attention = True
    supports_standard_attention = False
    supports_tree_mask = True
    decode_rows_share_requests = True  # every row is stored before any row reads

    def __init__(self, runner_info: AttentionRunnerInfo | None = None) -> None:
        self.runner_info = runner_info

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = None  # everything is read from the batch's host lists

    def latent64(self, q_nope, q_pe, c_kv, k_pe, layer: LatentAttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        """The contract's result in float64 `[num_tokens, num_heads * v_head_dim]`, after storing the
        new rows like `LatentKVPool.set_latent`."""
        batch.kv_pool.set_latent(layer.layer_id, batch.out_cache_loc, c_kv, k_pe)
        buf = batch.kv_pool.get_latent(layer.layer_id)
        h, lora, v = layer.num_heads, layer.kv_lora_rank, layer.v_head_dim
        w_uk, w_uv = layer.w_uk.double(), layer.w_uv.double()
        q64 = torch.cat([q_nope.reshape(-1, h, layer.qk_nope_head_dim), q_pe.reshape(-1, h, layer.qk_rope_head_dim)],
                        dim=-1).double()
        out = q64.new_empty(q64.shape[0], h, v)

        def keys_values(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rows = buf[slots].double()
            latent, pe = rows[:, :lora], rows[:, lora:]
            keys = torch.cat([torch.einsum("sc,hdc->shd", latent, w_uk), pe[:, None, :].expand(-1, h, -1)], dim=-1)
            return keys, torch.einsum("sc,hdc->shd", latent, w_uv)

        exact_attention_per_request(q64, keys_values, out, layer, batch)
        return out.reshape(-1, h * v)

    def forward_latent_extend(self, q_nope, q_pe, c_kv, k_pe, layer, batch: ForwardBatch) -> torch.Tensor:
        return self.latent64(q_nope, q_pe, c_kv, k_pe, layer, batch).to(q_nope.dtype)

    def forward_latent_decode(self, q_nope, q_pe, c_kv, k_pe, layer, batch: ForwardBatch) -> torch.Tensor:
        return self.latent64(q_nope, q_pe, c_kv, k_pe, layer, batch).to(q_nope.dtype)


class _LatentScenario(_Scenario):
    """The standard kit's scenario on a LatentKVPool; `self.heads` holds the latent dims tuple."""

    def _make_layer(self, sliding_window, logit_cap):
        h, lora, nope, rope, v = self.heads
        kv_b = nn.Linear(lora, h * (nope + v), bias=False)
        with torch.no_grad():  # unit-variance keys and values from unit-variance latents
            kv_b.weight.copy_(torch.randn(kv_b.weight.shape, generator=self.gen) / math.sqrt(lora))
        kv_b.to(device=self.device, dtype=self.dtype)
        self._kv_b = kv_b
        # scaling is not the default (nope + rope) ** -0.5: it must be read
        return RadixLatentAttention(_LAYER_ID, h, lora, nope, rope, v, 1.3 * (nope + rope) ** -0.5, kv_b)

    def _reference_backend(self):
        return ReferenceLatentAttentionBackend

    def _make_pool(self):
        _, lora, _, rope, _ = self.heads
        return LatentKVPool(self.num_slots, _NUM_LAYERS, lora, rope, self.dtype, self.device)

    def _runner_info(self, table, kv, rows: int) -> AttentionRunnerInfo:
        h, lora, nope, rope, v = self.heads
        return AttentionRunnerInfo(
            device=torch.device(self.device), dtype=self.dtype, num_layers=_NUM_LAYERS, num_heads=h, num_kv_heads=1,
            head_dim=lora + rope, req_to_token_pool=table, kv_pool=kv, max_bs=rows, context_len=self.context,
            latent=LatentAttentionDims(_NUM_LAYERS, h, lora, nope, rope, v),
        )

    def _fill_prefix(self, layer_id: int, loc: torch.Tensor) -> None:
        _, lora, _, rope, _ = self.heads
        c_kv, k_pe = self._rand(len(loc), lora), self._rand(len(loc), rope)
        for twin in (self.test, self.ref):
            twin.kv_pool.set_latent(layer_id, loc, c_kv, k_pe)

    def _inputs(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        h, lora, nope, rope, _ = self.heads
        return self._as_runner_gives((self._rand(num_tokens, h, nope), self._rand(num_tokens, h, rope),
                                      self._rand(num_tokens, lora), self._rand(num_tokens, rope)))

    def _as_runner_gives(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """As a latent model passes them (DeepSeek's): q_nope and q_pe split per head from one q
        projection `[T, H, nope + rope]`, c_kv and k_pe split from one `[T, lora + rope]` row."""
        q_nope, q_pe, c_kv, k_pe = inputs
        return (*_fused_views(q_nope, q_pe), *_fused_views(c_kv, k_pe))

    def _out_width(self) -> int:
        return self.heads[0] * self.heads[4]

    def _run_test(self, inputs, batch: ForwardBatch) -> torch.Tensor:
        return self.test.backend.forward_latent(*inputs, self.layer, batch)

    def _run_reference(self, inputs, batch: ForwardBatch) -> torch.Tensor:
        return self.ref.backend.latent64(*inputs, self.layer, batch)

    def _pool_tensors(self, twin: _Twin, layer_id: int) -> Sequence[torch.Tensor]:
        return [twin.kv_pool.get_latent(layer_id)]

    def _describe(self) -> str:
        return f"latent dims (heads, kv_lora_rank, nope, rope, v) {self.heads}"


@single_threaded
def check_latent_attention_backend(
    backend: Callable[[AttentionRunnerInfo], AttentionBackend],
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    dims: Sequence[tuple[int, int, int, int, int]] = DEFAULT_LATENT_DIMS,
    seeds: Sequence[int] = (0, 1),
    num_requests: int = 4,
    decode_steps: int = 3,
    tree_steps: int = 3,
    decode_row_steps: int = 2,
    tolerance: float | None = None,
    long_positions: Sequence[int] = DEFAULT_LONG_POSITIONS,
) -> None:
    """Run a latent-attention backend against exact decompressed attention; raise AssertionError
    naming the first difference (the case, the step, the request).

    :param backend: the backend class (constructed as `backend(runner_info)` with
        `runner_info.latent` set, a `LatentKVPool`, `num_kv_heads=1` and `head_dim` the latent row
        width, as the runner does; it must declare `supports_latent_attention`, and is asked
        `supports(device, dtype, kv_lora_rank + qk_rope_head_dim)` first: refused shapes are
        skipped, but at least one must be supported), or any callable taking an
        `AttentionRunnerInfo`.
    :param device, dtype: where and in which dtype the pool, the layer's `kv_b_proj` weight and the
        activations live.
    :param dims: (num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) tuples.
    :param seeds: one random scenario per seed and shape.
    :param num_requests, decode_steps: requests per scenario (>= 1) and DECODE batches after their
        prefills (>= 0), as in `check_attention_backend`.
    :param tree_steps: verify forwards with random draft trees per scenario (then one with chains
        as trees, which must equal the backend's own causal extend), when the backend sets
        `supports_tree_mask`.
    :param decode_row_steps: chain verifies as DECODE batches of rows sharing requests, when the
        backend sets `decode_rows_share_requests`.
    :param tolerance: the largest relative error per request and step; default by dtype (fp32
        1e-3, fp16 5e-3, bf16 2e-2).
    :param long_positions: key positions one more scenario crosses, on the first supported shape and
        seed, as in `check_attention_backend` (`()` skips it). Added in plugin API 1.13.

    The inputs are laid out as a latent model passes them: `q_nope`, `q_pe` per-head column slices of
    one `[T, H, nope + rope]` buffer, `c_kv`, `k_pe` column slices of one `[T, lora + rope]` buffer (last
    dim contiguous, rows not).

    Added in plugin API 1.4.
    """
    problem = attention_class_problem(backend) if isinstance(backend, type) else None
    assert problem is None, problem
    if isinstance(backend, type) and not getattr(backend, "supports_latent_attention", False):
        raise AssertionError(f"{backend.__name__} does not declare supports_latent_attention = True")
    _check_step_counts(num_requests=num_requests, decode_steps=decode_steps, tree_steps=tree_steps,
                      decode_row_steps=decode_row_steps)
    _check_long_positions(long_positions)
    per_request = (_MAX_PREFIX + _MAX_PROMPT + decode_steps + tree_steps * _MAX_TREE + _MAX_CHAIN
                   + _MAX_DECODE_ROWS * decode_row_steps)
    sizes = _scenario_sizes(num_requests, per_request)
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCE[dtype]
    dtype_name = str(dtype).removeprefix("torch.")
    checked = 0
    supported = []
    for shape in dims:
        _, lora, _, rope, _ = shape
        if isinstance(backend, type) and not backend.supports(torch.device(device).type, dtype_name, lora + rope):
            continue
        supported.append(shape)
        for seed in seeds:
            scenario = _LatentScenario(backend, shape, dtype, device, seed, tol, **sizes)
            scenario.run(num_requests, decode_steps)
            test = scenario.test.backend
            if tree_steps and getattr(test, "supports_tree_mask", False):
                scenario.run_trees(tree_steps)
            if decode_row_steps and getattr(test, "decode_rows_share_requests", False):
                scenario.run_decode_rows(decode_row_steps)
            checked += 1
    if long_positions and supported:
        scenario = _LatentScenario(backend, supported[0], dtype, device, seeds[0], tol,
                                   **_long_scenario_sizes(long_positions, decode_steps, tree_steps))
        scenario.run_long(long_positions, decode_steps, tree_steps)
    if not checked:
        raise AssertionError(f"{backend!r}.supports() refused every latent shape in {list(dims)} on {device}/{dtype_name}")
