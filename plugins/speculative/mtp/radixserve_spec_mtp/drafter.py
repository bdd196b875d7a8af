"""MtpDrafter: drafts with DeepSeek-V3's multi-token-prediction (MTP) layer.

The MTP row at position p reads (the embedding of token p + 1, the target's hidden state at p: the
output of its last decoder layer, before the final norm) and predicts token p + 2, so once the
target has verified tokens 0..L-1 (and computed hidden states for 0..L-2) the row at L-2 predicts
the first draft token. `on_accepted` collects the new hidden states (`DrafterInfo.target_states`,
aux layer num_hidden_layers - 1); `propose` runs the pending rows into the MTP layer's own latent
KV (kept for the request's life, `DraftLatentPool`) and then chains: each further draft token is
the MTP layer fed its own previous output and token (greedy). The chain rows' latents are scratch:
the verified path comes back as target hidden states later.

The draft layer's attention is a torch computation over its own one-layer LatentKVPool (absorbed
MLA, `layer.latent_attention`), not the target's attention backend: a draft step is a handful of
rows per request, and the backend's batch metadata is built for the target's pools."""

from __future__ import annotations

import logging

import torch
from radixserve.interfaces.drafter import DrafterInfo, DraftProposal
from radixserve.interfaces.target_states import HiddenRows
from radixserve.scheduler.speculative.draft_state import DraftRequestState, PooledDrafter

from radixserve_spec_mtp.checkpoint import KEY, load_config, read_mtp_layer
from radixserve_spec_mtp.kv_pool import DraftLatentPool
from radixserve_spec_mtp.layer import MtpModule, latent_attention

logger = logging.getLogger(__name__)

ROWS_PER_PIECE = 256  # verified rows of one request per draft forward (a long prompt runs in pieces)
SCORE_BUDGET = 1 << 26  # attention-score elements (fp32) one draft forward may hold: 256 MiB


class MtpDrafter(PooledDrafter):
    """Component "mtp" of kind "drafter" (radixserve-spec-mtp).

    :param layer: which MTP module of the checkpoint drafts (0-based, < num_nextn_predict_layers;
        DeepSeek-V3 ships one). Chained drafting reuses it for every draft token.

    The MTP weights are read from `speculative.draft_model_path` when set (a separately exported
    NextN checkpoint with its own config.json), else from the target checkpoint (`model.path`).
    Proposes chains of up to `speculative.num_steps` tokens (`topk` is ignored: no trees).
    Raises ValueError (a start-up error) when the checkpoint has no MTP layer or the target does not
    expose its hidden states."""

    def __init__(self, info: DrafterInfo, layer: int = 0) -> None:
        super().__init__(info)
        ts = info.target_states
        if ts is None:
            raise ValueError("stack.speculative=mtp needs the target's hidden states; this runner offers none")
        path = info.draft_model_path or info.model_path
        config = load_config(path) if info.draft_model_path else info.hf_config
        if config is None:
            raise ValueError(f"stack.speculative=mtp: no config for {path!r} (set {KEY})")
        weights = read_mtp_layer(path, config, int(layer))
        if int(config.hidden_size) != ts.hidden_size:
            raise ValueError(f"{KEY}: the MTP layer's hidden size {config.hidden_size} differs from the target's "
                             f"{ts.hidden_size}")
        if not ts.supports_aux_layers:
            raise ValueError("stack.speculative=mtp reads the target's last decoder layer output: the target model "
                             "does not expose intermediate hidden states (Model capability supports_aux_hidden_states)")
        ts.request(aux_layers=(ts.num_layers - 1,))
        self.target = ts
        self.mtp = MtpModule(weights).to(device=info.device, dtype=ts.dtype).eval()
        attn = self.mtp.layer.self_attn
        self.pool = DraftLatentPool(attn.kv_lora_rank, attn.rope, ts.dtype, info.device)
        self.num_steps = max(1, info.num_steps)
        self.init_states()

    # ---- the Drafter contract (on_accepted, on_finished: PooledDrafter's) ------------------------
    @torch.inference_mode()
    def propose(self, reqs, num_draft_tokens: int) -> DraftProposal:
        ready = self._ready(reqs)
        live = [st for st in ready if st is not None]
        chains = iter(self._chains(live, min(self.num_steps, num_draft_tokens)) if live else [])
        return DraftProposal([next(chains) if st is not None else [] for st in ready])

    # ---- hidden states in, rows through the MTP layer ------------------------------------------
    def _features(self, rows: HiddenRows) -> torch.Tensor | None:
        return rows.aux

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.mtp.embed_tokens is not None:
            return self.mtp.embed_tokens(ids)
        return self.target.embed(ids)

    def _greedy(self, out: torch.Tensor) -> torch.Tensor:
        return self.mtp.logits(out, self.target.logits)[:, : self.target.vocab_size].argmax(-1)

    def _run_pending(self, sts: list[DraftRequestState]) -> None:
        """Run the newly verified rows of `sts` into the draft's latent KV (kept) and remember each
        request's last row. Rows are cut into pieces of at most ROWS_PER_PIECE; pieces of several
        requests (and successive pieces of one request) share a forward while its attention
        scores stay within SCORE_BUDGET: a decode step's few rows per request run in one forward,
        a long prompt in bounded pieces."""
        heads = self.mtp.layer.self_attn.num_heads
        pieces: list[tuple[DraftRequestState, int, int, torch.Tensor]] = []  # (state, first row, end, context slots)
        for st in sts:
            slots = st.slots
            new = self.pool.alloc(len(st.pending_pos))
            for a in range(0, len(st.pending_pos), ROWS_PER_PIECE):
                b = min(a + ROWS_PER_PIECE, len(st.pending_pos))
                slots = torch.cat([slots, new[a:b]])
                pieces.append((st, a, b, slots))
            st.slots = slots
        group: list = []
        for piece in pieces:
            cand = group + [piece]
            rows = max(b - a for _, a, b, _ in cand)
            width = max(len(ctx) for *_, ctx in cand)
            if group and len(cand) * rows * width * heads > SCORE_BUDGET:
                self._run_pieces(group)
                cand = [piece]
            group = cand
        if group:
            self._run_pieces(group)
        outs = torch.cat([st.root[1] for st in sts])
        toks = self._greedy(outs).tolist()
        for st, tok in zip(sts, toks, strict=True):
            st.root = (st.last_pos, st.root[1], tok)
            st.pending_pos, st.pending_tok, st.pending_feats = [], [], []

    def _run_pieces(self, pieces) -> None:
        """One MTP forward over `pieces` (see `_run_pending`), padded per piece for attention."""
        dev = self.pool.device
        attn = self.mtp.layer.self_attn
        counts = [b - a for _, a, b, _ in pieces]
        pos = torch.tensor([p for st, a, b, _ in pieces for p in st.pending_pos[a:b]], dtype=torch.int64, device=dev)
        ids = torch.tensor([t for st, a, b, _ in pieces for t in st.pending_tok[a:b]], dtype=torch.int64, device=dev)
        hidden = torch.cat([self._hidden_rows(st)[a:b] for st, a, b, _ in pieces]).to(self.pool.dtype)
        news = torch.cat([ctx[len(ctx) - (b - a):] for _, a, b, ctx in pieces])
        n, rows, width = len(pieces), max(counts), max(len(ctx) for *_, ctx in pieces)
        which = torch.repeat_interleave(torch.arange(n, device=dev), torch.tensor(counts, device=dev))
        within = torch.cat([torch.arange(c, device=dev) for c in counts])
        # query row j of a piece sees its context up to and including its own new row
        seen = torch.tensor([len(ctx) - c for (*_, ctx), c in zip(pieces, counts, strict=True)], device=dev)
        cols, qrows = torch.arange(width, device=dev), torch.arange(rows, device=dev)
        mask = cols[None, None, :] <= (seen[:, None, None] + qrows[None, :, None])

        def attend(q_nope, q_pe, c_kv, k_pe):
            self.pool.write(news, c_kv, k_pe)
            latents = torch.zeros(n, width, self.pool.rows.shape[1], dtype=self.pool.dtype, device=dev)
            for i, (*_, ctx) in enumerate(pieces):
                latents[i, : len(ctx)] = self.pool.rows[ctx]
            qn = q_nope.new_zeros(n, rows, *q_nope.shape[1:])
            qp = q_pe.new_zeros(n, rows, *q_pe.shape[1:])
            qn[which, within], qp[which, within] = q_nope, q_pe
            out = latent_attention(qn, qp, latents, attn.w_uk, attn.w_uv, attn.kv_lora_rank, attn.scaling, mask)
            return out[which, within]

        out = self.mtp.step(self._embed(ids), pos, hidden, attend)
        at = 0
        for (st, _a, b, _), c in zip(pieces, counts, strict=True):
            if b == len(st.pending_pos):  # the request's last verified row: the chain starts from it
                st.root = (st.last_pos, out[at + c - 1 : at + c], -1)
            at += c

    @staticmethod
    def _hidden_rows(st: DraftRequestState) -> torch.Tensor:
        if len(st.pending_feats) > 1:  # gathered once, reused by every piece of the request
            st.pending_feats = [torch.cat(st.pending_feats)]
        return st.pending_feats[0]

    def _ready(self, reqs) -> list[DraftRequestState | None]:
        """Each request's state with its verified rows run, or None when the hidden state of its
        newest token's predecessor is missing (no draft this step)."""
        sts = [self._state(req.rid) for req in reqs]
        pending = [st for st in sts if st.pending_pos]
        if pending:
            self._run_pending(pending)
        return [st if st.root is not None and st.root[0] == len(req.all_ids()) - 2 else None
                for req, st in zip(reqs, sts, strict=True)]

    def _chains(self, sts: list[DraftRequestState], steps: int) -> list[list[int]]:
        """Greedy chains of `steps` tokens for several requests at once: each request's cached
        latents padded into one batch, the chain's rows written after them, tokens kept on the
        device until one host copy at the end."""
        dev, b = self.pool.device, len(sts)
        lens = torch.tensor([len(st.slots) for st in sts], dtype=torch.int64, device=dev)
        width = max(len(st.slots) for st in sts) + steps
        latents = torch.zeros(b, width, self.pool.rows.shape[1], dtype=self.pool.dtype, device=dev)
        for i, st in enumerate(sts):
            latents[i, : len(st.slots)] = self.pool.rows[st.slots]
        root_pos = torch.tensor([st.root[0] for st in sts], dtype=torch.int64, device=dev)
        out = torch.cat([st.root[1] for st in sts])
        tok = torch.tensor([st.root[2] for st in sts], dtype=torch.int64, device=dev)
        drafted, rows, cols = [tok], torch.arange(b, device=dev), torch.arange(width, device=dev)
        attn = self.mtp.layer.self_attn
        lora = attn.kv_lora_rank
        for depth in range(1, steps):
            at = lens + depth - 1  # where each request's new row goes
            mask = (cols[None, :] <= at[:, None])[:, None, :]

            def attend(q_nope, q_pe, c_kv, k_pe, at=at, mask=mask):
                latents[rows, at, :lora] = c_kv.to(latents.dtype)
                latents[rows, at, lora:] = k_pe.reshape(b, -1).to(latents.dtype)
                return latent_attention(q_nope[:, None], q_pe[:, None], latents, attn.w_uk, attn.w_uv, lora,
                                        attn.scaling, mask)[:, 0]

            out = self.mtp.step(self._embed(tok), root_pos + depth, out, attend)
            tok = self._greedy(out)
            drafted.append(tok)
        return torch.stack(drafted, dim=1).tolist()
