"""Conformance kit for speculative drafters: a drafter is driven the way the scheduler drives it
(`propose` for the decoding requests, `on_accepted` with the tokens each step appended,
`on_finished` when a request leaves) against a toy target whose outputs copy long spans of their
prompts, so a useful drafter's proposals do get accepted.

Checked: every proposal is well formed (one entry per request in order, at most
`num_draft_tokens` tokens, token ids in the vocabulary, `parents` valid for trees; a tree only
when `info.supports_tree` and `info.topk > 1`, each node with at most `topk` children); proposals
are the same for the same history (two fresh drafters fed the same calls agree); `on_accepted`
works whatever order the requests' calls come in; the drafter never changes a request; and after
`on_finished` nothing in the drafter refers to the request (neither the `Req` object nor its
`rid`: no per-request state is kept for finished requests)."""

from __future__ import annotations

import gc
import random
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from radixserve.interfaces.drafter import Drafter, DrafterInfo, DraftProposal
from radixserve.plugins.registry import class_problem
from radixserve.state import Req, SamplingParams
from radixserve.testing._hooks import call_hook


def drafter_info(*, vocab_size: int = 64, num_draft_tokens: int = 4, topk: int = 1, supports_tree: bool | None = None,
                 **fields: Any) -> Any:
    """The construction argument a drafter receives (`DrafterInfo`), for tests: CPU device, no
    model files. `supports_tree` defaults to `topk > 1`."""
    values = dict(device=torch.device("cpu"), vocab_size=vocab_size, num_draft_tokens=num_draft_tokens, topk=topk,
                  num_steps=num_draft_tokens, supports_tree=topk > 1 if supports_tree is None else supports_tree)
    values.update(fields)
    return DrafterInfo(**values)


class _ToyRequest:
    """A request whose true output copies spans of its prompt (jumping now and then)."""

    def __init__(self, rng: random.Random, rid: str, vocab: int, doc: list[int]) -> None:
        start = rng.randrange(len(doc) // 2)
        prompt = doc[start : start + rng.randint(12, 60)] + [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        truth: list[int] = []
        while len(truth) < rng.randint(8, 40):
            if rng.random() < 0.15:
                truth.append(rng.randrange(vocab))
            else:
                src = rng.randrange(len(prompt))
                truth += prompt[src : src + rng.randint(2, 12)]
        self.truth = truth
        self.req = Req(rid, prompt, SamplingParams(max_new_tokens=len(truth), temperature=0.0))


def _check_proposal(proposal: Any, reqs: list[Req], k: int, info: Any, where: str) -> None:
    vocab = info.vocab_size
    assert isinstance(proposal, DraftProposal), f"{where}: propose returned {type(proposal).__name__}, not DraftProposal"
    assert isinstance(proposal.tokens, list) and len(proposal.tokens) == len(reqs), (
        f"{where}: {len(proposal.tokens) if isinstance(proposal.tokens, list) else proposal.tokens!r} token lists "
        f"for {len(reqs)} requests (one entry per request, in order)")
    if proposal.parents is not None:
        assert isinstance(proposal.parents, list) and len(proposal.parents) == len(reqs), (
            f"{where}: parents must be None or one list per request")
    for i, (req, draft) in enumerate(zip(reqs, proposal.tokens)):
        what = f"{where}, request {i} ({req.rid})"
        assert isinstance(draft, list), f"{what}: draft is {type(draft).__name__}, not a list"
        assert len(draft) <= k, f"{what}: {len(draft)} draft tokens > num_draft_tokens={k}"
        for t in draft:
            assert type(t) is int, f"{what}: draft token {t!r} is {type(t).__name__}, not int"
            assert 0 <= t < vocab, f"{what}: draft token {t} outside the vocabulary [0, {vocab})"
        if proposal.parents is not None:
            parents = proposal.parents[i]
            assert isinstance(parents, list) and len(parents) == len(draft), (
                f"{what}: parents {parents!r} do not match the {len(draft)} draft tokens")
            for j, p in enumerate(parents):
                assert type(p) is int and -1 <= p < j, (
                    f"{what}: parents[{j}] = {p!r}; a parent is -1 (the last verified token) or an earlier index")
            _check_tree_shape(parents, info, what)


def _check_tree_shape(parents: list[int], info: Any, what: str) -> None:
    """Trees only where allowed, at most `topk` children a node (the core would cut the rest
    silently: a drafter ignoring these rules loses its branches without a sign)."""
    if info.topk <= 1 or not info.supports_tree:
        assert all(p == j - 1 for j, p in enumerate(parents)), (
            f"{what}: parents {parents} make a tree, but info.topk={info.topk} and info.supports_tree="
            f"{info.supports_tree}: propose chains (parents=None or each draft the child of the one before) unless "
            f"info.supports_tree is true and info.topk > 1 (docs/contracts.md section 6a)")
        return
    children: dict[int, int] = {-1: 0}
    for p in parents:
        children[p] = children.get(p, 0) + 1
    node, n = max(children.items(), key=lambda kv: kv[1])
    assert n <= info.topk, (
        f"{what}: {'the root (-1)' if node == -1 else f'draft {node}'} has {n} children, more than "
        f"info.topk={info.topk} (parents {parents})")


def _accept(req_truth: list[int], done: int, draft: list[int], parents: list[int] | None) -> list[int]:
    """Greedy verification against the truth: the longest accepted path, then the target's own token."""
    accepted: list[int] = []
    node = -1
    while done + len(accepted) < len(req_truth):
        want = req_truth[done + len(accepted)]
        kids = [j for j in range(len(draft)) if (parents[j] if parents is not None else j - 1) == node]
        hit = next((j for j in kids if draft[j] == want), None)
        accepted.append(want)  # a matching draft, or the target's own token that ends the step
        if hit is None:
            break
        node = hit
    return accepted


def _run(factory: Callable[[], Drafter], info: Any, seed: int, num_requests: int, max_concurrent: int,
         record: list, check_release: bool) -> dict[str, int]:
    rng = random.Random(seed)
    vocab, k_max = info.vocab_size, info.num_draft_tokens
    doc = [rng.randrange(vocab) for _ in range(200)]
    drafter = factory()
    assert isinstance(drafter, Drafter), f"the factory built {type(drafter).__name__}, not a Drafter"
    pending = [_ToyRequest(rng, f"kit-{seed}-req-{i}-{rng.getrandbits(40):x}", vocab, doc) for i in range(num_requests)]
    running: list[_ToyRequest] = []
    stats = {"request_steps": 0, "proposed": 0, "accepted_drafts": 0}
    step = 0
    finished: set[str] = set()
    while pending or running:
        while pending and len(running) < max_concurrent and (not running or rng.random() < 0.5):
            toy = pending.pop(0)
            toy.req.output_ids.append(toy.truth[0])  # the prefill's token
            call_hook(drafter.on_accepted, toy.req, [toy.truth[0]],
                      where=f"seed {seed}, step {step}: on_accepted({toy.req.rid!r}, <the prefill's token>)")
            running.append(toy)
        step += 1
        batch = rng.sample(running, rng.randint(1, len(running)))  # any subset, any order
        k = rng.randint(1, k_max)
        where = (f"seed {seed}, topk {info.topk}{'' if info.supports_tree or info.topk == 1 else ' (no tree support)'}, "
                 f"step {step}: propose({[t.req.rid for t in batch]}, num_draft_tokens={k})")
        before = [(list(t.req.origin_input_ids), list(t.req.output_ids)) for t in batch]
        proposal = call_hook(drafter.propose, [t.req for t in batch], k, where=where)
        _check_proposal(proposal, [t.req for t in batch], k, info, where)
        for t, (prompt, output) in zip(batch, before):
            assert t.req.origin_input_ids == prompt and t.req.output_ids == output, f"{where}: changed request {t.req.rid}"
        record.append((proposal.tokens, proposal.parents))
        updates = []
        for i, t in enumerate(batch):
            parents = proposal.parents[i] if proposal.parents is not None else None
            accepted = _accept(t.truth, len(t.req.output_ids), proposal.tokens[i], parents)
            stats["proposed"] += len(proposal.tokens[i])
            stats["accepted_drafts"] += len(accepted) - 1
            updates.append((t, accepted))
        rng.shuffle(updates)  # on_accepted in any order across requests
        for t, accepted in updates:
            t.req.output_ids.extend(accepted)
            call_hook(drafter.on_accepted, t.req, accepted, where=f"seed {seed}, step {step}: on_accepted({t.req.rid!r}, {accepted})")
        stats["request_steps"] += len(batch)
        for t in [t for t in running if len(t.req.output_ids) >= len(t.truth)]:
            running.remove(t)
            t.req.finished_reason = {"type": "length"}
            on_finished = getattr(drafter, "on_finished", None)
            if on_finished is not None:
                call_hook(on_finished, t.req, where=f"seed {seed}, step {step}: on_finished({t.req.rid!r})")
            finished.add(t.req.rid)
            if check_release:
                _assert_released(drafter, t, f"seed {seed}, after on_finished({t.req.rid!r})")
    if check_release:
        path = _find_rid(drafter, finished)
        assert path is None, (f"seed {seed}: after every request finished (on_finished called), the drafter still "
                              f"holds state keyed by a finished request's rid at {path}")
    return stats


def _assert_released(drafter: Drafter, toy: _ToyRequest, where: str) -> None:
    ref = weakref.ref(toy.req)
    toy.req = None  # the kit's own reference goes; only the drafter could keep it alive
    if ref() is not None:
        gc.collect()  # only when needed: a full collection is slow in a process that imported torch
    assert ref() is None, f"{where}: the drafter still holds the Req object"


_ATOM_TYPES = {int, float, bool, bytes, type(None), torch.dtype, torch.device}


def _find_rid(root: Any, rids: set[str], limit: int = 200_000) -> str | None:
    """Where in `root`'s object graph one of the strings `rids` appears (None: nowhere). The
    mutable containers of root's own classes count too: state kept on the class (a class-level
    dict) outlives every instance."""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "drafter")]
    for cls in type(root).__mro__:
        if cls.__module__ != "builtins":
            stack += [(value, f"{cls.__name__}.{name}") for name, value in vars(cls).items()
                      if isinstance(value, (dict, list, set))]
    atoms = tuple(_ATOM_TYPES)
    while stack and len(seen) < limit:
        obj, path = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, str):
            if obj in rids:
                return f"{path} ({obj!r})"
            continue
        if isinstance(obj, dict):
            for key, value in obj.items():
                if isinstance(key, str) and key in rids:
                    return f"{path}[{key!r}] (a key)"
                if not isinstance(value, atoms):
                    stack.append((value, f"{path}[{key!r}]"))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            if set(map(type, obj)) <= _ATOM_TYPES:  # big flat tables of numbers: one pass at C speed
                continue
            for i, value in enumerate(obj):
                if not isinstance(value, atoms):
                    stack.append((value, f"{path}[{i}]"))
        elif isinstance(obj, (torch.Tensor, type, types.ModuleType)) or callable(obj) and not hasattr(obj, "__dict__"):
            continue
        else:
            fields = dict(getattr(obj, "__dict__", {}))
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        fields[name] = getattr(obj, name)
            for name, value in fields.items():
                if not isinstance(value, atoms):
                    stack.append((value, f"{path}.{name}"))
    return None


def assert_drafter_class(cls: type, options: dict[str, Any] | None = None) -> None:
    """AssertionError when the core would refuse `cls` as the drafter a stack selects, with these
    `speculative.options` (the checks of the stack resolution, shared: not a Drafter subclass,
    abstract, an `__init__` not taking the info first, an option its constructor does not take)."""
    from radixserve.plugins.stack import drafter_option_problem

    label = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)
    problem = class_problem("drafter", cls)
    if problem is None and options:
        problem = drafter_option_problem(cls, cls.__qualname__, options)
    if problem is not None:
        raise AssertionError(f"{label} {problem} (the core refuses it when a stack selects it)")


def check_drafter(
    drafter: Callable[..., Drafter],
    *,
    options: dict[str, Any] | None = None,
    vocab_size: int = 64,
    num_draft_tokens: int = 4,
    topk: Sequence[int] = (1, 3),
    seeds: Sequence[int] = (0, 1),
    num_requests: int = 8,
    max_concurrent: int = 4,
    min_acceptance: float | None = None,
) -> float:
    """Run `drafter` through the Drafter contract; raise AssertionError naming the first violation.

    :param drafter: the drafter class (built as `drafter(info, **options)`, as the core does), or
        any callable taking the info.
    :param options: the drafter's options (`speculative.options`).
    :param vocab_size, num_draft_tokens: the info's values: token ids must be below vocab_size,
        drafts at most num_draft_tokens long (each step asks for a random 1..num_draft_tokens).
    :param topk: one run per value (`info.topk`; `info.supports_tree` is `topk > 1`). Trees are
        allowed only when both allow them, with at most `topk` children a node; each topk > 1 also
        gets one run (first seed) with `supports_tree=False`, where the drafter must propose chains.
    :param seeds: one scenario per seed and topk: `num_requests` requests, at most
        `max_concurrent` decoding at once, batched in random subsets and orders.
    :param min_acceptance: when set, the mean accepted drafts per request and step must reach it
        in every run (the toy outputs copy their prompts, so a lookup drafter should score well above 0).
    :return: the mean accepted drafts per request step over the runs of every topk and seed (the
        toy outputs copy their prompts): track a drafter's quality without bisecting min_acceptance.

    A class is first checked as the core checks the drafter a stack selects (a `Drafter` subclass
    implementing `propose`, an `__init__` taking the info first, `options` its constructor takes);
    once built it must keep the info it was given (`self.info`, set by `super().__init__(info)`).
    An exception from building it is an AssertionError naming the case, like one from its hooks.
    """
    opts = dict(options or {})
    if isinstance(drafter, type):
        assert_drafter_class(drafter, opts)
    accepted = steps = 0
    for k in topk:
        # trees as the kit's info allows them, then (topk > 1) a backend without tree masks
        for trees in ((True, False) if k > 1 else (False,)):
            info = drafter_info(vocab_size=vocab_size, num_draft_tokens=num_draft_tokens, topk=k, supports_tree=trees)

            def factory(info=info) -> Drafter:
                built = call_hook(lambda: drafter(info, **opts), where=(
                    f"topk {info.topk}: building the drafter ({getattr(drafter, '__qualname__', 'drafter')}(info"
                    f"{', **' + repr(opts) if opts else ''}))"))
                if isinstance(drafter, type) and isinstance(built, Drafter):
                    assert getattr(built, "info", None) is info, (
                        f"{drafter.__qualname__}(info{', **options' if opts else ''}) does not keep the info it "
                        f"was given (self.info is {getattr(built, 'info', None)!r}): call super().__init__(info) "
                        "in its __init__, or set self.info = info")
                return built

            extra = k > 1 and not trees  # only the chain rule is new there: one seed, no determinism rerun
            for seed in seeds[:1] if extra else seeds:
                first: list = []
                stats = _run(factory, info, seed, num_requests, max_concurrent, first, check_release=True)
                if extra:
                    continue
                again: list = []
                _run(factory, info, seed, num_requests, max_concurrent, again, check_release=False)
                for step, (a, b) in enumerate(zip(first, again, strict=True)):
                    assert a == b, (f"seed {seed}, topk {k}, step {step + 1}: two drafters fed the same history "
                                    f"proposed differently: {a} vs {b} (proposals must be deterministic)")
                accepted += stats["accepted_drafts"]
                steps += stats["request_steps"]
                if min_acceptance is not None:
                    mean = stats["accepted_drafts"] / max(1, stats["request_steps"])
                    assert mean >= min_acceptance, (f"seed {seed}, topk {k}: {mean:.2f} accepted drafts per request "
                                                    f"step < {min_acceptance} on outputs that copy their prompts")
    return accepted / max(1, steps)
