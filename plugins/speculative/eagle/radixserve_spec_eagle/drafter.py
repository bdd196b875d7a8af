"""EagleDrafter: drafts with an EAGLE-2 / EAGLE-3 head fed the target's hidden states.

Sequence bookkeeping: the draft row at position p reads (token p + 1, the target's feature at p)
and predicts token p + 2, so once the target has verified tokens 0..L-1 (and computed features for
0..L-2) the row at L-2 predicts the first draft token. `on_accepted` collects the new features
(`DrafterInfo.target_states.take`); `propose` runs the pending rows into the draft's KV pool (kept
for the request's life) and then expands a tree from the last row: top-k children per frontier
node, a frontier of the k best by cumulative draft log-probability, `num_steps` levels, and keeps
the best `num_draft_tokens` nodes (EAGLE-2's dynamic tree; topk 1 gives a chain). The tree rows'
KV is scratch: dropped after `propose`, the verified path comes back as features later.

On CUDA the verified rows (up to 16 per request), the chain steps and the tree levels replay CUDA
graphs of the same computations (graphs.py; the tree's levels then stay on the device until one
host copy); `cuda_graph=False` (option) keeps everything eager."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from radixserve.interfaces.drafter import DrafterInfo, DraftProposal
from radixserve.interfaces.target_states import HiddenRows
from radixserve.layers.gemv_selection import MODES as GEMV_MODES
from radixserve.layers.rotary import reserve_rotary_caches
from radixserve.scheduler.speculative.draft_state import DraftRequestState, PooledDrafter

from radixserve_spec_eagle.checkpoint import KEY, default_aux_layers, load_checkpoint
from radixserve_spec_eagle.graphs import (
    ChainInputs,
    DraftGraphs,
    PendingInputs,
    TreeInputs,
    grouped_view,
    padded_width,
)
from radixserve_spec_eagle.head import EagleHead
from radixserve_spec_eagle.kv_pool import DraftKVPool

logger = logging.getLogger(__name__)


def best_nodes(scores: list[float], parents: list[int], limit: int) -> list[int]:
    """Up to `limit` node indices with the highest scores whose parent (-1: the root) is kept too,
    in index order (parents were created before their children)."""
    kept: set[int] = set()
    while len(kept) < limit:  # cumulative log-probs never rise along a path: one round in practice
        open_ = [i for i in range(len(scores)) if i not in kept and (parents[i] == -1 or parents[i] in kept)]
        if not open_:
            break
        kept.add(max(open_, key=lambda i: (scores[i], -i)))
    return sorted(kept)


def gather_padded(rows: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
    """`rows[slots]` (slots: at least one) padded to `width` rows with copies of the first slot's
    row, in one gather; the caller masks the padding out."""
    n = slots.shape[0]
    if width > n:
        slots = torch.cat([slots, slots[:1].expand(width - n)])
    return rows[slots]


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention without repeating keys: q [r, H, d], keys / values [T, KV, d]
    (any strides; or [T, H, d], already repeated per query head), mask [r, T] (True: may attend)
    -> [r, H * d]. The H / KV query heads sharing
    a KV head become one block of r * H / KV query rows against that head's keys, so no [T, H, d]
    copy of the keys is made (those copies were most of the propose's copy kernels). Pure device
    ops (CUDA graph capture safe)."""
    r, h, d = q.shape
    kv = keys.shape[1]
    if kv == h:  # keys already repeated per query head (a batch-1 graph's static keys)
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                             values.transpose(0, 1).unsqueeze(0), attn_mask=mask)
        return out[0].transpose(0, 1).reshape(r, h * d)
    rep = h // kv
    qg = q.view(r, kv, rep, d).permute(1, 0, 2, 3).reshape(1, kv, r * rep, d)
    m = mask[:, None, :].expand(r, rep, mask.shape[1]).reshape(r * rep, mask.shape[1])
    out = F.scaled_dot_product_attention(qg, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
                                         attn_mask=m)
    return out[0].view(kv, r, rep, d).permute(1, 0, 2, 3).reshape(r, h * d)


class EagleDrafter(PooledDrafter):
    """Component "eagle" of kind "drafter" (radixserve-spec-eagle). The draft checkpoint is
    `speculative.draft_model_path`, the tree shape `speculative.topk`, `num_steps` and
    `num_draft_tokens`. Option `cuda_graph` (default: on when the device is CUDA): replay the draft
    steps from CUDA graphs (True on a CPU device runs the same bookkeeping without graphs). Option
    `batch1_gemv` ("auto" / "on" / "off"; default: the target's `runtime.batch1_gemv`): the draft's
    one-row matmuls on the batch-1 Triton GEMV (see head.py)."""

    graph_factory = None  # tests: a stand-in for torch.cuda.CUDAGraph (see DraftGraphs)

    def __init__(self, info: DrafterInfo, cuda_graph: bool | None = None, batch1_gemv: str | None = None) -> None:
        super().__init__(info)
        ts = info.target_states
        if ts is None:
            raise ValueError("stack.speculative=eagle needs the target's hidden states; this runner offers none")
        ckpt = load_checkpoint(info.draft_model_path)
        cfg = ckpt.config
        if "embed_tokens.weight" not in ckpt.tensors and cfg.hidden_size != ts.hidden_size:
            raise ValueError(f"{KEY}: the draft's hidden size {cfg.hidden_size} differs from the target's "
                             f"{ts.hidden_size} and the draft has no embedding of its own")
        if ckpt.version == 2:
            if cfg.hidden_size != ts.hidden_size:
                raise ValueError(f"{KEY}: an EAGLE-2 head of hidden size {cfg.hidden_size} cannot read the "
                                 f"target's {ts.hidden_size}-wide hidden states")
            ts.request(final=True)
        else:
            aux = default_aux_layers(cfg, ts.num_layers)
            fc_in = ckpt.tensors["fc.weight"].shape[1]
            if fc_in != len(aux) * ts.hidden_size:
                raise ValueError(f"{KEY}: the EAGLE-3 fc reads {fc_in} features, the target gives "
                                 f"{len(aux)} x {ts.hidden_size}")
            ts.request(aux_layers=aux)
        self.version = ckpt.version
        self.target = ts
        self.head = EagleHead(ckpt, ts.vocab_size).to(device=info.device, dtype=ts.dtype).eval()
        self.head.fuse_projections()
        mode = batch1_gemv if batch1_gemv is not None else info.extra.get("batch1_gemv", "auto")
        if mode not in GEMV_MODES:
            raise ValueError(f"speculative.options.batch1_gemv={mode!r}: expected one of {', '.join(GEMV_MODES)}")
        n_gemv = self.head.attach_batch1_gemv(mode, info.device)  # before any graph capture
        if n_gemv:
            logger.info("EAGLE draft: batch-1 Triton GEMV on %d weights (batch1_gemv=%s)", n_gemv, mode)
        self.pool = DraftKVPool(len(self.head.layers), cfg.num_key_value_heads, cfg.head_dim, ts.dtype, info.device)
        self.topk = max(1, info.topk) if info.supports_tree else 1
        self.num_steps = max(1, info.num_steps)
        self.init_states()
        self.graphs = None
        if cuda_graph if cuda_graph is not None else info.device.type == "cuda":
            # the captured rotary must not read positions back to the host: size its cache now
            reserve_rotary_caches(self.head, int(getattr(cfg, "max_position_embeddings", 8192)), info.device)
            self.graphs = DraftGraphs(len(self.head.layers), self.pool.shape, cfg.hidden_size, ts.dtype, info.device,
                                      self._chain_steps, self._pending_rows, self.graph_factory, self._tree_steps,
                                      num_heads=cfg.num_attention_heads)

    # ---- the Drafter contract (on_accepted, on_finished: PooledDrafter's) ------------------------
    @torch.inference_mode()
    def propose(self, reqs, num_draft_tokens: int) -> DraftProposal:
        ready = [self._ready(req) for req in reqs]
        if self.topk == 1:  # chains: every request's steps in one batched draft forward
            live = [st for st in ready if st is not None]
            chains = iter(self._chains(live, min(self.num_steps, num_draft_tokens)) if live else [])
            return DraftProposal([next(chains) if st is not None else [] for st in ready])
        tokens, parents = [], []
        for st in ready:
            t, p = self._tree(st, num_draft_tokens) if st is not None else ([], [])
            tokens.append(t)
            parents.append(p)
        return DraftProposal(tokens, parents)

    # ---- features in, rows through the draft ---------------------------------------------------
    def _features(self, rows: HiddenRows) -> torch.Tensor | None:
        return rows.final if self.version == 2 else rows.aux

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.head.embed_tokens is not None:
            return self.head.embed_tokens(ids)
        return self.target.embed(ids)

    def _attention(self, q, keys, values, mask) -> torch.Tensor:
        """q [r, H, d], keys/values [T, KV, d], mask [r, T] (True: may attend) -> [r, H * d]."""
        return grouped_attention(q, keys, values, mask)

    def _run_pending(self, st: DraftRequestState) -> None:
        """Run the newly verified rows into the draft's KV (kept) and remember the last one's output."""
        feats = torch.cat(st.pending_feats) if len(st.pending_feats) > 1 else st.pending_feats[0]
        new = self.pool.alloc(len(st.pending_pos))
        got = None
        if self.graphs is not None:
            got = self.graphs.pending(self.pool.k, self.pool.v, st.slots, new, st.pending_tok, st.pending_pos, feats,
                                      owner=st)
        if got is None:
            self._run_pending_eager(st, feats, new)
            return
        st.slots = torch.cat([st.slots, new])
        st.pending_pos, st.pending_tok, st.pending_feats = [], [], []
        st.root = (st.last_pos, got[0], got[1])

    def _pending_rows(self, inp: PendingInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """What the pending graph captures: one request's new rows after its cached ones in the
        static keys (row j sees the cached rows and new rows 0..j); (last row's output [1, H],
        its log-probs [V]). The new rows' keys / values are left in `inp.keys` / `inp.values`."""
        rows, width = inp.ids.shape[0], inp.keys[0].shape[0]
        dev = inp.ids.device
        at = inp.cached + torch.arange(rows, device=dev)
        mask = torch.arange(width, device=dev)[None, :] <= at[:, None]

        def attend(layer, q, k, v):
            kv = k.shape[1]  # (a one-row graph's buffer holds every query head: broadcast per group)
            grouped_view(inp.keys[layer], kv)[at] = k.unsqueeze(-2)
            grouped_view(inp.values[layer], kv)[at] = v.unsqueeze(-2)
            return self._attention(q, inp.keys[layer], inp.values[layer], mask)

        out = self.head.step(self._embed(inp.ids), inp.pos, inp.feats, attend)
        last = out.index_select(0, inp.last)
        return last, self.head.log_probs(last, self.target.logits)[0]

    def _run_pending_eager(self, st: DraftRequestState, feats: torch.Tensor, new: torch.Tensor) -> None:
        dev = self.pool.device
        pos = torch.tensor(st.pending_pos, dtype=torch.int64, device=dev)
        ids = torch.tensor(st.pending_tok, dtype=torch.int64, device=dev)
        r, cached = len(st.pending_pos), len(st.slots)
        slots = torch.cat([st.slots, new])
        # KV columns padded to a multiple of WIDTH_STEP (masked): a bounded set of attention shapes
        # as the request grows (cuDNN's SDPA builds a plan per new shape; see padded_width's use in _chains)
        width = padded_width(len(slots))
        mask = torch.zeros(r, width, dtype=torch.bool, device=dev)
        mask[:, :cached] = True
        mask[:, cached : cached + r] = torch.tril(torch.ones(r, r, dtype=torch.bool, device=dev))

        def attend(layer, q, k, v):
            self.pool.k[layer][new] = k
            self.pool.v[layer][new] = v
            keys, values = gather_padded(self.pool.k[layer], slots, width), gather_padded(self.pool.v[layer], slots, width)
            return self._attention(q, keys, values, mask)

        out = self.head.step(self._embed(ids), pos, feats, attend)
        st.slots = slots
        st.pending_pos, st.pending_tok, st.pending_feats = [], [], []
        st.root = (st.last_pos, out[-1:], self.head.log_probs(out[-1:], self.target.logits)[0])

    # ---- tree expansion ------------------------------------------------------------------------
    def _ready(self, req) -> DraftRequestState | None:
        """The request's state with its verified rows run, or None when the features of its newest
        token are missing (no draft this step)."""
        st = self._state(req.rid)
        if st.pending_pos:
            self._run_pending(st)
        if st.root is None or st.root[0] != len(req.all_ids()) - 2:
            return None
        return st

    def _chains(self, sts: list[DraftRequestState], steps: int) -> list[list[int]]:
        """Greedy chains of `steps` tokens for several requests at once (the tree with k = 1): each
        request's cached keys padded into one batch, the new rows written after them, tokens kept
        on the device until one host copy at the end."""
        dev, b = self.pool.device, len(sts)
        if b == 1:  # batch 1: the root's tensors as they are (a cat / stack of one would copy them)
            root_out, root_lp = sts[0].root[1], sts[0].root[2][None]
        else:
            root_out, root_lp = torch.cat([st.root[1] for st in sts]), torch.stack([st.root[2] for st in sts])
        tok = self.head.to_target_ids(root_lp.argmax(-1))
        if self.graphs is not None and steps > 1:
            got = self.graphs.chain(self.pool.k, self.pool.v, [st.slots for st in sts], [st.root[0] for st in sts],
                                    root_out, tok, steps, owners=sts)
            if got is not None:
                return got.tolist()
        lens = torch.tensor([len(st.slots) for st in sts], dtype=torch.int64, device=dev)
        # eager (no graph for this shape, or none at all): the width padded as a graph bucket's, so
        # that the attention sees a new shape once per WIDTH_STEP tokens, not every propose (on the
        # H200 the draft's SDPA runs in cuDNN, which builds an execution plan per new shape: tens
        # of ms; most likely why an eager propose took 92.9 ms in session 8)
        width = padded_width(max(len(st.slots) for st in sts) + steps)
        keys, values = [], []
        for layer in range(len(self.head.layers)):
            k = torch.zeros(b, width, *self.pool.shape, dtype=self.pool.dtype, device=dev)
            v = torch.zeros_like(k)
            for i, st in enumerate(sts):
                k[i, : len(st.slots)] = self.pool.k[layer][st.slots]
                v[i, : len(st.slots)] = self.pool.v[layer][st.slots]
            keys.append(k)
            values.append(v)
        root_pos = torch.tensor([st.root[0] for st in sts], dtype=torch.int64, device=dev)
        return self._chain_steps(ChainInputs(keys, values, lens, root_pos, root_out, tok), steps).tolist()

    def _chain_steps(self, inp: ChainInputs, steps: int) -> torch.Tensor:
        """The chain steps after the root (what the chain graph captures): each request's new row
        goes after its `lens` cached keys in the padded `inp.keys`; tokens [b, steps]."""
        b, width = inp.lens.shape[0], inp.keys[0].shape[1]
        dev = inp.lens.device
        out, tok = inp.root_out, inp.tok
        drafted, rows, cols = [tok], torch.arange(b, device=dev), torch.arange(width, device=dev)
        for depth in range(1, steps):
            at = inp.lens + depth - 1  # where each request's new row goes
            mask = (cols[None, :] <= at[:, None])[:, None, None, :]

            def attend(layer, q, kk, vv, at=at, mask=mask):
                kv = kk.shape[1]  # (a batch-1 graph's buffer holds every query head: broadcast per group)
                grouped_view(inp.keys[layer], kv)[rows, at] = kk.unsqueeze(-2)
                grouped_view(inp.values[layer], kv)[rows, at] = vv.unsqueeze(-2)
                return self._attention_padded(q, inp.keys[layer], inp.values[layer], mask)

            out = self.head.step(self._embed(tok), inp.root_pos + depth, out, attend)
            # argmax of the raw logits: the log-softmax over the draft vocabulary changes no ranking
            tok = self.head.to_target_ids(self.head.logits(out, self.target.logits).argmax(-1))
            drafted.append(tok)
        return torch.stack(drafted, dim=1)

    def _attention_padded(self, q, keys, values, mask) -> torch.Tensor:
        """One query row per request: q [b, H, d], keys/values [b, T, KV, d] (or [b, T, H, d], already
        repeated per query head), mask [b, 1, 1, T]. With KV heads each KV head's H / KV query heads
        are that head's query rows (no repeated keys)."""
        b, h, d = q.shape
        kv = keys.shape[2]
        if kv == h:
            out = F.scaled_dot_product_attention(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                                                 attn_mask=mask)
            return out.reshape(b, h * d)
        out = F.scaled_dot_product_attention(q.view(b, kv, h // kv, d), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask)
        return out.reshape(b, h * d)

    def _tree(self, st: DraftRequestState, limit: int) -> tuple[list[int], list[int]]:
        """EAGLE-2's dynamic tree (see the module docstring): through the tree graph when there is
        one, else eagerly. Both number the nodes alike and keep the same ones (up to exact ties
        of cumulative scores, which the device's top-k may order differently)."""
        if self.graphs is not None:
            got = self.graphs.tree(self.pool.k, self.pool.v, st.slots, st.root[0], st.root[1], st.root[2],
                                   self.topk, self.num_steps, owner=st)
            if got is not None:
                tokens, scores, parents = got
                keep = best_nodes(scores, parents, limit)
                where = {n: j for j, n in enumerate(keep)}
                return [tokens[n] for n in keep], [where.get(parents[n], -1) for n in keep]
        return self._tree_eager(st, limit)

    def _tree_steps(self, inp: TreeInputs, k: int, steps: int):
        """The tree expansion on the device (what the tree graph captures): (tokens [N] int64,
        cumulative scores [N] fp32, parents [N] int64, -1 for the root's children), N = k + (steps
        - 1) * k * k, nodes in the eager order: the root's top k, then per level the k * k children
        of the frontier (frontier row by row, each row's children by rank)."""
        dev = inp.root_lp.device
        width = inp.keys[0].shape[0]
        scratch = inp.scratch_k[0].shape[0]
        score, idx = inp.root_lp.topk(k)
        tok = self.head.to_target_ids(idx)
        feat = inp.root_out.expand(k, -1).contiguous()
        node = torch.arange(k, device=dev)  # the frontier's node ids
        anc = torch.zeros(k, scratch, dtype=torch.bool, device=dev)  # frontier rows' ancestors' scratch rows
        cached_cols = torch.arange(width, device=dev)[None, :] < inp.cached  # [1, W]
        scratch_cols = torch.arange(scratch, device=dev)
        tokens, scores, parents = [tok], [score], [torch.full((k,), -1, dtype=torch.int64, device=dev)]
        first = k
        for level in range(1, steps):
            rows = (level - 1) * k + torch.arange(k, device=dev)
            # each row sees itself (pure device ops: an index_put of a Python True copies a host
            # scalar, which CUDA graph capture refuses)
            anc = anc | (scratch_cols[None, :] == rows[:, None])
            mask = torch.cat([cached_cols.expand(k, -1), anc], dim=1)

            def attend(layer, q, kk, vv, rows=rows, mask=mask):
                inp.scratch_k[layer][rows] = kk
                inp.scratch_v[layer][rows] = vv
                keys = torch.cat([inp.keys[layer], inp.scratch_k[layer]])
                values = torch.cat([inp.values[layer], inp.scratch_v[layer]])
                return self._attention(q, keys, values, mask)

            out = self.head.step(self._embed(tok), inp.root_pos.expand(k) + level, feat, attend)
            child_lp, child_idx = self.head.log_probs(out, self.target.logits).topk(k, dim=-1)  # [k, k]
            child_score = (score[:, None] + child_lp).flatten()
            child_tok = self.head.to_target_ids(child_idx).flatten()
            tokens.append(child_tok)
            scores.append(child_score)
            parents.append(node[:, None].expand(k, k).flatten())
            best = child_score.topk(k).indices
            parent_row = torch.div(best, k, rounding_mode="floor")
            node, tok, score = first + best, child_tok[best], child_score[best]
            feat, anc = out[parent_row], anc[parent_row]
            first += k * k
        return torch.cat(tokens), torch.cat(scores), torch.cat(parents)

    def _tree_eager(self, st: DraftRequestState, limit: int) -> tuple[list[int], list[int]]:
        root_pos, root_out, root_lp = st.root
        k, steps = self.topk, self.num_steps
        dev = self.pool.device
        lp, idx = root_lp.topk(k)
        toks = self.head.to_target_ids(idx).tolist()
        tokens, parents, scores, depth = list(toks), [-1] * k, lp.tolist(), [1] * k
        feat = {i: root_out[0] for i in range(k)}  # node -> the feature its draft row reads
        frontier = list(range(k))
        layers = len(self.head.layers)
        spec_k = [torch.empty(0, *self.pool.shape, dtype=self.pool.dtype, device=dev) for _ in range(layers)]
        spec_v = [torch.empty(0, *self.pool.shape, dtype=self.pool.dtype, device=dev) for _ in range(layers)]
        spec_nodes: list[int] = []  # the node of each scratch row
        # the request's cached rows padded to a multiple of WIDTH_STEP (masked), as in _chains
        cached, width = len(st.slots), padded_width(len(st.slots))
        prefix_k = [gather_padded(self.pool.k[i], st.slots, width) for i in range(layers)]
        prefix_v = [gather_padded(self.pool.v[i], st.slots, width) for i in range(layers)]
        for _ in range(1, steps):
            r = len(frontier)
            ancestors = [self._ancestors(n, parents) for n in frontier]
            mask = torch.ones(r, width + len(spec_nodes) + r, dtype=torch.bool)
            mask[:, cached:width] = False
            for a, anc in enumerate(ancestors):
                for s, node in enumerate(spec_nodes):
                    mask[a, width + s] = node in anc
                mask[a, width + len(spec_nodes):] = False
                mask[a, width + len(spec_nodes) + a] = True
            mask = mask.to(dev)
            pos = torch.tensor([root_pos + depth[n] for n in frontier], dtype=torch.int64, device=dev)
            ids = torch.tensor([tokens[n] for n in frontier], dtype=torch.int64, device=dev)

            def attend(layer, q, kk, vv, mask=mask):
                spec_k[layer] = torch.cat([spec_k[layer], kk])
                spec_v[layer] = torch.cat([spec_v[layer], vv])
                keys = torch.cat([prefix_k[layer], spec_k[layer]])
                values = torch.cat([prefix_v[layer], spec_v[layer]])
                return self._attention(q, keys, values, mask)

            out = self.head.step(self._embed(ids), pos, torch.stack([feat[n] for n in frontier]), attend)
            spec_nodes.extend(frontier)
            lps = self.head.log_probs(out, self.target.logits)
            child_lp, child_idx = lps.topk(k, dim=-1)
            child_tok = self.head.to_target_ids(child_idx).tolist()
            child_lp = child_lp.tolist()
            born = []
            for a, n in enumerate(frontier):
                for c in range(k):
                    tokens.append(child_tok[a][c])
                    parents.append(n)
                    scores.append(scores[n] + child_lp[a][c])
                    depth.append(depth[n] + 1)
                    feat[len(tokens) - 1] = out[a]
                    born.append(len(tokens) - 1)
            frontier = sorted(born, key=lambda i: -scores[i])[:k]
        keep = best_nodes(scores, parents, limit)
        where = {n: j for j, n in enumerate(keep)}
        return [tokens[n] for n in keep], [where.get(parents[n], -1) for n in keep]

    @staticmethod
    def _ancestors(node: int, parents: list[int]) -> set[int]:
        out = set()
        while node != -1:
            out.add(node)
            node = parents[node]
        return out
