"""CUDA graphs of the EAGLE draft's small steps, so a propose at batch 1 costs a few graph
launches instead of ~40 kernel launches per draft step.

Two computations are captured, each on first use per shape bucket (the draft KV pool is the
drafter's own; the target's graphs are not involved):

- `ChainGraph` (batch bucket B, KV width bucket W, steps): the `steps - 1` chain steps after the
  root, for up to B requests at once. Static inputs: each request's cached draft keys / values
  padded to W columns, its cached length, root position, root output and first draft token.
- `PendingGraph` (row bucket R, KV width bucket W): the request's newly verified rows (one
  request, at most R rows) run into the draft; outputs the rows' keys / values (copied into the
  pool after the replay) and the last row's output and draft log-probabilities.
- `TreeGraph` (KV width bucket W, topk, steps): one request's tree expansion (EAGLE-2's dynamic
  tree) kept on the device: every level's top-k children, the frontier of the k best cumulative
  scores, the ancestors mask of the scratch rows; outputs every node's token, cumulative score
  and parent for one host copy (the host keeps the best `num_draft_tokens`).

Padding: padded requests have cached length 0, position 0, token 0 and a zero feature; padded
verified rows come after the real ones. Every row attends only to columns up to its own (a
boolean mask built inside the graph from the static lengths), so neither padding nor stale
columns beyond a request's length reach a real row. Shapes past the largest bucket run eagerly; at
most MAX_GRAPHS graphs are kept (least recently used dropped).

The graphs read the pool only through the static buffers (filled before each replay), so the pool
may grow (new tensors) without invalidating them. Filling is incremental: each static buffer row
remembers whose cached rows it holds (the caller's `owner`, e.g. the request's draft state, held
weakly) and how many, so a request drafting step after step copies only its newly verified rows
instead of its whole draft KV each propose (a request's cached rows never change while it lives;
a new owner or none reloads everything).

Batch-1 chain graphs and one-row pending graphs keep their static keys / values repeated to every
query head ([1, W, H, d] / [W, H, d] when `num_heads` is given): the chain's attention is then one query row per head over its own
keys, the SDPA form measured fastest on the H200 (~10 us a step at W = 1280, against ~29 us for
the query heads grouped per KV head, which leaves H / KV times fewer thread blocks), and the
repeat is paid once per cached row (incremental fill) instead of once per step.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from radixserve.cuda_graph_runner import CudaGraph, EagerGraph

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
ROW_BUCKETS = (1, 2, 4, 8, 16)
WIDTH_STEP = 256  # KV widths are captured in multiples of this
MAX_WIDTH = 8192
MAX_KV_ROWS = 32768  # B * W of one chain graph's static keys (memory bound)
MAX_GRAPHS = 64


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= n, or None when n exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def padded_width(n: int, step: int = WIDTH_STEP) -> int:
    """`n` KV columns rounded up to a multiple of `step` (at least one step)."""
    return max(step, -(-n // step) * step)


def width_bucket(n: int, step: int = WIDTH_STEP, limit: int = MAX_WIDTH) -> int | None:
    """`n` KV columns rounded up to a multiple of `step`, or None above `limit`."""
    w = padded_width(n, step)
    return w if w <= limit else None


def chain_key(lens: list[int], steps: int) -> tuple[int, int, int] | None:
    """(B, W, steps) of the chain graph for requests with `lens` cached draft rows, or None when
    it would be too large (then the chain runs eagerly)."""
    b = bucket(len(lens), BATCH_BUCKETS)
    w = width_bucket(max(lens) + steps)
    if b is None or w is None or b * w > MAX_KV_ROWS:
        return None
    return b, w, steps


def pending_key(cached: int, rows: int) -> tuple[int, int] | None:
    """(R, W) of the pending-rows graph for a request with `cached` draft rows and `rows` new
    ones, or None (eager)."""
    r = bucket(rows, ROW_BUCKETS)
    if r is None:
        return None
    w = width_bucket(cached + r)
    return None if w is None else (r, w)


@dataclass
class ChainInputs:
    keys: list[torch.Tensor]  # per layer [B, W, KV, d]; [1, W, H, d] (repeated per query head) at B = 1
    values: list[torch.Tensor]
    lens: torch.Tensor  # [B] cached rows per request
    root_pos: torch.Tensor  # [B]
    root_out: torch.Tensor  # [B, H]
    tok: torch.Tensor  # [B] first draft token (target ids)
    loaded: list = field(default_factory=list)  # per request row: reusable_rows' record


@dataclass
class PendingInputs:
    keys: list[torch.Tensor]  # per layer [W, KV, d] ([W, H, d] per query head at R = 1): cached rows, then new
    values: list[torch.Tensor]
    cached: torch.Tensor  # [1] the request's cached rows
    last: torch.Tensor  # [1] index of the last real new row
    ids: torch.Tensor  # [R] tokens (target ids)
    pos: torch.Tensor  # [R]
    feats: torch.Tensor  # [R, F]
    loaded: list = field(default_factory=lambda: [None])


def reusable_rows(loaded: tuple | None, owner: object | None, n: int) -> int:
    """How many leading rows of a static buffer row already hold `owner`'s first `n` cached rows
    (`loaded`: that row's (weak owner, count) record, or None)."""
    if owner is None or loaded is None:
        return 0
    ref, count = loaded
    return count if ref() is owner and count <= n else 0


def grouped_view(buf: torch.Tensor, kv: int) -> torch.Tensor:
    """A static key / value buffer [..., H, d] viewed as [..., KV, H / KV, d] (query head h is KV
    head h // (H / KV)); [..., KV, 1, d] when it holds KV heads. KV rows `x` [..., KV, d] are
    stored with `grouped_view(buf, KV)[...] = x.unsqueeze(-2)`: one broadcasting write, no
    repeated copy (capture safe)."""
    *lead, heads, d = buf.shape
    return buf.view(*lead, kv, heads // kv, d)


def per_kv_head(x: torch.Tensor, kv: int) -> torch.Tensor:
    """Rows [..., H, d] stored per query head (see `grouped_view`) -> [..., KV, d]
    (a view: each group's first head)."""
    heads = x.shape[-2]
    return x if heads == kv else x[..., :: heads // kv, :]


def loaded_record(owner: object | None, n: int) -> tuple | None:
    return None if owner is None else (weakref.ref(owner), n)


def tree_key(cached: int, topk: int, steps: int, vocab: int) -> tuple[int, int, int, int] | None:
    """(W, topk, steps, draft vocab) of the tree graph for a request with `cached` draft rows (the
    tree's scratch rows have their own buffer), or None (eager)."""
    w = width_bucket(cached)
    return None if w is None else (w, topk, steps, vocab)


@dataclass
class TreeInputs:
    keys: list[torch.Tensor]  # per layer [W, KV, d]: the request's cached rows
    values: list[torch.Tensor]
    scratch_k: list[torch.Tensor]  # per layer [topk * (steps - 1), KV, d]: the tree levels' rows
    scratch_v: list[torch.Tensor]
    cached: torch.Tensor  # [1]
    root_pos: torch.Tensor  # [1]
    root_out: torch.Tensor  # [1, H]
    root_lp: torch.Tensor  # [V] fp32
    loaded: list = field(default_factory=lambda: [None])


class DraftGraphs:
    """The drafter's captured graphs. `chain_fn(inputs, steps) -> tokens [B, steps]` and
    `pending_fn(inputs) -> (last row's output [1, H], its log-probs [V])` are the drafter's
    computations over static inputs; this class owns the buffers, the buckets and the graphs.

    `graph_factory` defaults to CUDA graphs on a CUDA device and to `EagerGraph` elsewhere (CPU
    tests exercise the same bookkeeping)."""

    def __init__(self, num_layers: int, kv_shape: tuple[int, int], hidden_size: int, dtype: torch.dtype,
                 device: torch.device, chain_fn: Callable, pending_fn: Callable,
                 graph_factory: Callable[[], EagerGraph | CudaGraph] | None = None,
                 tree_fn: Callable | None = None, num_heads: int | None = None) -> None:
        self.num_layers, self.kv_shape, self.hidden_size = num_layers, kv_shape, hidden_size
        self.num_heads = num_heads  # set: batch-1 chain graphs keep keys repeated per query head
        self.dtype, self.device = dtype, torch.device(device)
        self.chain_fn, self.pending_fn, self.tree_fn = chain_fn, pending_fn, tree_fn
        self.trees: dict[tuple, tuple[EagerGraph | CudaGraph, TreeInputs]] = {}
        cuda = self.device.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if cuda else None
        self.graph_factory = graph_factory or ((lambda: CudaGraph(self._pool)) if cuda else EagerGraph)
        self.chains: dict[tuple, tuple[EagerGraph | CudaGraph, ChainInputs]] = {}
        self.pendings: dict[tuple, tuple[EagerGraph | CudaGraph, PendingInputs]] = {}
        self.replays = 0  # graph replays so far (tests, benchmarks)
        self.failure: str | None = None  # the failed capture's key and error (benchmarks report it)

    @property
    def failed(self) -> bool:
        """A capture failed: everything runs eagerly from then on."""
        return self.failure is not None

    def _get(self, graphs: dict, key: tuple, capture: Callable):
        """The graph of `key` (captured now when missing), most recently used last; at MAX_GRAPHS
        the least recently used graph of the same kind (else of the other) is dropped first. None
        once a capture has failed (logged; the draft then runs eagerly)."""
        if self.failed:
            return None
        if key in graphs:
            graphs[key] = graphs.pop(key)
            return graphs[key]
        while len(self.chains) + len(self.pendings) + len(self.trees) >= MAX_GRAPHS:
            victims = graphs if graphs else next(g for g in (self.chains, self.pendings, self.trees) if g)
            victims.pop(next(iter(victims)))
        try:
            graphs[key] = capture(*key)
        except Exception as e:  # keep drafting, eagerly, but loudly (with the traceback: where it failed)
            logger.exception("capturing an EAGLE draft CUDA graph %s failed; the draft runs eagerly", key)
            self.failure = f"{key}: {e!r}"
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return None
        return graphs[key]

    def _kv(self, *lead: int, heads: int | None = None) -> list[torch.Tensor]:
        shape = (heads or self.kv_shape[0], self.kv_shape[1])
        return [torch.zeros(*lead, *shape, dtype=self.dtype, device=self.device)
                for _ in range(self.num_layers)]

    # ---- chains ---------------------------------------------------------------------------------
    def chain(self, pool_k: list[torch.Tensor], pool_v: list[torch.Tensor], slots: list[torch.Tensor],
              root_pos: list[int], root_out: torch.Tensor, tok: torch.Tensor, steps: int,
              owners: list | None = None) -> torch.Tensor | None:
        """Draft tokens [b, steps] for b requests (their cached `slots`, root positions, root
        outputs [b, H] and first tokens [b]) through the graph of their bucket; None when the
        shape has no graph (the caller runs eagerly). `owners`: one object per request whose
        cached rows stay put while it lives (module docstring); None copies every row."""
        b = len(slots)
        key = chain_key([len(s) for s in slots], steps)
        if key is None:
            return None
        got = self._get(self.chains, key, self._capture_chain)
        if got is None:
            return None
        graph, inp = got
        if not inp.loaded:
            inp.loaded.extend([None] * inp.lens.shape[0])
        for i, s in enumerate(slots):
            owner, n = owners[i] if owners else None, len(s)
            start = reusable_rows(inp.loaded[i], owner, n)
            if start < n:
                idx = s[start:]
                kv = self.kv_shape[0]
                for layer in range(self.num_layers):
                    grouped_view(inp.keys[layer], kv)[i, start:n] = pool_k[layer][idx].unsqueeze(-2)
                    grouped_view(inp.values[layer], kv)[i, start:n] = pool_v[layer][idx].unsqueeze(-2)
            inp.loaded[i] = loaded_record(owner, n)
        inp.loaded[b:] = [None] * (len(inp.loaded) - b)  # padded rows get the chain's scratch rows
        for t in (inp.lens, inp.root_pos, inp.root_out, inp.tok):  # padded requests: harmless zeros
            t[b:].zero_()
        inp.lens[:b].copy_(torch.tensor([len(s) for s in slots], dtype=torch.int64), non_blocking=True)
        inp.root_pos[:b].copy_(torch.tensor(root_pos, dtype=torch.int64), non_blocking=True)
        inp.root_out[:b].copy_(root_out)
        inp.tok[:b].copy_(tok)
        self.replays += 1
        return graph.replay()[:b]

    def _capture_chain(self, bs: int, width: int, steps: int):
        heads = self.num_heads if bs == 1 else None
        inp = ChainInputs(
            self._kv(bs, width, heads=heads), self._kv(bs, width, heads=heads),
            torch.zeros(bs, dtype=torch.int64, device=self.device), torch.zeros(bs, dtype=torch.int64, device=self.device),
            torch.zeros(bs, self.hidden_size, dtype=self.dtype, device=self.device),
            torch.zeros(bs, dtype=torch.int64, device=self.device),
        )
        graph = self.graph_factory()
        with torch.inference_mode():
            graph.capture(lambda: self.chain_fn(inp, steps))
        return graph, inp

    # ---- verified rows --------------------------------------------------------------------------
    def pending(self, pool_k: list[torch.Tensor], pool_v: list[torch.Tensor], cached: torch.Tensor,
                new: torch.Tensor, ids: list[int], pos: list[int], feats: torch.Tensor, owner: object | None = None):
        """Run one request's `len(ids)` new rows (features `feats` [r, F]) after its `cached`
        slots; writes their keys / values into the pool at slots `new` and returns (the last
        row's output [1, H], its draft log-probs [V]) as fresh tensors; None when the shape has
        no graph. `owner`: as `chain`'s."""
        n, r = len(cached), len(ids)
        key = pending_key(n, r)
        if key is None:
            return None
        key = (*key, feats.shape[1])
        got = self._get(self.pendings, key, self._capture_pending)
        if got is None:
            return None
        graph, inp = got
        self._load_cached(inp, pool_k, pool_v, cached, owner)
        inp.last.fill_(r - 1)
        for t in (inp.ids, inp.pos, inp.feats):  # padded rows: harmless zeros
            t[r:].zero_()
        inp.ids[:r].copy_(torch.tensor(ids, dtype=torch.int64), non_blocking=True)
        inp.pos[:r].copy_(torch.tensor(pos, dtype=torch.int64), non_blocking=True)
        inp.feats[:r].copy_(feats)
        self.replays += 1
        out, lp = graph.replay()
        kv = self.kv_shape[0]
        for layer in range(self.num_layers):
            pool_k[layer][new] = per_kv_head(inp.keys[layer][n : n + r], kv)
            pool_v[layer][new] = per_kv_head(inp.values[layer][n : n + r], kv)
        inp.loaded[0] = loaded_record(owner, n + r)  # the new rows are the buffer's rows n .. n + r - 1
        return out.clone(), lp.clone()

    def _load_cached(self, inp, pool_k: list[torch.Tensor], pool_v: list[torch.Tensor], cached: torch.Tensor,
                     owner: object | None = None) -> None:
        """Copy a request's cached draft KV rows (pool slots `cached`) into a graph's static key /
        value buffers (only those not there yet for `owner`) and set its cached-row count."""
        n = len(cached)
        start = reusable_rows(inp.loaded[0], owner, n)
        if start < n:
            idx = cached[start:]
            kv = self.kv_shape[0]
            for layer in range(self.num_layers):
                grouped_view(inp.keys[layer], kv)[start:n] = pool_k[layer][idx].unsqueeze(-2)
                grouped_view(inp.values[layer], kv)[start:n] = pool_v[layer][idx].unsqueeze(-2)
        inp.loaded[0] = loaded_record(owner, n)
        inp.cached.fill_(n)

    def _capture_pending(self, rows: int, width: int, feat_width: int):
        z = torch.zeros
        heads = self.num_heads if rows == 1 else None
        inp = PendingInputs(
            self._kv(width, heads=heads), self._kv(width, heads=heads),
            z(1, dtype=torch.int64, device=self.device), z(1, dtype=torch.int64, device=self.device),
            z(rows, dtype=torch.int64, device=self.device), z(rows, dtype=torch.int64, device=self.device),
            z(rows, feat_width, dtype=self.dtype, device=self.device),
        )
        graph = self.graph_factory()
        with torch.inference_mode():
            graph.capture(lambda: self.pending_fn(inp))
        return graph, inp

    # ---- trees ----------------------------------------------------------------------------------
    def tree(self, pool_k: list[torch.Tensor], pool_v: list[torch.Tensor], cached: torch.Tensor, root_pos: int,
             root_out: torch.Tensor, root_lp: torch.Tensor, topk: int, steps: int, owner: object | None = None):
        """One request's tree from its root (position, output [1, H], log-probs [V]): (tokens,
        cumulative scores, parents) of every node as lists, nodes numbered level by level (the
        root's children first); None when the shape has no graph. `owner`: as `chain`'s."""
        n = len(cached)
        key = tree_key(n, topk, steps, root_lp.shape[0])
        if key is None or self.tree_fn is None:
            return None
        got = self._get(self.trees, key, self._capture_tree)
        if got is None:
            return None
        graph, inp = got
        self._load_cached(inp, pool_k, pool_v, cached, owner)
        inp.root_pos.fill_(root_pos)
        inp.root_out.copy_(root_out)
        inp.root_lp.copy_(root_lp)
        self.replays += 1
        tokens, scores, parents = graph.replay()
        return tokens.tolist(), scores.tolist(), parents.tolist()

    def _capture_tree(self, width: int, topk: int, steps: int, vocab: int):
        z, dev = torch.zeros, self.device
        scratch = topk * max(1, steps - 1)
        inp = TreeInputs(
            self._kv(width), self._kv(width), self._kv(scratch), self._kv(scratch),
            z(1, dtype=torch.int64, device=dev), z(1, dtype=torch.int64, device=dev),
            z(1, self.hidden_size, dtype=self.dtype, device=dev), z(vocab, dtype=torch.float32, device=dev),
        )
        graph = self.graph_factory()
        with torch.inference_mode():
            graph.capture(lambda: self.tree_fn(inp, topk, steps))
        return graph, inp
