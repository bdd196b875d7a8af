"""Token sampling: per-request parameters packed into tensors (`SamplingBatch`) and the `Sampler`
that turns a batch of logits into next tokens (plus logprobs when asked)."""

from radixserve.sampling.batch import SamplingBatch
from radixserve.sampling.sampler import SampleOutput, Sampler

__all__ = ["SampleOutput", "Sampler", "SamplingBatch"]
