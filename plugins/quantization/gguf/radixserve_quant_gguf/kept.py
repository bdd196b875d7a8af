"""Embedding and LM head holding a GGUF table in its file blocks (uint8 [vocab, row bytes]).

Swapped in for the model's float VocabParallelEmbedding / ParallelLMHead by
`GGUFMethod.prepare_model` before the weights load, so the float table is never filled: lookups
dequantize the requested rows, and the head computes logits with the same kernel (and activation
width) as the linears (a tied head shares the embedding's blocks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from radixserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.weight_utils import set_weight_attrs

from radixserve_quant_gguf import kernels


def _init_from(new: nn.Module, old: VocabParallelEmbedding, qtype: str) -> None:
    nn.Module.__init__(new)
    for attr in ("num_embeddings", "embedding_dim", "tp_group", "tp_rank", "tp_size", "per_rank", "vocab_start",
                 "vocab_end"):
        setattr(new, attr, getattr(old, attr))
    new.qtype = qtype
    rows = kernels.row_bytes(qtype, old.embedding_dim)
    new.weight = nn.Parameter(torch.empty(old.num_embeddings, rows, dtype=torch.uint8, device=old.weight.device),
                              requires_grad=False)
    set_weight_attrs(new.weight, {"output_dim": 0, "weight_loader": new.weight_loader})


def _load_blocks(module, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any) -> None:
    if shard_id is not None:
        raise ValueError(f"embedding is not fused; got shard_id={shard_id!r}")
    if loaded.dtype != torch.uint8 or tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"GGUF {module.qtype} table: expected uint8 blocks {tuple(param.shape)}, "
                         f"got {loaded.dtype} {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class BlockEmbedding(VocabParallelEmbedding):
    """Token embedding over GGUF blocks (one process: tp_size 1)."""

    def __init__(self, old: VocabParallelEmbedding, qtype: str) -> None:  # noqa: D107 - built by from_module
        _init_from(self, old, qtype)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        _load_blocks(self, param, loaded, shard_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return kernels.embedding(input_ids, self.weight, self.qtype, self.embedding_dim)


class BlockLMHead(ParallelLMHead):
    """LM head over GGUF blocks; `tie_to` a BlockEmbedding shares its blocks."""

    def __init__(self, old: ParallelLMHead, qtype: str, act_bits: int = 8) -> None:
        _init_from(self, old, qtype)
        self.act_bits = act_bits

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        _load_blocks(self, param, loaded, shard_id)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.qtype = embedding.qtype

    def pack_for_cpu(self) -> None:
        """Nothing to pack: the kernel reads the blocks."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return kernels.linear(hidden.float(), self.weight, self.qtype, self.act_bits)[..., : self.num_embeddings]

    def greedy_token_ids(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        return None  # the runner takes the argmax of compute_logits
