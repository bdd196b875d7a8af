"""Conformance kit for drafters on a real target model: the scheduler drives a `ModelRunner` over a
(tiny) checkpoint with the drafter, and every request's greedy output must be the output of the
same requests without speculation. Unlike `check_drafter` (a toy target, no forwards), the
drafter here gets real `DrafterInfo.target_states`, so a drafter that drafts from the target's
hidden states (`TargetStates.request` / `take`) runs that path: recording through prefill chunks,
decode and verify steps, rows served by the prefix cache missing, accepted paths.

Added in plugin API 1.12."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.config import Config


def check_drafter_on_model(
    drafter: type | Callable[[Any], Any],
    checkpoint: str,
    *,
    options: dict[str, Any] | None = None,
    num_draft_tokens: int = 4,
    topk: int = 1,
    draft_model_path: str | None = None,
    num_prompts: int = 6,
    new_tokens: int = 16,
    chunk: int = 8,
    seed: int = 0,
    min_accept_length: float | None = None,
) -> float:
    """Raise AssertionError when speculation changes an output, leaks KV slots, or keeps a finished
    request's state; return the mean accepted length per verify step (1.0: no draft accepted).

    :param drafter: the class (built as `drafter(info, **options)`, as the server builds it) or a
        callable taking the `DrafterInfo`.
    :param checkpoint: an HF directory the core loads (e.g. `tiny_checkpoint("llama", dir)`); it
        runs in fp32 on the CPU with torch_native attention (which verifies trees).
    :param topk: `speculative.topk` (> 1: the drafter may propose trees).
    :param draft_model_path: `speculative.draft_model_path` (a drafter with weights of its own).
    :param chunk: the prefill chunk size: prompts are prefilled in several chunks, so recorded
        rows arrive from several forwards.
    :param min_accept_length: if given, the mean accepted length must reach it (set it where the
        drafter is known to guess right, so the accepted-path bookkeeping is exercised).
    """
    from radixserve.testing._hooks import call_hook
    from radixserve.testing.drafter import assert_drafter_class
    from radixserve.testing.end_to_end import run_to_completion
    from radixserve.testing.speculative import (
        greedy_request,
        shared_prefix_prompts,
        speculative_scheduler,
        target_runner,
    )

    if isinstance(drafter, type):  # what the core refuses at stack resolution fails here first, as an AssertionError
        assert_drafter_class(drafter, options)
    runner = target_runner(checkpoint)
    prompts = shared_prefix_prompts(num_prompts, int(runner.vocab_size), seed)

    def requests() -> list:
        return [greedy_request(f"r{i}", p, new_tokens) for i, p in enumerate(prompts)]

    plain = run_to_completion(speculative_scheduler(runner, None, None), requests())
    config = Config.build({
        # the name only switches speculation on here: the drafter is built from `drafter` below
        "stack": {"prefix_cache": "radix", "speculative": "kit-drafter"},
        "speculative": {"num_draft_tokens": num_draft_tokens, "topk": topk, "adaptive_batch_size": 0,
                        "draft_model_path": draft_model_path},
        "scheduler": {"max_total_tokens": 6000, "chunked_prefill_size": chunk},
    })
    built: list[Any] = []

    def make(info, _config):
        d = call_hook(lambda: drafter(info, **(options or {})) if isinstance(drafter, type) else drafter(info),
                      where="building the drafter")
        built.append(d)
        return d

    sched = speculative_scheduler(runner, config, make)
    name = getattr(drafter, "__name__", type(built[0]).__name__ if built else "drafter")
    got = run_to_completion(sched, requests())  # raises on a failed request or a leaked KV slot
    for rid, ids in plain.items():
        assert got.get(rid) == ids, (
            f"{name}: request {rid} decoded {got.get(rid)} with speculation, {ids} without: a verify must never "
            "change an output (was a draft accepted that the target did not produce?)")
    stats = sched.stats()
    # the scheduler survives a raising propose / on_accepted / on_finished (the step decodes without
    # drafts, the hook's work is lost): the kit does not (drafter audit 32: one that always failed passed)
    assert stats["plugin_failures"] == 0, (
        f"{name}: {stats['plugin_failures']} calls of its hooks raised while serving (propose, on_accepted or "
        "on_finished; the first traceback is in the log of logger radixserve.scheduler.scheduler)")
    assert stats["spec_verifies"] > 0, f"{name}: no verify step ran (did the drafter propose anything?)"
    accept = float(stats["spec_accept_length"])
    if min_accept_length is not None:
        assert accept >= min_accept_length, f"{name}: mean accepted length {accept:.3f} < {min_accept_length}"
    states = getattr(built[0], "states", None)
    assert not states, f"{name}: state kept for finished requests: {sorted(states)[:5]}"
    left = sorted(rid for rid, rows in runner.target_states._rows.items() if rows)
    assert not left, f"{name}: hidden rows of finished requests still held by the capture (call discard): {left}"
    return accept
