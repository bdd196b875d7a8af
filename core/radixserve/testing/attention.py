"""Conformance kit for attention backends: the backend under test and an exact float64 reference
run the same batches on twin copies of the KV memory, step by step.

Each random scenario has requests with cached prefixes (some sharing a prefix's KV slots), prompts
prefilled in chunks inside mixed EXTEND batches (some requests adding a single token), then DECODE
batches over random subsets in random order; KV slots are scattered, request rows are not in batch
order, and table entries past each request's length hold garbage. After every step the outputs
must match per request and both pools must be identical (new K/V at `out_cache_loc` of the right
layer, every other slot untouched). q, k and v are column views of one fused buffer, as the runner's
qkv projection gives them. The random scenarios stay under about 100 positions; one more scenario
(`long_positions`) crosses 64, 128 and 256 key positions, where kernels change tiles.

For a backend with `supports_tree_mask = True` the scenarios go on with speculative verify
forwards: EXTEND batches whose requests each score a random draft tree after their prefix
(`ForwardBatch.tree_mask`), several requests per batch, some adding a single token; and chains
passed as trees, whose result must equal the backend's own plain causal extend.

For a backend with `fuses_rotary_with_kv_store = True` (plugin API 1.5) every DECODE step goes
through `forward_decode_rotary` with unrotated q, k and a stock `RotaryEmbedding` (partial rotary
where the head size allows), the reference getting the layer's own `rotary(positions, q, k)`: the
outputs must match as above and the pools too, the new slots up to the tolerance (a fused kernel may
round the rotation differently from the CPU layer's), every other slot exactly. With
`fuses_qk_norm_with_rotary = True` too (plugin API 1.6) those calls also carry a `QKNorm` (per-head
RMSNorm of q and k, random weights) and the reference gets `qk_norm(q, k)` before the rotation."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from radixserve.interfaces.attention import AttentionBackend, AttentionLayerSpec, AttentionRunnerInfo
from radixserve.memory import KVPool, ReqToTokenPool
from radixserve.plugins.attention_class import attention_class_problem
from radixserve.state import ForwardBatch, ForwardMode, tree_block
from radixserve.testing._threads import single_threaded

DEFAULT_HEADS = ((4, 2, 64), (8, 1, 64), (3, 3, 32))  # (query heads, KV heads, head_dim): GQA, MQA, MHA
DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# matmul_precision="medium": queries and softmax weights may be rounded to bf16 (8 significant bits)
MEDIUM_PRECISION_TOLERANCE = 1e-2
_NUM_LAYERS, _LAYER_ID = 2, 1  # the backend must write the layer it is called for, and only it
# key positions the long scenario's sequences cross: common kernel tile sizes
DEFAULT_LONG_POSITIONS = (64, 128, 256)
_ROWS, _CONTEXT, _SLOTS = 12, 256, 1000  # a scenario's pools unless its arguments need more
_MAX_DECODE_ROWS = 5  # rows of one request in a decode-rows chain verify
_MAX_PREFIX, _MAX_PROMPT, _MAX_TREE, _MAX_CHAIN = 70, 20, 20, 9  # per request, as `run` and `run_trees` draw them


class ReferenceAttentionBackend(AttentionBackend):
    """Exact attention in float64, one request at a time: the kit's reference, and a backend any
    test can run a model with (slow; not registered)."""

    name = "reference"
    supports_tree_mask = True
    supports_sliding_window = True
    supports_logit_cap = True
    supports_bf16_kv_cache = True  # it attends the stored values, widened to float64

    def __init__(self, runner_info: AttentionRunnerInfo | None = None) -> None:
        self.runner_info = runner_info

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = None  # everything is read from the batch's host lists

    def attend64(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        """The contract's result in float64, after storing k, v like `KVPool.set_kv`."""
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q64 = q.reshape(-1, hq, d).double()
        out = torch.empty_like(q64)

        def keys_values(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keys = k_buf[slots].double().repeat_interleave(hq // hkv, dim=1)  # [seq, hq, d]
            return keys, v_buf[slots].double().repeat_interleave(hq // hkv, dim=1)

        exact_attention_per_request(q64, keys_values, out, layer, batch)
        return out.reshape(-1, hq * d)

    def forward_extend(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        return self.attend64(q, k, v, layer, batch).to(q.dtype)

    def forward_decode(self, q, k, v, layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        return self.attend64(q, k, v, layer, batch).to(q.dtype)


def exact_attention_per_request(q64: torch.Tensor, keys_values, out: torch.Tensor, layer, batch: ForwardBatch) -> None:
    """The contract's masked attention in float64, one request at a time, written into `out`
    `[num_tokens, heads, v_dim]`: q64 `[num_tokens, heads, dk]`; `keys_values(slots)` gives the
    request's float64 keys `[seq, heads, dk]` and values `[seq, heads, v_dim]` for its slots in
    position order. Causal, or by `batch.tree_mask` among the new tokens; the layer's sliding
    window and logit cap when it has them."""
    table = batch.req_to_token_pool.req_to_token
    start = mask_start = 0
    rows = batch.req_pool_indices.tolist()
    for row, seq, ext in zip(rows, batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True):
        keys, values = keys_values(table[row, :seq])
        scores = torch.einsum("thd,shd->hts", q64[start : start + ext], keys) * layer.scaling
        cap = getattr(layer, "logit_cap", None)
        if cap:
            scores = cap * torch.tanh(scores / cap)
        query_pos = torch.arange(seq - ext, seq, device=q64.device)[:, None]
        key_pos = torch.arange(seq, device=q64.device)[None, :]
        hidden = key_pos > query_pos  # causal: the future is hidden
        if batch.tree_mask is not None:  # the new tokens see each other by the tree, the prefix fully
            block = batch.tree_mask[mask_start : mask_start + ext * ext].view(ext, ext).to(q64.device)
            hidden = hidden.clone()
            hidden[:, seq - ext :] = ~block
            mask_start += ext * ext
            # a draft token sits at prefix + its depth (its ancestors, itself included, minus one)
            query_pos = (seq - ext) + block.sum(1, dtype=torch.int64)[:, None] - 1
            key_pos = torch.cat([key_pos[:, : seq - ext], query_pos.T], dim=1)
        window = getattr(layer, "sliding_window", None)
        if window:
            hidden = hidden | (key_pos <= query_pos - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start : start + ext] = torch.einsum("hts,shd->thd", scores.softmax(-1), values)
        start += ext


@dataclass
class _Layer:
    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None
    logit_cap: float | None = None


@dataclass
class _Request:
    row: int
    slots: list[int]  # KV slots of every token with KV so far, position order
    prompt_left: int  # prompt tokens not yet prefilled
    shares: int | None = None  # index of the request whose prefix slots it reuses


@dataclass
class _Twin:
    """One copy of the KV memory and the backend that works on it."""

    backend: AttentionBackend
    kv_pool: KVPool  # a LatentKVPool in the latent kit
    table: ReqToTokenPool


class _Scenario:
    """Drives one random scenario through the backend under test and the reference. The latent
    kit (radixserve.testing.latent_attention) subclasses it, replacing the hooks marked below."""

    def __init__(self, factory, heads, dtype, device, seed: int, tol: float,
                 sliding_window: int | None = None, logit_cap: float | None = None,
                 kv_dtype: torch.dtype | None = None, matmul_precision: str = "highest",
                 rows: int = _ROWS, context: int = _CONTEXT, num_slots: int = _SLOTS) -> None:
        self.rng = random.Random(seed)
        self.matmul_precision = matmul_precision  # the runner info's (the test twin's products)
        self.gen = torch.Generator().manual_seed(seed)
        self.heads, self.dtype, self.device, self.tol, self.seed = heads, dtype, device, tol, seed
        self.kv_dtype = kv_dtype or dtype  # the pools' (both twins'); the reference reads what they store
        self.layer = self._make_layer(sliding_window, logit_cap)
        self.num_slots, self.context = num_slots, context
        slots = list(range(1, self.num_slots + 1))
        self.rng.shuffle(slots)
        self.free_slots = slots
        self.free_rows = self.rng.sample(range(rows), rows)
        garbage = torch.randint(1, self.num_slots + 1, (rows, self.context), generator=self.gen)
        twins = []
        for make in (factory, self._reference_backend()):
            table = ReqToTokenPool(rows, self.context, device)
            table.req_to_token.copy_(garbage.to(device))  # stale entries past any request's length
            table.host.copy_(garbage)
            kv = self._make_pool()
            twins.append(_Twin(make(self._runner_info(table, kv, rows)), kv, table))
        self.test, self.ref = twins
        # a factory may return anything: say so, rather than fail on its first missing attribute
        assert isinstance(self.test.backend, AttentionBackend), (
            f"{factory!r} returned {type(self.test.backend).__name__}, not an AttentionBackend")
        self.reqs: list[_Request] = []
        self.note = ""  # what kind of scenario, in failure messages

    # ---- hooks (the latent kit replaces them) ----
    def _make_layer(self, sliding_window, logit_cap):
        hq, hkv, d = self.heads
        return _Layer(_LAYER_ID, hq, hkv, d, 1.3 * d**-0.5, sliding_window, logit_cap)  # scaling must be read

    def _reference_backend(self):
        return ReferenceAttentionBackend

    def _make_pool(self):
        _, hkv, d = self.heads
        return KVPool(self.num_slots, _NUM_LAYERS, hkv, d, self.kv_dtype, self.device)

    def _runner_info(self, table, kv, rows: int) -> AttentionRunnerInfo:
        hq, hkv, d = self.heads
        return AttentionRunnerInfo(
            device=torch.device(self.device), dtype=self.dtype, num_layers=_NUM_LAYERS, num_heads=hq,
            num_kv_heads=hkv, head_dim=d, req_to_token_pool=table, kv_pool=kv, max_bs=rows, context_len=self.context,
            matmul_precision=self.matmul_precision,
        )

    def _fill_prefix(self, layer_id: int, loc: torch.Tensor) -> None:
        """Random cached KV for slots `loc` of a layer, the same in both twins."""
        _, hkv, d = self.heads
        k, v = self._rand(len(loc), hkv, d), self._rand(len(loc), hkv, d)
        for twin in (self.test, self.ref):
            twin.kv_pool.set_kv(layer_id, loc, k, v)

    def _inputs(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        hq, hkv, d = self.heads
        return self._as_runner_gives(
            (self._rand(num_tokens, hq * d), self._rand(num_tokens, hkv * d), self._rand(num_tokens, hkv * d)))

    def _as_runner_gives(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The inputs laid out as the runner passes them: q, k, v column slices of one fused qkv
        projection output (row stride (hq + 2 * hkv) * head_dim, last-dim stride 1), not contiguous."""
        return _fused_views(*inputs)

    def _out_width(self) -> int:
        return self.heads[0] * self.heads[2]

    def _run_test(self, inputs, batch: ForwardBatch) -> torch.Tensor:
        return self.test.backend.forward(*inputs, self.layer, batch)

    def _run_reference(self, inputs, batch: ForwardBatch) -> torch.Tensor:
        return self.ref.backend.attend64(*inputs, self.layer, batch)

    def _pool_tensors(self, twin: _Twin, layer_id: int) -> Sequence[torch.Tensor]:
        return twin.kv_pool.get_kv(layer_id)

    def _describe(self) -> str:
        return f"heads {self.heads}"

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype).to(self.device)

    def _take_slots(self, n: int) -> list[int]:
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def add_request(self, prefix: int, prompt: int, share_from: int | None) -> None:
        """A request whose first `prefix` tokens are already cached (their KV put in the pool, or
        the first tokens of an earlier request's prefix when `share_from` is set)."""
        slots: list[int] = []
        if share_from is not None:
            slots = self.reqs[share_from].slots[:prefix]
        own = self._take_slots(prefix - len(slots))
        if own:
            for layer_id in range(_NUM_LAYERS):
                self._fill_prefix(layer_id, torch.tensor(own, dtype=torch.int64, device=self.device))
        slots = slots + own
        row = self.free_rows.pop()
        for twin in (self.test, self.ref):
            twin.table.write(row, 0, torch.tensor(slots, dtype=torch.int64))
        self.reqs.append(_Request(row, slots, prompt, share_from))

    def step(self, mode: ForwardMode, picks: Sequence[tuple[int, int]],
             trees: Sequence[list[int]] | None = None, same_as_causal: bool = False,
             decode_rows: bool = False, same_as_tree_rows: bool = False) -> None:
        """One forward: request `i` adds `n` tokens for each (i, n) in `picks` (batch order).

        `trees`: a speculative verify; for each pick, the parent of each new token within the
        request's new tokens (`parents[0] == -1`: the root, the last verified token). With
        `same_as_causal` (chains only) the backend's result must also equal its own result for
        the same batch without the mask. `decode_rows` (DECODE only): a chain verify as decode
        rows, the n tokens of a pick are n rows of the same request (the runner's
        `decode_rows_share_requests` batches). With `same_as_tree_rows` (trees only) the backend's
        result must also equal the same verify as a DECODE batch of one row per node over scratch
        rows of the table (the runner's tree verifies in CUDA graphs, radixserve.tree_decode_rows)."""
        prefix_lens, extend_lens, rows, new_slots, pick_prefix = [], [], [], [], []
        for i, n in picks:
            req = self.reqs[i]
            pick_prefix.append(len(req.slots))
            loc = self._take_slots(n)
            for twin in (self.test, self.ref):
                twin.table.write(req.row, len(req.slots), torch.tensor(loc, dtype=torch.int64))
            if decode_rows:  # row j sees the request's first prefix + j + 1 slots
                prefix_lens += range(len(req.slots), len(req.slots) + n)
                extend_lens += [1] * n
                rows += [req.row] * n
            else:
                prefix_lens.append(len(req.slots))
                extend_lens.append(n)
                rows.append(req.row)
            new_slots += loc
            req.slots += loc
            req.prompt_left = max(0, req.prompt_left - n)
        num_tokens = len(new_slots)
        inputs = self._inputs(num_tokens)
        window, cap = getattr(self.layer, "sliding_window", None), getattr(self.layer, "logit_cap", None)
        options = f", sliding_window {window}, logit_cap {cap}" if (window or cap) else ""
        what = f"seed {self.seed}, {self.note}{self._describe()}{options}, {mode.name} step (prefix, extend) = {list(zip(prefix_lens, extend_lens))}"
        blocks = None
        if trees is not None:
            blocks = [tree_block(parents) for parents in trees]
            what += f", tree parents {list(trees)}"
        if decode_rows:
            what += f", rows sharing requests {[i for i, n in picks for _ in range(n)]}"
        rotary = self._fused_rotary() if mode is ForwardMode.DECODE else None
        qk_norm = None
        if rotary is not None:
            what += f", through forward_decode_rotary (rotary_dim {rotary.rotary_dim})"
            if getattr(self.test.backend, "fuses_qk_norm_with_rotary", False):
                qk_norm = self._qk_norm(inputs[0].dtype)
                what += " with a per-head q/k RMSNorm (qk_norm)"
        outs = []
        for twin in (self.test, self.ref):
            batch = self._batch(mode, twin, rows, prefix_lens, extend_lens, new_slots, blocks)
            twin.backend.init_forward_metadata(batch)
            if twin is self.test:
                self._assert_pools_equal(f"{what}: init_forward_metadata wrote to the KV pool")
                norm_kw = {} if qk_norm is None else {"qk_norm": qk_norm}
                out = (self._run_test(inputs, batch) if rotary is None else self.test.backend.forward_decode_rotary(
                    *inputs, batch.positions, rotary, self.layer, batch, **norm_kw))
            else:
                if rotary is not None:
                    q, k, v = inputs
                    if qk_norm is not None:
                        q, k = qk_norm(q, k)
                    inputs = (*rotary(batch.positions, q, k), v)
                out = self._run_reference(inputs, batch)
            outs.append(out)
        got, want = outs
        q_dtype, width = inputs[0].dtype, self._out_width()
        assert isinstance(got, torch.Tensor), f"{what}: forward returned {type(got).__name__}, not a tensor"
        assert got.shape == (num_tokens, width), f"{what}: output shape {tuple(got.shape)} != {(num_tokens, width)}"
        assert got.dtype == q_dtype, f"{what}: output dtype {got.dtype} != q's dtype {q_dtype}"
        assert bool(torch.isfinite(got).all()), f"{what}: NaN or inf in the output"
        start = 0
        for row, ((i, n), p) in enumerate(zip(picks, pick_prefix, strict=True)):
            err = _rel_err(got[start : start + n], want[start : start + n])
            assert err < self.tol, (
                f"{what}: batch row {row} (the scenario's request {i}; prefix {p}, {n} new tokens) differs from "
                f"exact attention: relative error {err:.2e} >= {self.tol:.0e}; "
                + _where_worst(got[start : start + n], want[start : start + n], self.heads[0], first_position=p)
            )
            start += n
        self._assert_pools_equal(f"{what}: KV pool differs from the reference after the step (new K/V must land "
                                 f"at out_cache_loc of layer {_LAYER_ID}, nothing else may change)",
                                 loose_slots=new_slots if rotary is not None else None)
        if same_as_causal:  # the same forward again without the mask: storing the same K/V is idempotent
            batch = self._batch(mode, self.test, rows, prefix_lens, extend_lens, new_slots, None)
            self.test.backend.init_forward_metadata(batch)
            causal = self._run_test(inputs, batch)
            err = _rel_err(got, causal)
            assert err < self.tol, (f"{what}: a chain passed as a tree mask differs from the backend's own causal "
                                    f"extend: relative error {err:.2e} >= {self.tol:.0e}")
        if same_as_tree_rows:
            self._check_tree_rows(what, got, inputs, rows, prefix_lens, list(trees), new_slots)
        if mode is ForwardMode.EXTEND and trees is None and self._declares_extend_graphs():
            self._check_extend_graph_hooks(what, got, inputs, rows, prefix_lens, extend_lens, new_slots)

    def _declares_extend_graphs(self) -> bool:
        declares = getattr(self.test.backend, "supports_extend_cuda_graph", None)
        return bool(declares and declares()) and bool(self.free_rows)

    def _check_extend_graph_hooks(self, what, got, inputs, rows, prefix_lens, extend_lens, new_slots) -> None:
        """The same step as the runner's extend graphs run it (plugin API 1.10): static metadata sized
        once, filled at capture from another batch (every token in the padding request), refreshed
        from this one padded (a padding request of 5 tokens on an all-zero row and slot 0, then two
        empty requests) before the forward; the real rows must equal the plain step's."""
        backend, twin, pad = self.test.backend, self.test, 5
        n, bs = len(new_slots), len(rows)
        max_reqs, tokens = bs + 3, n + pad
        spare = self.free_rows[-1]
        saved_row = twin.table.req_to_token[spare].clone()
        twin.table.req_to_token[spare].zero_()
        try:
            backend.init_extend_graph_state(tokens, max_reqs)
            capture = self._batch(ForwardMode.EXTEND, twin, [spare] * max_reqs, [0] * max_reqs,
                                  [tokens] + [0] * (max_reqs - 1), [0] * tokens)
            backend.init_extend_metadata_capture(capture)
            padded = self._batch(ForwardMode.EXTEND, twin, list(rows) + [spare] * 3, list(prefix_lens) + [0] * 3,
                                 list(extend_lens) + [pad, 0, 0], list(new_slots) + [0] * pad)
            backend.init_extend_metadata_replay(padded, bs)
            extra = self._inputs(pad)
            both = self._as_runner_gives([torch.cat([x, e]) for x, e in zip(inputs, extra, strict=True)])
            out = backend.forward(*both, self.layer, padded)
        finally:
            twin.table.req_to_token[spare].copy_(saved_row)
            for a, b in zip(self._pool_tensors(self.test, _LAYER_ID), self._pool_tensors(self.ref, _LAYER_ID),
                            strict=True):
                a[0] = b[0]  # slot 0 took the padding tokens' KV
        err = _rel_err(out[:n], got)
        assert err < self.tol, (f"{what}: through the extend-graph hooks (init_extend_metadata_replay on the batch "
                                f"padded with a padding request and empty requests) the step differs from the plain "
                                f"step: relative error {err:.2e} >= {self.tol:.0e}")
        self._assert_pools_equal(f"{what}: through the extend-graph hooks the KV pool changed beyond out_cache_loc "
                                 f"and the padding tokens' slot 0")

    def _check_tree_rows(self, what, got, inputs, rows, prefix_lens, trees, new_slots) -> None:
        """The branching trees of the verify just run (those fitting 6 scratch rows, batch order),
        again as decode rows: every node a row of its request's row (first chain) or of a scratch
        row (the table's unused rows, garbage past the copied part) holding the prefix and its path;
        their K/V stored again (idempotent) before any row attends. Same RNG draws as without it."""
        from radixserve.tree_decode_rows import TreeDecodeRows

        picked, need, at = [], 0, 0  # (pick index, its first new token in the batch)
        for k, parents in enumerate(trees):
            off_chain = TreeDecodeRows.scratch_needed([parents])
            if off_chain and need + off_chain <= min(6, len(self.free_rows)):
                picked.append((k, at))
                need += off_chain
            at += len(parents)
        if not picked:
            return
        tokens = [a + j for k, a in picked for j in range(len(trees[k]))]
        tree_rows = TreeDecodeRows(list(self.free_rows))
        plan = tree_rows.plan([rows[k] for k, _ in picked], [prefix_lens[k] for k, _ in picked],
                              [trees[k] for k, _ in picked])
        slots = [new_slots[t] for t in tokens]
        tree_rows.write(plan, self.test.table.req_to_token, torch.tensor(slots, dtype=torch.int64, device=self.device))
        batch = self._batch(ForwardMode.DECODE, self.test, plan.rows, plan.positions, [1] * len(plan.rows), slots)
        self.test.backend.init_forward_metadata(batch)
        index = torch.tensor(tokens, dtype=torch.int64, device=got.device)
        err = _rel_err(self._run_test(self._as_runner_gives([x[index] for x in inputs]), batch), got[index])
        assert err < self.tol, (f"{what}: the tree as decode rows over scratch rows {sorted(set(plan.copy_to))} "
                                f"differs from the backend's tree-mask extend: relative error {err:.2e} >= {self.tol:.0e}")

    def _batch(self, mode, twin: _Twin, rows, prefix_lens, extend_lens, out_slots, blocks=None) -> ForwardBatch:
        dev = self.device
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]

        def t(xs) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=dev)

        positions = torch.cat([torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix_lens, seq_lens, strict=True)])
        return ForwardBatch(
            mode=mode, batch_size=len(rows), input_ids=torch.zeros(len(out_slots), dtype=torch.int64, device=dev),
            positions=positions.to(dev), req_pool_indices=t(rows), seq_lens=t(seq_lens), prefix_lens=t(prefix_lens),
            extend_lens=t(extend_lens), out_cache_loc=t(out_slots), req_to_token_pool=twin.table,
            kv_pool=twin.kv_pool, attn_backend=twin.backend, seq_lens_cpu=seq_lens,
            prefix_lens_cpu=list(prefix_lens), extend_lens_cpu=list(extend_lens),
            tree_mask=None if blocks is None else torch.tensor(
                [x for block in blocks for row in block for x in row], dtype=torch.bool, device=dev),
            tree_mask_cpu=None if blocks is None else [[list(row) for row in block] for block in blocks],
        )

    def _fused_rotary(self):
        """The rotary to pass through `forward_decode_rotary`, or None when the backend does not
        declare `fuses_rotary_with_kv_store` (or is not a standard-attention scenario)."""
        if not (getattr(self.test.backend, "fuses_rotary_with_kv_store", False)
                and type(self)._run_test is _Scenario._run_test):
            return None
        from radixserve.layers.rotary import RotaryEmbedding

        d = self.heads[2]
        rotary_dim = d // 2 if d % 4 == 0 else d  # partial rotary where the halves stay even
        return RotaryEmbedding(d, rotary_dim, self.context, {"rope_type": "default", "rope_theta": 10000.0})

    def _qk_norm(self, dtype: torch.dtype):
        """A fusable QKNorm with random weights of the given dtype (the scenario's head size)."""
        from radixserve.layers.attention import QKNorm
        from radixserve.layers.norm import RMSNorm

        d = self.heads[2]
        gen = torch.Generator().manual_seed(self.seed)
        norms = [RMSNorm(d, 1e-6, params_dtype=dtype).to(self.device) for _ in range(2)]
        for m in norms:
            m.weight.data.copy_(1 + 0.3 * torch.randn(d, generator=gen))
        return QKNorm(*norms, d)

    def _assert_pools_equal(self, message: str, loose_slots: Sequence[int] | None = None) -> None:
        """Both twins' pools equal: exactly, except `loose_slots`, compared up to the tolerance and then
        copied from the backend's pool into the reference's."""
        for layer_id in range(_NUM_LAYERS):
            for a, b in zip(self._pool_tensors(self.test, layer_id), self._pool_tensors(self.ref, layer_id), strict=True):
                if loose_slots is not None and layer_id == _LAYER_ID:
                    loose = torch.tensor(list(loose_slots), dtype=torch.int64, device=a.device)
                    err = _rel_err(a[loose], b[loose])
                    if err >= self.tol:
                        raise AssertionError(f"{message}; layer {layer_id}, new slots: relative error {err:.2e}")
                    b[loose] = a[loose]  # the reference goes on from the backend's rounding: later checks are exact
                if not torch.equal(a, b):
                    bad = (a != b).flatten(1).any(1).nonzero().flatten().tolist()
                    raise AssertionError(f"{message}; layer {layer_id}, slots {bad[:10]}")

    def run(self, num_requests: int, decode_steps: int) -> None:
        rng = self.rng
        for _ in range(num_requests):
            donors = [j for j, r in enumerate(self.reqs) if r.shares is None and len(r.slots) > 1]
            if donors and rng.random() < 0.4:  # a prefix-cache hit on another request's prefix
                j = rng.choice(donors)
                self.add_request(rng.randint(1, len(self.reqs[j].slots)), rng.randint(1, _MAX_PROMPT), share_from=j)
            else:
                self.add_request(rng.choice([0, rng.randint(1, _MAX_PREFIX)]), rng.randint(1, _MAX_PROMPT),
                                 share_from=None)
        chunk = rng.randint(3, 8)
        while any(r.prompt_left for r in self.reqs):
            # prefill chunks, mixed with requests that add one token (already prefilled, or by chance)
            picks = [(i, min(chunk, r.prompt_left) if r.prompt_left else 1) for i, r in enumerate(self.reqs)
                     if r.prompt_left or rng.random() < 0.5]
            rng.shuffle(picks)
            self.step(ForwardMode.EXTEND, picks)
        for _ in range(decode_steps):
            chosen = rng.sample(range(len(self.reqs)), rng.randint(1, len(self.reqs)))
            self.step(ForwardMode.DECODE, [(i, 1) for i in chosen])

    def run_decode_rows(self, steps: int) -> None:
        """Chain verifies as DECODE batches whose rows share requests (1 to 5 rows per request), as the
        runner gives a backend that sets `decode_rows_share_requests` (speculative decoding, any device)."""
        rng = self.rng
        for _ in range(steps):
            chosen = rng.sample(range(len(self.reqs)), rng.randint(1, len(self.reqs)))
            self.step(ForwardMode.DECODE, [(i, rng.randint(1, _MAX_DECODE_ROWS)) for i in chosen], decode_rows=True)

    def run_trees(self, steps: int) -> None:
        """Speculative verify forwards after `run`: random draft trees (and single tokens) for
        random subsets of the requests, then chains as trees checked against causal extend."""
        rng = self.rng
        as_rows = bool(getattr(self.test.backend, "decode_rows_share_requests", False))
        for n in range(steps):
            chosen = rng.sample(range(len(self.reqs)), rng.randint(1, len(self.reqs)))
            trees = [_random_tree(rng, rng.choice([1, rng.randint(2, 6), rng.randint(7, _MAX_TREE)])) for _ in chosen]
            self.step(ForwardMode.EXTEND, [(i, len(t)) for i, t in zip(chosen, trees)], trees=trees,
                      same_as_tree_rows=as_rows and n == 0)
        chosen = rng.sample(range(len(self.reqs)), rng.randint(1, len(self.reqs)))
        chains = [list(range(-1, rng.randint(1, _MAX_CHAIN) - 1)) for _ in chosen]
        self.step(ForwardMode.EXTEND, [(i, len(c)) for i, c in zip(chosen, chains)], trees=chains, same_as_causal=True)

    def run_long(self, positions: Sequence[int], decode_steps: int, tree_steps: int) -> None:
        """Sequences past `positions` (kernels' tile sizes): per position a request whose cached prefix
        ends just before it and whose prompt crosses it, beside a fresh prompt past the smallest, all
        in one EXTEND batch; then DECODE steps of every request (at least one), and with trees one
        verify (`run_trees(1)`)."""
        rng = self.rng
        self.note = f"long scenario past key positions {list(positions)}, "
        for p in positions:
            self.add_request(max(0, p - rng.randint(1, 3)), rng.randint(4, 9), share_from=None)
        self.add_request(0, min(positions) + rng.randint(1, 8), share_from=None)
        picks = [(i, r.prompt_left) for i, r in enumerate(self.reqs)]
        rng.shuffle(picks)
        self.step(ForwardMode.EXTEND, picks)
        for _ in range(max(1, decode_steps)):
            order = rng.sample(range(len(self.reqs)), len(self.reqs))
            self.step(ForwardMode.DECODE, [(i, 1) for i in order])
        if tree_steps and getattr(self.test.backend, "supports_tree_mask", False):
            self.run_trees(1)


def _fused_views(*parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of `parts` (same leading dims) as slices of one buffer along the last dim, the way a
    fused projection's output is split: the last-dim stride is 1, the others are the fused buffer's."""
    return torch.cat(parts, dim=-1).split([p.shape[-1] for p in parts], dim=-1)


def _scenario_sizes(num_requests: int, tokens_per_request: int) -> dict[str, int]:
    """Pool sizes (`_Scenario`'s rows, context, num_slots) for `num_requests` requests of at most
    `tokens_per_request` tokens each: the defaults unless more are needed. Rows to spare stay free
    (scratch rows of tree verifies, the padding row of the extend-graph check)."""
    return {"rows": max(_ROWS, num_requests + 8), "context": max(_CONTEXT, tokens_per_request),
            "num_slots": max(_SLOTS, num_requests * tokens_per_request)}


def _long_scenario_sizes(positions: Sequence[int], decode_steps: int, tree_steps: int) -> dict[str, int]:
    """`_scenario_sizes` for `run_long`: a request per position and the fresh prompt."""
    per_request = max(positions) + 9 + max(1, decode_steps) + (_MAX_TREE + _MAX_CHAIN if tree_steps else 0)
    return _scenario_sizes(len(positions) + 1, per_request)


def _check_long_positions(positions: Sequence[int]) -> None:
    if any(not isinstance(p, int) or p < 1 for p in positions):
        raise ValueError(f"long_positions={tuple(positions)!r}: positive integers (or () for no long scenario)")


def _check_step_counts(**counts: int) -> None:
    """ValueError naming an argument out of range: `num_requests` at least 1, the others at least 0."""
    for name, n in counts.items():
        low = 1 if name == "num_requests" else 0
        if not isinstance(n, int) or n < low:
            raise ValueError(f"{name}={n!r}: an integer >= {low}")


def _random_tree(rng: random.Random, n: int) -> list[int]:
    """Parents of n new tokens: token 0 is the root (the last verified token), every other token
    hangs below an earlier one (bushy or deep at random)."""
    bushy = rng.random() < 0.5
    return [-1] + [rng.randrange(j) if bushy else rng.randint(max(0, j - 2), j - 1) for j in range(1, n)]


def _where_worst(got: torch.Tensor, want: torch.Tensor, num_heads: int, first_position: int) -> str:
    """Where one request's output differs most from exact attention: its new token (and that token's
    position), its query head and the two values, so a kernel author knows which tile to look at."""
    diff = (got.double() - want.double()).abs().reshape(got.shape[0], num_heads, -1)
    flat = int(diff.argmax())
    token, rest = divmod(flat, diff.shape[1] * diff.shape[2])
    head, col = divmod(rest, diff.shape[2])
    g = got.reshape(diff.shape)[token, head, col].item()
    w = want.reshape(diff.shape)[token, head, col].item()
    return (f"largest difference at new token {token} (position {first_position + token}), query head {head}, "
            f"column {col}: got {g:.4g}, exact {w:.4g}")


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.double() - want.double()).norm().item()
    return diff / max(want.double().norm().item(), 1e-12)


@single_threaded
def check_attention_backend(
    backend: Callable[[AttentionRunnerInfo], AttentionBackend],
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    heads: Sequence[tuple[int, int, int]] = DEFAULT_HEADS,
    seeds: Sequence[int] = (0, 1),
    num_requests: int = 4,
    decode_steps: int = 3,
    tree_steps: int = 3,
    decode_row_steps: int = 2,
    tolerance: float | None = None,
    layer_options: Sequence[tuple[int, float]] = ((6, 1.5), (1, 0.7)),
    kv_dtype: torch.dtype | None = None,
    matmul_precision: str = "highest",
    progress: Callable[[str], None] | None = None,
    long_positions: Sequence[int] = DEFAULT_LONG_POSITIONS,
) -> None:
    """Run `backend` against exact attention; raise AssertionError naming the first difference.

    :param backend: the backend class (constructed as `backend(runner_info)`, as the runner does,
        and asked `supports(device, dtype, head_dim)` first: unsupported head shapes are skipped,
        but at least one must be supported), or any callable taking an `AttentionRunnerInfo`.
    :param device, dtype: where and in which dtype the pools and activations live.
    :param heads: (query heads, KV heads, head_dim) triples; the defaults cover GQA, MQA and MHA.
    :param seeds: one random scenario per seed and head shape.
    :param num_requests: requests per scenario (any number >= 1; the pools grow to fit): their cached
        prefixes (0 to 70 tokens, some shared) and prompts (1 to 20 tokens, prefilled in chunks of 3 to
        8) are drawn at random.
    :param decode_steps: DECODE batches per scenario after the prefills, each over a random subset of
        the requests in random order (>= 0).
    :param tree_steps: speculative verify forwards with random draft trees per scenario (then one
        with chains as trees), run when the backend sets `supports_tree_mask = True`.
    :param decode_row_steps: chain verifies as DECODE batches whose rows share requests (every row
        must be stored before any row reads the pool), run when the backend sets
        `decode_rows_share_requests = True`. Added in plugin API 1.17 (before, only the latent kit ran them).
    :param tolerance: the largest relative error (norm of the difference over the norm of the
        exact result) per request and step; default by dtype (fp32 1e-3, fp16 5e-3, bf16 2e-2).
    :param layer_options: (sliding_window, logit_cap) pairs: for a backend with
        `supports_sliding_window` / `supports_logit_cap` one more scenario per pair and head shape
        runs (trees included) with the layer windowed and soft-capped (each where supported). The
        windows are shorter than the scenarios' sequences, so a backend that ignores them fails.
        Added in plugin API 1.3.
    :param kv_dtype: the KV pools' dtype when it is not `dtype`: `torch.bfloat16` under an fp32 model
        (`runtime.kv_cache_dtype: bfloat16`) for a backend with `supports_bf16_kv_cache`. The reference
        attends the values as stored (rounded), so the tolerance stays `dtype`'s. Added in plugin API 1.8.
    :param matmul_precision: the runner info's `matmul_precision` ("highest" or "medium": what the
        runner gives under `runtime.cpu_matmul_precision`). With "medium" a backend may round its
        product inputs to bf16, so the default tolerance is `MEDIUM_PRECISION_TOLERANCE`; everything
        else (pools, chains equal to causal extends) is checked as with "highest". Added in plugin API 1.9.
    :param progress: called with one line as each scenario and its trees start (what runs, seconds since the
        call began), e.g. `print`: where a slow backend (kernels compiling per shape) spends the run. Added in
        plugin API 1.11.
    :param long_positions: key positions one more scenario's sequences cross (common kernel tile sizes;
        the others stay under about 100 tokens), on the first supported head shape and seed only: per
        position a request whose cached prefix ends 1 to 3 tokens before it and whose prompt (4 to 9
        tokens, one extend) crosses it, beside a fresh prompt past the smallest position, all in one
        EXTEND batch; then `decode_steps` DECODE batches of every request (at least one) and, with
        `supports_tree_mask`, one tree verify. `()` skips it. Added in plugin API 1.13.

    q, k and v reach the backend as the runner passes them: column slices of one fused qkv buffer
    (`[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]`), so their rows are not contiguous;
    the last dim's stride is 1 (docs/contracts.md, section 3).

    A backend whose `supports_extend_cuda_graph()` is True also runs every EXTEND step (trees aside)
    through its extend-graph hooks on the batch the runner would give them (padded, see
    `AttentionBackend.init_extend_metadata_capture`); the real rows must equal the plain step's and
    only slot 0 may take the padding's KV. Added in plugin API 1.10.
    """
    problem = attention_class_problem(backend) if isinstance(backend, type) else None
    assert problem is None, problem  # the runner's own check (it refuses such a class before loading)
    if matmul_precision not in ("highest", "medium"):
        raise ValueError(f"matmul_precision={matmul_precision!r}: 'highest' or 'medium'")
    _check_step_counts(num_requests=num_requests, decode_steps=decode_steps, tree_steps=tree_steps,
                       decode_row_steps=decode_row_steps)
    _check_long_positions(long_positions)
    per_request = (_MAX_PREFIX + _MAX_PROMPT + decode_steps + tree_steps * _MAX_TREE + _MAX_CHAIN
                   + _MAX_DECODE_ROWS * decode_row_steps)
    sizes = _scenario_sizes(num_requests, per_request)
    default_tol = DEFAULT_TOLERANCE[dtype]
    if matmul_precision == "medium":
        default_tol = max(default_tol, MEDIUM_PRECISION_TOLERANCE)
    tol = tolerance if tolerance is not None else default_tol
    if kv_dtype not in (None, dtype):
        if kv_dtype != torch.bfloat16:
            raise ValueError(f"kv_dtype={kv_dtype}: the kit checks bf16 pools (fp8 pools: tests of their own)")
        if not getattr(backend, "supports_bf16_kv_cache", True):  # a class that does not declare it
            raise ValueError(f"{backend!r} does not declare supports_bf16_kv_cache; the runner never gives it a bf16 pool")
    dtype_name = str(dtype).removeprefix("torch.")
    checked = 0
    supported = []  # head shapes the backend takes
    began = time.perf_counter()

    def say(what: str) -> None:
        if progress is not None:
            progress(f"check_attention_backend {dtype_name} {what} ({time.perf_counter() - began:.1f} s)")

    for shape in heads:
        hq, hkv, d = shape
        if hq % hkv:
            raise ValueError(f"heads {shape}: query heads must be a multiple of KV heads")
        if isinstance(backend, type) and not backend.supports(torch.device(device).type, dtype_name, d):
            continue
        supported.append(shape)
        for seed in seeds:
            scenario = _Scenario(backend, shape, dtype, device, seed, tol, kv_dtype=kv_dtype,
                                 matmul_precision=matmul_precision, **sizes)
            say(f"heads {shape} seed {seed}")
            scenario.run(num_requests, decode_steps)
            if tree_steps and getattr(scenario.test.backend, "supports_tree_mask", False):
                say(f"heads {shape} seed {seed}: trees")
                scenario.run_trees(tree_steps)
            if decode_row_steps and getattr(scenario.test.backend, "decode_rows_share_requests", False):
                say(f"heads {shape} seed {seed}: decode rows sharing requests")
                scenario.run_decode_rows(decode_row_steps)
            checked += 1
        for i, (window, cap) in enumerate(layer_options):
            scenario = _Scenario(backend, shape, dtype, device, seeds[0] + 100 + i, tol, kv_dtype=kv_dtype,
                                 matmul_precision=matmul_precision, **sizes)
            test = scenario.test.backend
            scenario.layer.sliding_window = window if getattr(test, "supports_sliding_window", False) else None
            scenario.layer.logit_cap = cap if getattr(test, "supports_logit_cap", False) else None
            if scenario.layer.sliding_window is None and scenario.layer.logit_cap is None:
                break
            what = f"heads {shape} window {scenario.layer.sliding_window} cap {scenario.layer.logit_cap}"
            say(what)
            scenario.run(num_requests, decode_steps)
            if tree_steps and getattr(test, "supports_tree_mask", False):
                say(f"{what}: trees")
                scenario.run_trees(tree_steps)
    if long_positions and supported:  # one shape and seed: slow kernels (triton's interpreter) pay it once
        scenario = _Scenario(backend, supported[0], dtype, device, seeds[0], tol, kv_dtype=kv_dtype,
                             matmul_precision=matmul_precision,
                             **_long_scenario_sizes(long_positions, decode_steps, tree_steps))
        say(f"heads {supported[0]} seed {seeds[0]}: past key positions {list(long_positions)}")
        scenario.run_long(long_positions, decode_steps, tree_steps)
    say("done")
    if not checked:
        raise AssertionError(f"{backend!r}.supports() refused every head shape in {list(heads)} on {device}/{dtype_name}")
