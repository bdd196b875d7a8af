"""The conformance kits added for speculative decoding fail on components that break their
contract: a kit that passes everything would prove nothing."""

from __future__ import annotations

import random

import pytest
import torch
from radixserve.interfaces import SchedulePolicy
from radixserve.interfaces.drafter import Drafter, DraftProposal
from radixserve.testing import ReferenceAttentionBackend, check_attention_backend, check_drafter, check_prefix_cache
from radixserve_cache_radix.radix_cache import RadixCache

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
    # drafter audit 32: a raising hook came out as the bare RuntimeError, without the case
    ("raises_accepted", r"seed 0, step \d+: on_accepted\('kit-0-req-.*\) raised RuntimeError: accepted bug"),
    ("raises_finished", r"seed 0, step \d+: on_finished\('kit-0-req-.*'\) raised RuntimeError: finished bug"),
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

        def on_accepted(self, req, accepted):
            if bug == "raises_accepted" and len(req.output_ids) > 3:
                raise RuntimeError("accepted bug")

        def on_finished(self, req):
            if bug == "raises_finished":
                raise RuntimeError("finished bug")
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


class TreeCopyDrafter(CopyDrafter):
    """Correct trees: the copy chain, plus a second child of the root where trees are allowed."""

    def propose(self, reqs, num_draft_tokens):
        chains = super().propose(reqs, num_draft_tokens).tokens
        if not (self.info.supports_tree and self.info.topk > 1) or num_draft_tokens < 2:
            return DraftProposal(chains)
        tokens, parents = [], []
        for c in chains:
            c = c[: num_draft_tokens - 1]
            tokens.append(c + [0])
            parents.append(list(range(-1, len(c) - 1)) + [-1])  # the extra node: a sibling of c[0]
        return DraftProposal(tokens, parents)


def test_a_correct_tree_drafter_passes():
    check_drafter(TreeCopyDrafter, topk=(1, 2), seeds=(0,))

    class EmptyTrees(CopyDrafter):  # no draft, as an empty tree
        def propose(self, reqs, num_draft_tokens):
            return DraftProposal([[] for _ in reqs], [[] for _ in reqs])

    check_drafter(EmptyTrees, topk=(1, 3), seeds=(0,))


@pytest.mark.parametrize("bug, topk, message", [
    # audit 29, finding 5: a tree at topk 1 and a root with n > topk children both passed
    ("tree_at_topk1", (1,), r"make a tree, but info.topk=1 and info.supports_tree=False"),
    ("wide", (3,), r"the root \(-1\) has 4 children, more than info.topk=3"),
    # trees asked for (topk 2) but the backend cannot verify them: only the kit's extra run sees it
    ("ignores_supports_tree", (2,), r"topk 2 \(no tree support\).*info.supports_tree=False"),
])
def test_a_drafter_breaking_the_tree_rules_fails(bug, topk, message):
    class Broken(TreeCopyDrafter):
        def propose(self, reqs, num_draft_tokens):
            if bug == "tree_at_topk1" and num_draft_tokens >= 2:
                return DraftProposal([[1, 2] for _ in reqs], [[-1, -1] for _ in reqs])
            if bug == "wide" and num_draft_tokens >= 4:
                return DraftProposal([list(range(1, num_draft_tokens + 1)) for _ in reqs],
                                     [[-1] * num_draft_tokens for _ in reqs])
            if bug == "ignores_supports_tree" and num_draft_tokens >= 2:
                return DraftProposal([[1, 2] for _ in reqs], [[-1, -1] for _ in reqs])
            return super().propose(reqs, num_draft_tokens)

    with pytest.raises(AssertionError, match=message):
        check_drafter(Broken, topk=topk, seeds=(0,))


def test_a_raising_propose_is_named_with_its_case():
    """Audit 29, finding 4: the drafter's own error came through without the seed or step."""

    class Raises(CopyDrafter):
        def propose(self, reqs, num_draft_tokens):
            raise RuntimeError("index out of date")

    with pytest.raises(AssertionError, match=r"seed 0, topk 1, step 1: propose\(.*\) raised RuntimeError: index out of "
                                             r"date") as e:
        check_drafter(Raises, topk=(1,), seeds=(0,))
    assert isinstance(e.value.__cause__, RuntimeError)


def test_check_drafter_returns_the_mean_accepted_drafts():
    """Audit 29, finding 9: the acceptance showed only when min_acceptance failed."""

    class Nothing(CopyDrafter):
        def propose(self, reqs, num_draft_tokens):
            return DraftProposal([[] for _ in reqs])

    assert check_drafter(Nothing, topk=(1,), seeds=(0,)) == 0.0
    mean = check_drafter(CopyDrafter, topk=(1,), seeds=(0,), num_requests=6, max_concurrent=3)
    assert 0.5 < mean <= 4
    assert check_drafter(CopyDrafter, topk=(1,), seeds=(0,), num_requests=6, max_concurrent=3,
                         min_acceptance=mean) == mean  # one seed: its mean is the returned one
    with pytest.raises(AssertionError, match="accepted drafts per request step"):
        check_drafter(CopyDrafter, topk=(1,), seeds=(0,), num_requests=6, max_concurrent=3, min_acceptance=mean + 0.01)


class _DoubleFree(RadixCache):
    """One bug each, in evict or in the request helpers: a slot freed twice (in evict: the first slot of the
    first run of more than `min_run` slots that it frees)."""

    where = "evict"
    min_run = 0

    def evict(self, num_tokens):
        if self.where != "evict":
            return super().evict(num_tokens)
        freed = []
        real = self.allocator.free
        self.allocator.free = lambda slots: (freed.append(slots.clone()), real(slots))[1]
        try:
            n = super().evict(num_tokens)
        finally:
            del self.allocator.free
        runs = [slots for slots in freed if slots.numel() > self.min_run]
        if runs:
            real(runs[0][:1])
        return n

    def _insert_and_free_duplicates(self, ids, kv, old_len):
        cached = self.insert(ids, kv)
        self.allocator.free(kv[old_len:cached])
        if self.where == "finish" and cached > old_len:
            self.allocator.free(kv[old_len:old_len + 1])


@pytest.mark.parametrize("where, message", [
    ("evict", r"_DoubleFree \(seed 0, step \d+, (evict|insert)\): allocator.free\(slots \[\d+\]; already free: "
              r"\[\d+\]\) refused: free: slot already free \(double free\)"),
    ("finish", r"_DoubleFree \(seed 0, request level, step \d+, cache_(un)?finished_req of request r\d.*\): "
               r"allocator.free\(.*already free.*double free"),
])
def test_a_double_free_in_the_prefix_cache_kit_names_the_case(where, message):
    """Audit 29, finding 4: the allocator's ValueError came through bare (no seed, step or slot)."""
    cls = type(f"_DoubleFree_{where}", (_DoubleFree,), {"where": where})
    cls.__name__ = "_DoubleFree"
    with pytest.raises(AssertionError, match=message) as e:
        check_prefix_cache(cls, seeds=(0,), end_to_end=False)
    assert isinstance(e.value.__cause__, ValueError)


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


# ---- the attention kit: long sequences, the runner's layout, its arguments (audit 28) ----
SHORT = dict(heads=((2, 1, 32),), seeds=(0,), num_requests=3, decode_steps=1, tree_steps=0, layer_options=())


class ReadsOneSlotPast(ReferenceAttentionBackend):
    """A kernel tile-boundary bug: every key at position >= `limit` reads the slot of position limit - 1."""

    limit = 64

    def attend64(self, q, k, v, layer, batch):
        table = batch.req_to_token_pool.req_to_token
        saved = table.clone()
        for row, seq in zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu, strict=True):
            if seq > self.limit:
                table[row, self.limit : seq] = table[row, self.limit - 1]
        try:
            return super().attend64(q, k, v, layer, batch)
        finally:
            table.copy_(saved)


@pytest.mark.parametrize("limit", [64, 128, 256])
def test_the_attention_kit_crosses_common_tile_sizes(limit):
    """The random scenarios stay under about 100 positions; the long scenario's sequences cross 64, 128 and 256
    (extends after cached prefixes and decode), so a bug past a tile boundary fails by default."""

    class Truncates(ReadsOneSlotPast):
        pass

    Truncates.limit = limit
    check_attention_backend(Truncates, **SHORT, long_positions=())  # without the long scenario it passes
    with pytest.raises(AssertionError, match=r"EXTEND step .*differs from exact attention"):
        check_attention_backend(Truncates, **SHORT)
    check_attention_backend(ReferenceAttentionBackend, **SHORT, long_positions=(300,))  # any position


def test_the_attention_kit_passes_q_k_v_as_views_of_one_fused_buffer():
    """As the runner does (q, k, v split from the qkv projection's output): rows not contiguous, the last
    dim's stride 1; a backend reading them as dense rows (a kernel taking data_ptr()) fails."""
    seen = []

    class Records(ReferenceAttentionBackend):
        def attend64(self, q, k, v, layer, batch):
            seen.append([(t.stride(), t.is_contiguous() and len(t) > 1) for t in (q, k, v)])  # one row is contiguous
            return super().attend64(q, k, v, layer, batch)

    check_attention_backend(Records, **SHORT)
    width = (2 + 2 * 1) * 32  # (query heads + 2 * KV heads) * head_dim
    assert seen and all(s == [((width, 1), False)] * 3 for s in seen), seen[:3]

    class AssumesDenseRows(ReferenceAttentionBackend):
        def attend64(self, q, k, v, layer, batch):
            n, w = k.shape
            k, v = (torch.as_strided(t, (n, w), (w, 1)) for t in (k, v))
            return super().attend64(q, k, v, layer, batch)

    with pytest.raises(AssertionError, match="differs from exact attention"):
        check_attention_backend(AssumesDenseRows, **SHORT)


def test_the_latent_kit_passes_its_inputs_as_a_latent_model_does():
    from radixserve.testing import ReferenceLatentAttentionBackend, check_latent_attention_backend

    seen = []

    class Records(ReferenceLatentAttentionBackend):
        def latent64(self, q_nope, q_pe, c_kv, k_pe, layer, batch):
            seen.append([t.stride() for t in (q_nope, q_pe, c_kv, k_pe)])
            return super().latent64(q_nope, q_pe, c_kv, k_pe, layer, batch)

    h, lora, nope, rope, v = 3, 32, 16, 8, 24
    check_latent_attention_backend(Records, dims=((h, lora, nope, rope, v),), seeds=(0,), num_requests=2,
                                   decode_steps=1, tree_steps=0, decode_row_steps=0, long_positions=())
    q_strides = (h * (nope + rope), nope + rope, 1)  # per-head slices of one q projection
    assert all(s == [q_strides, q_strides, (lora + rope, 1), (lora + rope, 1)] for s in seen), seen[:3]


def test_the_attention_kit_takes_any_number_of_requests_and_names_bad_counts():
    """More than 12 requests used to run out of request rows (IndexError); the pools now grow to fit."""
    check_attention_backend(ReferenceAttentionBackend, heads=((2, 1, 16),), seeds=(0,), num_requests=16,
                            decode_steps=4, tree_steps=1, layer_options=(), long_positions=())
    for bad in ({"num_requests": 0}, {"decode_steps": -1}, {"tree_steps": 1.5}, {"long_positions": (64, 0)}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            check_attention_backend(ReferenceAttentionBackend, **bad)


def test_the_attention_kit_refuses_what_the_runner_could_not_build():
    """An AssertionError naming the problem, as every kit violation is (it was an AttributeError or TypeError)."""
    from radixserve.interfaces import AttentionBackend

    class NotSubclass:
        def __init__(self, runner_info):
            pass

    with pytest.raises(AssertionError, match="is not a subclass of radixserve.interfaces.AttentionBackend"):
        check_attention_backend(NotSubclass, **SHORT)
    with pytest.raises(AssertionError, match="returned NotSubclass, not an AttentionBackend"):
        check_attention_backend(lambda info: NotSubclass(info), **SHORT)

    class NoDecode(AttentionBackend):
        def __init__(self, runner_info):
            pass

        def init_forward_metadata(self, batch):
            pass

        def forward_extend(self, q, k, v, layer, batch):
            raise NotImplementedError

    with pytest.raises(AssertionError, match="is abstract: it does not implement forward_decode"):
        check_attention_backend(NoDecode, **SHORT)


def test_an_attention_kit_failure_names_the_token_and_head_that_differ():
    """A kernel author reads which new token, position and query head to look at, not only an error norm."""

    class LastHeadWrong(ReferenceAttentionBackend):
        def attend64(self, q, k, v, layer, batch):
            out = super().attend64(q, k, v, layer, batch).reshape(q.shape[0], layer.num_heads, -1)
            out[:, layer.num_heads - 1] += 1.0
            return out.reshape(q.shape[0], -1)

    with pytest.raises(AssertionError, match=r"largest difference at new token \d+ \(position \d+\), query head 1, "
                                             r"column \d+: got .*, exact "):
        check_attention_backend(LastHeadWrong, **SMALL)


class _DoubleFreeOfLongRuns(_DoubleFree):
    """A slot freed twice only when evict frees more than 12 slots of one node at once: the kind of bug
    a cache of 16-token blocks has, which keys of at most 12 tokens never reached."""

    min_run = 12


def test_the_prefix_cache_kit_drives_keys_of_several_16_token_blocks():
    """Cache/policy audit 33: the API level's keys were at most 12 tokens, so a block cache's insert, evict and
    lock paths were only reached by the request level, whose failures named no step or operation."""
    with pytest.raises(AssertionError, match=r"_DoubleFreeOfLongRuns \(seed 0, keys up to 60 tokens, step \d+, "
                                             r"(evict|insert)\): allocator.free\(.*already free"):
        check_prefix_cache(_DoubleFreeOfLongRuns, seeds=(0,), end_to_end=False)


def test_a_raising_policy_order_is_named_with_its_case():
    """Cache/policy audit 33: an exception from order() came through bare (no seed or queue)."""
    from radixserve.testing import check_schedule_policy
    from radixserve.testing.end_to_end import ArrivalOrder

    class Raises(ArrivalOrder):
        def order(self, waiting, cache):
            if len(waiting) > 1:
                raise RuntimeError("stale index")
            return super().order(waiting, cache)

    with pytest.raises(AssertionError, match=r"Raises.order \(seed 0, \d+ waiting\): order\(\) raised RuntimeError: "
                                             r"stale index") as e:
        check_schedule_policy(Raises, seeds=(0,), end_to_end=False)
    assert isinstance(e.value.__cause__, RuntimeError)


class _ReadsBeforeStoring(ReferenceAttentionBackend):
    """Claims decode rows may share a request, but each row reads the pool before any row's k, v is stored
    (its own token taken from its arguments): right for one row a request, wrong for a chain of rows."""

    decode_rows_share_requests = True
    supports_tree_mask = False

    def forward_decode(self, q, k, v, layer, batch):
        loc = batch.out_cache_loc
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        old_k, old_v = k_buf[loc].to(k.dtype).reshape(k.shape), v_buf[loc].to(v.dtype).reshape(v.shape)
        rows = []
        for r in range(len(loc)):
            k_r, v_r = old_k.clone(), old_v.clone()
            k_r[r], v_r[r] = k[r], v[r]
            rows.append(self.attend64(q, k_r, v_r, layer, batch)[r])
        batch.kv_pool.set_kv(layer.layer_id, loc, k, v)
        return torch.stack(rows).to(q.dtype)


def test_the_attention_kit_runs_decode_rows_sharing_requests_when_the_backend_says_it_takes_them():
    """Attention audit 33: only the latent kit ran them, so this backend passed and changed greedy outputs
    under speculative decoding on the CPU."""
    check_attention_backend(_ReadsBeforeStoring, **SMALL, decode_row_steps=0)  # plain decode batches: right
    with pytest.raises(AssertionError, match=r"DECODE step"):
        check_attention_backend(_ReadsBeforeStoring, **SMALL)


# ---- audit 37: the kits apply the core's class checks and say every failure as an AssertionError ----
class _NotSubclassPolicy:
    def order(self, waiting, cache):
        return waiting


class _NoInfoDrafter(Drafter):
    def __init__(self, k=2):  # forgot the info: the core would pass it as k
        self.k = k

    def propose(self, reqs, num_draft_tokens):
        return DraftProposal([[] for _ in reqs])


def test_the_policy_kit_refuses_what_the_core_refuses():
    """Audit 37 (D6, D10): a class not subclassing SchedulePolicy passed the kit (the core refuses it); an abstract
    one and a constructor bug came out as TypeError / KeyError instead of an AssertionError."""
    from radixserve.testing import check_schedule_policy

    with pytest.raises(AssertionError, match=r"_NotSubclassPolicy is not a subclass of "
                                             r"radixserve.interfaces.policy.SchedulePolicy"):
        check_schedule_policy(_NotSubclassPolicy, seeds=(0,), end_to_end=False)
    with pytest.raises(AssertionError, match=r"built _NotSubclassPolicy, not a radixserve.interfaces.SchedulePolicy"):
        check_schedule_policy(lambda: _NotSubclassPolicy(), seeds=(0,), end_to_end=False)

    class Abstract(SchedulePolicy):
        def ordr(self, waiting, cache):
            return waiting

    with pytest.raises(AssertionError, match=r"Abstract does not implement order\(\)"):
        check_schedule_policy(Abstract, seeds=(0,), end_to_end=False)

    class KeyErrorInInit(SchedulePolicy):
        def __init__(self):
            super().__init__()
            self.v = {}["missing"]

        def order(self, waiting, cache):
            return waiting

    with pytest.raises(AssertionError, match=r"building the policy \(.*KeyErrorInInit\(\)\) raised KeyError: "
                                             r"'missing'") as e:
        check_schedule_policy(KeyErrorInInit, seeds=(0,), end_to_end=False)
    assert isinstance(e.value.__cause__, KeyError)


def test_the_drafter_kits_refuse_what_the_core_refuses():
    """Audit 37 (D6, D10): `__init__(self, k=2)` passed check_drafter (the info landed in k); an abstract drafter and a
    constructor bug came out as TypeError / KeyError."""
    from radixserve.testing import check_drafter_on_model

    with pytest.raises(AssertionError, match=r"_NoInfoDrafter does not take the DrafterInfo first: .*the info would "
                                             r"land in 'k'"):
        check_drafter(_NoInfoDrafter, topk=(1,), seeds=(0,))
    with pytest.raises(AssertionError, match=r"_NoInfoDrafter does not take the DrafterInfo first"):
        check_drafter_on_model(_NoInfoDrafter, "/nonexistent-checkpoint")  # refused before the model loads
    with pytest.raises(AssertionError, match=r"drafter '_StrictDrafter' has no option 'nope'; valid options: window"):
        check_drafter(_StrictDrafter, options={"nope": 1}, topk=(1,), seeds=(0,))

    class Abstract(Drafter):
        def propse(self, reqs, num_draft_tokens):
            return DraftProposal([[] for _ in reqs])

    with pytest.raises(AssertionError, match=r"Abstract does not implement propose\(\)"):
        check_drafter(Abstract, topk=(1,), seeds=(0,))

    class KeyErrorInInit(CopyDrafter):
        def __init__(self, info, *, table="x"):
            super().__init__(info)
            self.v = {}[table]

    with pytest.raises(AssertionError, match=r"topk 1: building the drafter \(.*KeyErrorInInit\(info\)\) raised "
                                             r"KeyError: 'x'") as e:
        check_drafter(KeyErrorInInit, topk=(1,), seeds=(0,))
    assert isinstance(e.value.__cause__, KeyError)

    class DropsInfo(CopyDrafter):
        def __init__(self, info, **options):
            pass  # neither super().__init__(info) nor self.info

    with pytest.raises(AssertionError, match=r"does not keep the info it was given .*super\(\).__init__\(info\)"):
        check_drafter(DropsInfo, topk=(1,), seeds=(0,))


class _StrictDrafter(CopyDrafter):
    def __init__(self, info, *, window=2):  # one option, checked by name as the core checks speculative.options
        super().__init__(info)


def test_the_prefix_cache_kit_refuses_a_class_the_core_refuses():
    class NotACache:
        def __init__(self, req_to_token_pool, allocator):
            pass

    with pytest.raises(AssertionError, match=r"NotACache is not a subclass of "
                                             r"radixserve.interfaces.prefix_cache.PrefixCache"):
        check_prefix_cache(NotACache, seeds=(0,), end_to_end=False)


class _AgeProbe(SchedulePolicy):
    """Records the age (`clock() - arrival_time`) of every request it orders; the old ones first, then by rid."""

    def __init__(self, clock, seen: list, max_wait_s: float = 2.5) -> None:
        super().__init__()
        self.clock, self.seen, self.max_wait_s = clock, seen, max_wait_s

    def order(self, waiting, cache):
        now = self.clock()
        self.seen.extend(now - r.arrival_time for r in waiting)
        return sorted(waiting, key=lambda r: (now - r.arrival_time < self.max_wait_s, r.rid))


def test_the_policy_kit_gives_recent_monotonic_arrival_times():
    """Audit 37 (D3): arrival_time was 4.0, 29.0, ... (a pre-1.15 counter), so against time.monotonic() every kit
    request had waited hours and an aging rule was only ever tested as FIFO."""
    import time

    from radixserve.testing import check_schedule_policy

    seen: list[float] = []
    check_schedule_policy(lambda: _AgeProbe(time.monotonic, seen), seeds=(0, 1), end_to_end=False)
    assert seen and all(-0.01 <= age <= 5.5 for age in seen), (min(seen), max(seen))  # default waits=(0, 5)
    assert len({round(a, 3) for a in seen}) > 5  # spread over seconds, not one value
    assert min(seen) < 2.5 < max(seen)  # both sides of an aging threshold


def test_the_policy_kit_takes_a_clock_and_a_range_of_waits():
    """Audit 37 (G2): a documented way to test a clock-based policy deterministically (plugin API 1.19)."""
    from radixserve.testing import check_schedule_policy

    def frozen():
        return 1000.0

    seen: list[float] = []
    check_schedule_policy(lambda: _AgeProbe(frozen, seen, max_wait_s=10), clock=frozen, waits=(8, 12), seeds=(0, 1, 2),
                          end_to_end=False)
    assert seen and all(8 <= age <= 12.001 for age in seen)
    assert min(seen) < 10 < max(seen)
    for bad in ((-1, 5), (5, 1)):
        with pytest.raises(ValueError, match="waits="):
            check_schedule_policy(lambda: _AgeProbe(frozen, []), waits=bad, end_to_end=False)


class _MatchReturnsTuple(RadixCache):
    def match_prefix(self, key):
        m = super().match_prefix(key)
        return m.kv_indices, m.last_node


class _InsertRaises(RadixCache):
    def insert(self, key, kv_indices):
        if len(key) > 3:
            raise RuntimeError("simulated bug in insert")
        return super().insert(key, kv_indices)


class _MatchRaises(RadixCache):
    def match_prefix(self, key):
        if len(key) > 3:
            raise RuntimeError("simulated bug in match_prefix")
        return super().match_prefix(key)


class _ShortMatch(RadixCache):
    """Never returns a match (the cache holds the prefix): the message labels tokens and slots."""

    def match_prefix(self, key):
        m = super().match_prefix(key)
        return type(m)(m.kv_indices[:0], m.last_node)


@pytest.mark.parametrize("cls, message, cause", [
    (_MatchReturnsTuple, r"_MatchReturnsTuple \(seed 0, step \d+, \w+\): match_prefix returned tuple, expected "
                         r"MatchResult \(contract section 2\)", None),
    (_InsertRaises, r"_InsertRaises \(seed 0, step \d+, insert\): insert\(key tokens \[.*\], slots \[.*\]\) raised "
                    r"RuntimeError: simulated bug in insert", RuntimeError),
    (_MatchRaises, r"_MatchRaises \(seed 0, step \d+, \w+\): match_prefix\(key tokens \[.*\]\) raised RuntimeError: "
                   r"simulated bug in match_prefix", RuntimeError),
])
def test_the_prefix_cache_kit_names_a_wrong_type_or_an_exception(cls, message, cause):
    """Cache audit 37c, D5: a tuple from match_prefix crashed the kit with an AttributeError, and a
    cache's exception came through bare (no seed, step or method)."""
    with pytest.raises(AssertionError, match=message) as e:
        check_prefix_cache(cls, seeds=(0,), end_to_end=False)
    assert cause is None or isinstance(e.value.__cause__, cause)


def test_the_prefix_cache_kit_labels_tokens_and_slots():
    """Cache audit 37c, D4: "match_prefix([0, 0]) = [], but the cached prefix is [1, 2]" (tokens, then slots)."""
    with pytest.raises(AssertionError, match=r"match_prefix\(key tokens \[[\d, ]+\]\) returned slots \[\], but the cache "
                                             r"holds slots \[[\d, ]+\] for tokens \[[\d, ]+\] \(contract: return the "
                                             r"longest cached prefix\)"):
        check_prefix_cache(_ShortMatch, seeds=(0,), end_to_end=False)
