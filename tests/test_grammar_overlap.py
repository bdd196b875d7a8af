"""Overlap scheduling with structured output: a decode with constrained rows is launched before the
previous step's tokens are processed (its forward reads them on the device); its sampling waits
for its bitmask, which the scheduler fills once the matchers have accepted those tokens. Greedy
outputs must be those of overlap off, requests finishing while the next step is in flight must
lose that step's token, and every constrained output must follow its grammar."""

from __future__ import annotations

import json
import re
import sys
import threading
import weakref

import pytest
import torch
from radixserve.config import Config
from radixserve.interfaces.grammar import bitmask_width
from radixserve.model_runner import ModelRunner
from radixserve.plugins.registry import Registry
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.scheduler import scheduler as scheduler_module
from radixserve.scheduler.grammar import GrammarService
from radixserve.state import SamplingParams
from radixserve.testing import tiny_tokenizer, toy_reference
from radixserve_grammar_xgrammar.backend import XGrammarBackend, XGrammarMatcher
from test_grammar import EOS, SCHEMA, add, compiled, text
from test_grammar import run as run_steps
from test_grammar_after_reasoning import PROMPT, REGEX, VOCAB, free_marker, make_scheduler

SCHEMAS = {
    "j0": SCHEMA,
    "j1": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
           "required": ["name", "ok"], "additionalProperties": False},
    "j2": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
    "j3": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                                     "maxItems": 2}}, "required": ["tags"], "additionalProperties": False},
}
REGEXES = {"r0": r"(yes|no)! [a-c]{3}", "r1": r"[0-9]{2}", "r2": r"ab(c|x)"}
PLAIN = {f"p{i}": [7 + i, 30, 40 + i, 5] for i in range(3)}


def run(s: Scheduler) -> dict[str, dict]:
    return run_steps(compiled(s))


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def launched_ahead_with_mask(s: Scheduler) -> list[int]:
    """Batches (numbers) with a grammar bitmask that were launched, reading the previous batch's
    tokens on the device, before that batch's result was taken."""
    events = s.runner.events
    out = []
    for n, sb in enumerate(s.runner.batches):
        if sb.token_bitmask is None or sb.future_inputs is None:
            continue
        if events.index(("launch", n)) < events.index(("result", n - 1)):
            out.append(n)
    return out


def add_mixed_batch(s: Scheduler, tok) -> None:
    """8 constrained requests (4 schemas, 3 regexes, one grammar after a marker) and 3 plain ones."""
    for i, (rid, schema) in enumerate(SCHEMAS.items()):
        add(s, rid, [3, 4, 6 + i], max_new=60, json_schema=json.dumps(schema))
    for i, (rid, regex) in enumerate(REGEXES.items()):
        add(s, rid, [3, 5 + i, 5], max_new=60, regex=regex)
    marker, _ = free_marker(tok)
    add(s, "after", PROMPT, max_new=60, regex=REGEX, grammar_after=marker)
    for rid, prompt in PLAIN.items():
        add(s, rid, prompt, max_new=25)


def check_valid(tok, got: dict) -> None:
    for rid, schema in SCHEMAS.items():
        value = json.loads(text(tok, got[rid]["ids"]))
        if schema.get("type") == "array":
            assert isinstance(value, list) and 1 <= len(value) <= 3 and set(value) <= {"x", "y"}, value
        else:
            assert set(value) == set(schema["required"]), value
    for rid, regex in REGEXES.items():
        assert re.fullmatch(regex, text(tok, got[rid]["ids"])), (rid, text(tok, got[rid]["ids"]))
    _, k = free_marker(tok)
    assert re.fullmatch(REGEX, text(tok, got["after"]["ids"][k:]))
    for rid, prompt in PLAIN.items():
        assert got[rid]["ids"] == toy_reference(prompt, 25, VOCAB, frozenset({EOS}))


def test_constrained_decodes_are_launched_ahead_with_the_outputs_of_overlap_off(tok, monkeypatch):
    # bitmask buffers start with every token forbidden: the scheduler must write every row it
    # hands to the runner (a plain row left as it was would sample nothing the reference samples)
    monkeypatch.setattr(XGrammarBackend, "allocate_bitmask",
                        lambda self, n: torch.zeros((n, bitmask_width(self.vocab_size)), dtype=torch.int32))
    sync = make_scheduler(tok, False)
    add_mixed_batch(sync, tok)
    want = run(sync)
    # each step's constrained tokens reach their matchers in one accept_tokens call, none one by one
    batched, single, events = [], [], []
    accept_tokens, accept_token = XGrammarBackend.accept_tokens, XGrammarMatcher.accept_token
    fill_bitmasks, append_token = XGrammarBackend.fill_bitmasks, Scheduler._append_token
    monkeypatch.setattr(XGrammarBackend, "accept_tokens",
                        lambda self, ms, ts: batched.append(len(ms)) or events.append("accept") or accept_tokens(self, ms, ts))
    monkeypatch.setattr(XGrammarMatcher, "accept_token", lambda self, t: single.append(t) or accept_token(self, t))
    on_main = threading.main_thread
    monkeypatch.setattr(XGrammarBackend, "fill_bitmasks", lambda self, bm, rows: events.append(
        "fill" if threading.current_thread() is not on_main() else "fill on main") or fill_bitmasks(self, bm, rows))
    monkeypatch.setattr(Scheduler, "_append_token", lambda self, *a: events.append("append") or append_token(self, *a))
    s = make_scheduler(tok, True)
    s.fill_beside_processing = True  # the masks filled in the mask thread while the previous step is processed
    add_mixed_batch(s, tok)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(10.0)  # threads switch only when one blocks: the fill must not wait for the GIL
    try:
        got = run(s)
    finally:
        sys.setswitchinterval(switch)
    assert got == want  # ids and finish reasons
    # a launched-ahead step's fill starts in the mask thread right after the accept, before the
    # step's tokens are appended (the rest of the processing runs beside it), not after them
    beside = [i for i, e in enumerate(events) if e == "fill" and events[i - 1] == "accept"]
    assert len(beside) >= 10 and events[beside[0] + 1] == "append", events[:40]
    _, k = free_marker(tok)  # `after`'s first k tokens are unconstrained
    assert sum(batched) == sum(len(got[rid]["ids"]) for rid in [*SCHEMAS, *REGEXES, "after"]) - k
    assert max(batched) >= len(SCHEMAS) + len(REGEXES) and not single
    check_valid(tok, got)
    assert all(got[rid]["finish"]["type"] == "stop" for rid in [*SCHEMAS, *REGEXES, "after"])
    ahead = launched_ahead_with_mask(s)
    assert len(ahead) >= 10, ahead  # the constrained decode steps ran launched ahead
    assert s.metrics.overlapped_batches >= len(ahead)
    assert sync.metrics.overlapped_batches == 0


def test_a_request_finishing_while_the_next_step_is_in_flight_loses_that_token(tok):
    """`short`'s grammar ends it (stop) and `cut` reaches max_new_tokens inside its document,
    `stopped` hits a stop string, while the long request keeps the batch decoding ahead."""
    def build(overlap: bool) -> Scheduler:
        s = make_scheduler(tok, overlap)
        s.fill_beside_processing = True  # `stopped`'s row is filled while its stop string is found
        add(s, "short", [3, 4, 6], max_new=60, regex=r"ab")
        add(s, "cut", [3, 4, 7], max_new=3, regex=r"[a-c]{9}")
        add(s, "stopped", [3, 4, 8], max_new=60, regex=r"(yes|no)! [a-c]{3}", stop=["!"])
        add(s, "long", [3, 4, 9], max_new=40, json_schema=json.dumps(SCHEMAS["j3"]))
        return s

    sync, s = build(False), build(True)
    want, got = run(sync), run(s)
    assert got == want
    assert text(tok, got["short"]["ids"]) == "ab" and got["short"]["finish"]["type"] == "stop"
    assert len(got["cut"]["ids"]) == 3 and got["cut"]["finish"]["type"] == "length"
    assert got["stopped"]["finish"] == {"type": "stop", "matched": "!"}
    ahead = launched_ahead_with_mask(s)
    assert ahead
    # `short` was in one more batch than it has tokens: the step launched while its last token
    # was in flight, whose token was dropped; in that batch its mask row allowed everything
    batches = [(n, sb) for n, sb in enumerate(s.runner.batches) if any(r.rid == "short" for r in sb.reqs)]
    assert len(batches) == len(got["short"]["ids"]) + 1
    n, last = batches[-1]
    assert n in ahead
    row = [r.rid for r in last.reqs].index("short")
    assert bool((last.token_bitmask[row] == -1).all())


def test_a_request_aborted_while_in_flight_leaves_the_others_unchanged(tok):
    def build(rids: tuple[str, ...]) -> Scheduler:
        s = make_scheduler(tok, True)
        for rid in rids:
            schema = SCHEMAS["j3"] if rid == "x" else SCHEMAS["j1"]
            add(s, rid, [3, 4, 6 + len(rid)], max_new=60, json_schema=json.dumps(schema))
        return compiled(s)  # else `x` may be admitted alone first and end (10 tokens) in the step it is aborted in

    s = build(("a", "bb", "x"))
    early = []
    for _ in range(40):  # until a constrained decode is in flight, launched ahead
        early += s.step()
        if launched_ahead_with_mask(s):
            break
    assert s._in_flight is not None and {it.req.rid for it in s._in_flight[0]} == {"a", "bb", "x"}
    assert s.abort("x")
    got = run(s)
    for out in early:
        got.setdefault(out.rid, {"ids": []})["ids"][:0] = out.new_ids
    want = run(build(("a", "bb")))
    assert got["a"]["ids"] == want["a"]["ids"] and got["bb"]["ids"] == want["bb"]["ids"]
    assert got["x"]["finish"] == {"type": "abort"}
    assert s.metrics.aborted_requests == 1 and s.flush_cache()


def test_a_one_off_failure_of_a_constrained_step_launched_ahead_changes_no_output(tok):
    from test_scheduler import FailingRunner, _with_runner

    failed: list[int] = []

    def poisoned(req) -> bool:  # once, when the batch holding j1's 4th token was launched ahead
        if req.rid == "j1" and len(req.output_ids) == 3 and not failed:
            failed.append(1)
            return True
        return False

    def build(overlap: bool) -> Scheduler:
        s = make_scheduler(tok, overlap)
        for i, rid in enumerate(("j0", "j1", "j3")):
            add(s, rid, [3, 4, 6 + i], max_new=60, json_schema=json.dumps(SCHEMAS[rid]))
        add(s, "p0", PLAIN["p0"], max_new=25)
        return s

    want = run(build(False))
    s = build(True)
    _with_runner(s, FailingRunner(poisoned, vocab_size=VOCAB, eos_token_ids=(EOS,)))
    got = run(s)
    assert failed and got == want
    assert s.stats()["failed_requests"] == 0 and s.flush_cache()


def test_an_early_mask_fill_keeps_the_outputs_of_overlap_off_also_when_that_launch_fails(tok, monkeypatch):
    """Tokens already on the host when the next decode is launched (the host is the slower side):
    the mask thread accepts them and fills the next mask while the launch is prepared. Outputs as
    overlap off; when that launch fails, the tokens the matchers took are appended first (outputs
    and matchers agree when the requests run again)."""
    from radixserve.state import LaunchedBatch
    from radixserve.testing import ToyRunner
    from test_scheduler import _with_runner

    marker, k = free_marker(tok)

    def add_requests(s: Scheduler) -> Scheduler:
        for i, rid in enumerate(("j1", "j3")):
            add(s, rid, [3, 4, 6 + i], max_new=60, json_schema=json.dumps(SCHEMAS[rid]))
        add(s, "after", PROMPT, max_new=60, regex=REGEX, grammar_after=marker)  # its rows filled late
        add(s, "p0", PLAIN["p0"], max_new=25)
        return s

    want = run(add_requests(make_scheduler(tok, False)))
    monkeypatch.setattr(LaunchedBatch, "done", lambda self: True)  # the toy computes at launch
    early, failed = [], []
    accept_and_fill = Scheduler._accept_and_fill_early
    monkeypatch.setattr(Scheduler, "_accept_and_fill_early", lambda self, *a: early.append(1) or accept_and_fill(self, *a))

    class LaunchFails(ToyRunner):
        def launch_batch(self, sb):  # once: the decode after the one making j1's 4th token
            if sb.future_inputs is not None and not failed and any(r.rid == "j1" and len(r.output_ids) == 3
                                                                   for r in sb.reqs):
                failed.append(1)
                raise RuntimeError("injected: the launch failed")
            return super().launch_batch(sb)

    s = make_scheduler(tok, True)
    s.fill_beside_processing = True
    _with_runner(s, LaunchFails(vocab_size=VOCAB, eos_token_ids=(EOS,)))
    got = run(add_requests(s))
    assert failed and len(early) >= 10
    assert got == want
    assert set(json.loads(text(tok, got["j1"]["ids"]))) == {"name", "ok"}
    assert re.fullmatch(REGEX, text(tok, got["after"]["ids"][k:]))
    assert got["p0"]["ids"] == toy_reference(PLAIN["p0"], 25, VOCAB, frozenset({EOS}))
    assert s.stats()["failed_requests"] == 0 and s.flush_cache()


# ---- the real ModelRunner (tiny random Llama, CPU) ----------------------------------------------

TINY_VOCAB = 512


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    cfg = Config.build({
        "model": {"path": tiny_llama_dir("llama")},
        "runtime": {"device": "cpu", "num_threads": 1},
        "scheduler": {"max_total_tokens": 2048, "max_running_requests": 8},
    })
    return ModelRunner(cfg, show_progress=False)


def serve(runner, tok, overlap: bool) -> tuple[dict[str, dict], Scheduler]:
    config = Config.build({"runtime": {"overlap": overlap}, "scheduler": {"max_total_tokens": 2048}})
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    service = GrammarService("xgrammar", lambda: XGrammarBackend(tok, TINY_VOCAB, [EOS]))
    s = Scheduler(config, runner, cache, reg.load("policy", "fcfs")(), tok, grammar=service)
    sp = dict(max_new_tokens=40, temperature=0, ignore_eos=True)
    for i, rid in enumerate(["j1", "j2", "j3"]):
        s.add_request(GenerateRequest(rid=rid, input_ids=[5, 9, 13 + i],
                                      sampling_params=SamplingParams(**sp, json_schema=json.dumps(SCHEMAS[rid]))))
    s.add_request(GenerateRequest(rid="r1", input_ids=[6, 6, 2], sampling_params=SamplingParams(**sp, regex=REGEXES["r1"])))
    for i in range(2):
        s.add_request(GenerateRequest(rid=f"p{i}", input_ids=[8, 3 + i, 4], sampling_params=SamplingParams(**sp)))
    return run(s), s


def test_the_model_runner_gives_the_same_constrained_outputs_with_overlap_on_and_off(runner, tok, monkeypatch):
    assert runner.vocab_size == TINY_VOCAB
    want, first = serve(runner, tok, overlap=False)
    assert first.flush_cache()  # both schedulers share the runner's allocator: the second starts with every slot free
    masked_ahead = []
    launch = runner.launch_batch

    def recording_launch(sb):
        masked_ahead.append(sb.future_inputs is not None and sb.token_bitmask is not None)
        return launch(sb)

    monkeypatch.setattr(runner, "launch_batch", recording_launch)
    # the steps still alive before each step: a processed step must not be kept by the next one
    # (the runner's result closure keeps its batch, whose mask's ready() keeps the step before it)
    steps, alive = weakref.WeakSet(), []
    init, step = scheduler_module._PrevStep.__init__, Scheduler.step
    monkeypatch.setattr(scheduler_module._PrevStep, "__init__", lambda self, *a: init(self, *a) or steps.add(self))
    monkeypatch.setattr(Scheduler, "step", lambda self: alive.append(len(steps)) or step(self))
    got, s = serve(runner, tok, overlap=True)
    assert sum(masked_ahead) >= 5  # constrained decodes were launched ahead
    assert max(alive) <= 2, alive
    assert got == want
    for rid in ("j1", "j2", "j3"):
        assert got[rid]["finish"]["type"] == "stop", got[rid]
        json.loads(text(tok, got[rid]["ids"]))
    assert re.fullmatch(REGEXES["r1"], text(tok, got["r1"]["ids"]))
    assert len(got["p0"]["ids"]) == 40 and len(got["p1"]["ids"]) == 40
    assert s.metrics.overlapped_batches > 0 and s.flush_cache()


def test_waiting_for_the_mask_on_another_thread_is_refused_not_raced(tok, caplog):
    """A runner that calls token_bitmask_ready() off the launching thread would process the previous
    step concurrently with the scheduler: such batches fail with an error that says so (and the
    failure isolation re-runs the request, whose output stays valid)."""
    from concurrent.futures import ThreadPoolExecutor

    from radixserve.testing import ToyRunner
    from test_scheduler import _with_runner

    class OtherThreadRunner(ToyRunner):
        def launch_batch(self, sb):
            if sb.token_bitmask_ready is not None:
                with ThreadPoolExecutor(1) as pool:
                    pool.submit(sb.token_bitmask_ready).result()
            return super().launch_batch(sb)

    s = make_scheduler(tok, True)
    _with_runner(s, OtherThreadRunner(vocab_size=VOCAB, eos_token_ids=(EOS,)))
    add(s, "j1", [3, 4, 6], max_new=60, json_schema=json.dumps(SCHEMAS["j1"]))
    got = run(s)
    assert set(json.loads(text(tok, got["j1"]["ids"]))) == {"name", "ok"}
    assert "must be called on the thread that called launch_batch" in caplog.text
