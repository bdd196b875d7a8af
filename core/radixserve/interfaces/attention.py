"""AttentionBackend: computes attention over the token-slot KV pool."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Protocol

from radixserve.state import ForwardMode

if TYPE_CHECKING:
    import torch

    from radixserve.state import ForwardBatch


class AttentionLayerSpec(Protocol):
    """What a backend may read from the attention layer that calls it."""

    layer_id: int  # index into the KV pool's per-layer buffers
    num_heads: int  # query heads on this TP rank
    num_kv_heads: int  # KV heads on this TP rank (GQA when < num_heads)
    head_dim: int
    scaling: float  # softmax scale, usually head_dim ** -0.5


class AttentionBackend(abc.ABC):
    """Attention over a paged (page size 1) KV pool.

    Contract:
    - Constructed once per ModelRunner as `Backend(runner_info)` where `runner_info` is a
      `radixserve.model_runner.AttentionRunnerInfo` (device, dtype, heads, head_dim, pools, max
      batch size). Heavy imports (triton) happen in the module that defines the class, which the
      registry imports only when the backend is selected.
    - `init_forward_metadata(batch)` is called once per forward, before any layer runs; it may
      store what every layer reuses (index tensors, split plans) in `batch.attn_metadata`.
    - `forward_extend` / `forward_decode` are called once per layer. q is [num_tokens, num_heads*head_dim],
      k and v are [num_tokens, num_kv_heads*head_dim] for the *new* tokens only. The backend must
      first store k, v into `batch.kv_pool` at `batch.out_cache_loc` for `layer.layer_id`, then
      attend each new token causally to its request's prefix KV plus the new tokens up to itself.
      It returns [num_tokens, num_heads*head_dim] in q's dtype. It must not change any other KV slot.
    - CUDA graph hooks are optional: a backend that supports graphs returns True from
      `supports_cuda_graph()` and implements `init_graph_state`, `init_forward_metadata_capture`
      and `init_forward_metadata_replay`, keeping every tensor a graph reads in static buffers.

    Added in plugin API 1.0.
    """

    # Metadata read by the registry without importing the module is declared at registration;
    # these class attributes repeat it for components built directly.
    name: str = "base"

    @classmethod
    def supports(cls, device: str, dtype: str, head_dim: int) -> bool:
        """Whether this backend can run this configuration; the runner refuses a selected backend
        that says no, naming the reason."""
        return True

    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare per-forward metadata (see the class contract)."""

    @abc.abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        """Prefill of new tokens after a cached prefix (see the class contract)."""

    @abc.abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        """One new token per request (see the class contract)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        if batch.mode is ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    # ---- optional CUDA graph support -------------------------------------------------------
    def supports_cuda_graph(self) -> bool:
        return False

    def init_graph_state(self, max_bs: int) -> None:
        """Allocate static buffers for decode batches up to max_bs."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """Like init_forward_metadata, but writing into the static buffers, during capture."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay(self, batch: ForwardBatch, real_bs: int) -> None:
        """Refresh the static buffers in place for a padded batch before graph replay."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
