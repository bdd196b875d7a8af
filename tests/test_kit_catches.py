"""The conformance kits added for speculative decoding fail on components that break their
contract: a kit that passes everything would prove nothing."""

from __future__ import annotations

import random

import pytest
import torch
from radixserve.interfaces.drafter import Drafter, DraftProposal
from radixserve.testing import ReferenceAttentionBackend, check_attention_backend, check_drafter

SMALL = dict(heads=((2, 1, 32),), seeds=(0,), num_requests=3, decode_steps=1, tree_steps=2)


class CopyDrafter(Drafter):
    """A minimal correct drafter: proposes what followed the last token's previous occurrence."""

    def __init__(self, info, **options) -> None:
        self.info = info

    def _draft(self, req, k: int) -> list[int]:
        seq = req.origin_input_ids + req.output_ids
        last = seq[-1]
        for i in range(len(seq) - 2, -1, -1):
            if seq[i] == last:
                return seq[i + 1 : i + 1 + k]
        return []

    def propose(self, reqs, num_draft_tokens):
        return DraftProposal([self._draft(r, num_draft_tokens) for r in reqs])


def test_a_correct_drafter_passes():
    check_drafter(CopyDrafter, topk=(1,), min_acceptance=0.5)


@pytest.mark.parametrize("bug, message", [
    ("too_long", "num_draft_tokens"),
    ("missing_entry", "one entry per request"),
    ("bad_token", "outside the vocabulary"),
    ("bad_parent", "parents"),
    ("random", "deterministic"),
    ("keeps_state", "finished request's rid"),
    ("keeps_req", "still holds the Req"),
    ("mutates", "changed request"),
])
def test_a_broken_drafter_fails(bug, message):
    class Broken(CopyDrafter):
        def __init__(self, info, **options) -> None:
            super().__init__(info)
            self.rng = random.Random()  # unseeded: differs between two drafters
            self.seen: dict[str, int] = {}
            self.reqs: list = []

        def propose(self, reqs, num_draft_tokens):
            drafts = [self._draft(r, num_draft_tokens) for r in reqs]
            parents = None
            if bug == "too_long":
                drafts = [d + [1] * (num_draft_tokens + 1 - len(d)) for d in drafts]
            elif bug == "missing_entry":
                drafts = drafts[:-1]
            elif bug == "bad_token":
                drafts = [d + [self.info.vocab_size] for d in drafts]
                drafts = [d[-num_draft_tokens:] for d in drafts]
            elif bug == "bad_parent":
                parents = [[j for j in range(len(d))] for d in drafts]  # a token is its own parent
            elif bug == "random":
                drafts = [[self.rng.randrange(self.info.vocab_size)] for _ in reqs]
            elif bug == "mutates":
                reqs[0].output_ids.append(0)
            for r in reqs:
                self.seen[r.rid] = len(r.output_ids)
                if bug == "keeps_req":
                    self.reqs.append(r)
            return DraftProposal(drafts, parents)

        def on_finished(self, req):
            if bug not in ("keeps_state", "keeps_req"):
                self.seen.pop(req.rid, None)

    with pytest.raises(AssertionError, match=message):
        check_drafter(Broken, topk=(1,), seeds=(0,))


def test_a_drafter_keeping_state_on_its_class_fails():
    """State in a class-level dict outlives every drafter instance (the kit once looked only at the
    instance's own fields)."""

    class ClassState(CopyDrafter):
        seen: dict[str, int] = {}

        def propose(self, reqs, num_draft_tokens):
            for r in reqs:
                ClassState.seen[r.rid] = len(r.output_ids)
            return super().propose(reqs, num_draft_tokens)

    with pytest.raises(AssertionError, match=r"finished request's rid at ClassState\.seen"):
        check_drafter(ClassState, topk=(1,), seeds=(0,))


def test_the_attention_kit_checks_tree_masks():
    check_attention_backend(ReferenceAttentionBackend, **SMALL)

    class IgnoresTheMask(ReferenceAttentionBackend):
        def forward_extend(self, q, k, v, layer, batch):
            batch.tree_mask = None  # plain causal attention instead of the tree
            return super().forward_extend(q, k, v, layer, batch)

    with pytest.raises(AssertionError, match="tree parents"):
        check_attention_backend(IgnoresTheMask, **SMALL)

    class NoTreeSupport(IgnoresTheMask):
        supports_tree_mask = False  # then the kit gives it no trees, and it passes

    check_attention_backend(NoTreeSupport, **SMALL)


def test_a_chain_mask_must_equal_causal_extend():
    class WrongWithoutMask(ReferenceAttentionBackend):
        """Right with a mask, wrong for a plain extend of several tokens: only the chain check sees it."""

        def forward_extend(self, q, k, v, layer, batch):
            out = super().forward_extend(q, k, v, layer, batch)
            if batch.tree_mask is None and max(batch.extend_lens_cpu) > 1 and self.verify_phase:
                return out + 1.0
            return out

        verify_phase = False

        def init_forward_metadata(self, batch):
            if batch.tree_mask is not None:
                WrongWithoutMask.verify_phase = True  # trees have started: prefill is over
            super().init_forward_metadata(batch)

    try:
        with pytest.raises(AssertionError, match="causal"):
            check_attention_backend(WrongWithoutMask, **SMALL)
    finally:
        WrongWithoutMask.verify_phase = False


@pytest.mark.parametrize("option, message", [("sliding_window", "sliding_window 6"), ("logit_cap", "logit_cap 1.5")])
def test_the_attention_kit_checks_layer_options(option, message):
    """A backend that declares windows / soft-capping but computes without them fails the kit (the
    kit's windows are shorter than its sequences); one that does not declare them is not given them."""
    from dataclasses import replace

    class IgnoresTheOption(ReferenceAttentionBackend):
        def attend64(self, q, k, v, layer, batch):
            return super().attend64(q, k, v, replace(layer, **{option: None}), batch)

    with pytest.raises(AssertionError, match=message):
        check_attention_backend(IgnoresTheOption, **SMALL)

    class DoesNotDeclareIt(IgnoresTheOption):
        pass

    setattr(DoesNotDeclareIt, f"supports_{option}", False)
    check_attention_backend(DoesNotDeclareIt, **SMALL)


def test_the_attention_kit_checks_the_fused_rotary_store():
    """A backend declaring `fuses_rotary_with_kv_store` (plugin API 1.5) is driven through
    `forward_decode_rotary` on every DECODE step: the base class's unfused default passes, one that
    skips the rotation (of q for the output, of k for the pool) fails naming the path."""

    class Fusing(ReferenceAttentionBackend):
        fuses_rotary_with_kv_store = True  # the base class's default: rotary, then forward_decode

    check_attention_backend(Fusing, **SMALL)

    for skipped in ("q", "k"):
        class ForgetsOne(Fusing):
            def forward_decode_rotary(self, q, k, v, positions, rotary, layer, batch, skipped=skipped):
                q_rot, k_rot = rotary(positions, q, k)
                return self.forward_decode(q if skipped == "q" else q_rot, k if skipped == "k" else k_rot, v,
                                           layer, batch)

        with pytest.raises(AssertionError, match="forward_decode_rotary"):
            check_attention_backend(ForgetsOne, **SMALL)


def test_the_attention_kit_checks_the_fused_qk_norm():
    """A backend declaring `fuses_qk_norm_with_rotary` (plugin API 1.6) gets a `QKNorm` with the
    fused rotary calls: the base class's default (norms, rotary, forward_decode) passes, one that
    drops the norm fails naming it."""

    class Fusing(ReferenceAttentionBackend):
        fuses_rotary_with_kv_store = True
        fuses_qk_norm_with_rotary = True

    check_attention_backend(Fusing, **SMALL)

    class DropsTheNorm(Fusing):
        def forward_decode_rotary(self, q, k, v, positions, rotary, layer, batch, qk_norm=None):
            return super().forward_decode_rotary(q, k, v, positions, rotary, layer, batch)

    with pytest.raises(AssertionError, match="qk_norm"):
        check_attention_backend(DropsTheNorm, **SMALL)


def test_the_attention_kit_checks_bf16_pools_only_where_declared():
    check_attention_backend(ReferenceAttentionBackend, kv_dtype=torch.bfloat16, **SMALL)  # reads what is stored

    class Undeclared(ReferenceAttentionBackend):
        supports_bf16_kv_cache = False

    with pytest.raises(ValueError, match="does not declare supports_bf16_kv_cache"):
        check_attention_backend(Undeclared, kv_dtype=torch.bfloat16, **SMALL)
