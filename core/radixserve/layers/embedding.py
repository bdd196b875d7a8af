"""Vocab-parallel token embedding and LM head (each rank holds a contiguous vocab range)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from radixserve.layers import cpu_gemm, cpu_greedy_head
from radixserve.layers.distributed import TPGroup, group_for
from radixserve.layers.weight_utils import set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    """Rows [rank*per_rank, (rank+1)*per_rank) of the (vocab padded to tp_size) embedding table."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1,
                 params_dtype: torch.dtype | None = None, tp_group: TPGroup | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_group = group_for(tp_group, tp_rank, tp_size)
        tp_rank, tp_size = self.tp_group.rank, self.tp_group.size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"embedding is not fused; got shard_id={shard_id!r}")
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != self.embedding_dim:
            raise ValueError(f"embedding shape {tuple(loaded.shape)} != ({self.num_embeddings}, {self.embedding_dim})")
        part = loaded[self.vocab_start : self.vocab_end]
        param.data[: part.shape[0]].copy_(part.to(param.dtype))
        param.data[part.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mask, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return self.tp_group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary. With tied embeddings the model points `weight` at the
    embedding's parameter (`tie_to`) instead of loading its own."""

    packed_weight: cpu_gemm.PackedWeight | None = None  # CPU fp32 packed copy (see pack_for_cpu)
    greedy_head: cpu_greedy_head.GreedyHead | None = None  # CPU bf16 screening copy (see pack_for_cpu)
    gemv_config: Any = None  # a triton_gemv.GemvConfig for batch-1 rows (gemv_selection.attach_batch1_gemv)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def pack_for_cpu(self) -> None:
        """Called once after loading (also when tied: the packed copy is the head's own)."""
        self.packed_weight = cpu_gemm.pack(self.weight)
        if self.tp_size == 1:  # the screen needs the whole vocabulary in one process
            self.greedy_head = cpu_greedy_head.pack(self.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab]."""
        if (self.gemv_config is not None and hidden.dim() == 2 and hidden.shape[0] == 1
                and hidden.dtype == self.weight.dtype):
            # a tile set by the runner (runtime.batch1_gemv, gemv_selection.attach_batch1_gemv): the
            # batch-1 Triton GEMV, as the linear layers (Llama-3 head on the H200: 230.5 vs 240.3 us)
            from radixserve.layers import triton_gemv

            logits = triton_gemv.gemv(hidden, self.weight, config=self.gemv_config)
        else:
            logits = cpu_gemm.linear(hidden, self.weight, self.packed_weight)
        logits = self.tp_group.all_gather_last_dim(logits)[..., : self.num_embeddings]
        return logits.float()

    def greedy_token_ids(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """argmax of `compute_logits(hidden)[:, :vocab_size]` per row without the logits, where the
        CPU screen applies (see cpu_greedy_head); None otherwise."""
        if self.tp_size > 1:
            return self._distributed_argmax(hidden, vocab_size)
        if self.greedy_head is None or vocab_size != self.weight.shape[0]:
            return None
        return cpu_greedy_head.argmax(hidden, self.weight, self.greedy_head)

    def _distributed_argmax(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """TP: each rank's best (logit, id) over its vocab range, one all-gather of [rows, 2]
        pairs instead of the [rows, vocab] logits; the first maximum wins, as torch.argmax (rank
        ranges are in vocab order)."""
        logits = cpu_gemm.linear(hidden, self.weight, self.packed_weight).float()
        valid = max(0, min(vocab_size, self.vocab_end) - self.vocab_start)
        pair = torch.full((hidden.shape[0], 2), float("-inf"), dtype=torch.float64, device=hidden.device)
        if valid:
            idx = logits[:, :valid].argmax(dim=-1)
            pair[:, 0] = logits.gather(1, idx.unsqueeze(1)).squeeze(1).double()
            pair[:, 1] = (idx + self.vocab_start).double()
        gathered = self.tp_group.all_gather_last_dim(pair).view(hidden.shape[0], self.tp_size, 2)
        winner = gathered[:, :, 0].argmax(dim=-1, keepdim=True)  # first (lowest-rank) maximum
        return gathered[:, :, 1].gather(1, winner).squeeze(1).to(torch.int64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding; call compute_logits(hidden)")
