"""Structured output below the HTTP layer: the grammar kind's conformance kit on both backends, the
bitmask masking, the stack key, request validation, and the scheduler on the toy runner (masking,
compile errors, batching with unconstrained requests, chunked prefill, retraction, overlap)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from radixserve.config import Config
from radixserve.interfaces import KINDS, GrammarBackend, GrammarError
from radixserve.interfaces.grammar import apply_bitmask_torch
from radixserve.plugins.registry import PluginError, Registry
from radixserve.plugins.stack import resolve_stack
from radixserve.runtime.messages import GenerateRequest
from radixserve.scheduler import Scheduler
from radixserve.scheduler.grammar import GrammarService
from radixserve.state import SamplingParams
from radixserve.testing import ToyRunner, check_grammar_backend, tiny_tokenizer, toy_reference
from radixserve.validation import InvalidRequest, ModelLimits, sampling_from_dict
from radixserve_grammar_llguidance.backend import LLGuidanceBackend
from radixserve_grammar_xgrammar.backend import XGrammarBackend

BACKENDS = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend}
VOCAB = 1000
EOS = 0  # the tiny tokenizer's </s>


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


# ---- the kind and its conformance kit --------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backend_passes_the_conformance_kit(name, tok):
    check_grammar_backend(BACKENDS[name], tok)


class _AllowsEverything(XGrammarBackend):
    """A broken backend: its matchers never mask anything."""

    def new_matcher(self, compiled):
        m = super().new_matcher(compiled)

        class Loose(type(m)):
            def fill_bitmask(self, bitmask, row):
                bitmask[row] = -1

        m.__class__ = Loose
        return m


class _NoOpApply(XGrammarBackend):
    def apply_bitmask_inplace(self, logits, bitmask):
        return None


class _BatchFillOffByOne(XGrammarBackend):
    """A broken batch fill: each matcher's mask lands in the row after its own."""

    def fill_bitmasks(self, bitmask, rows):
        super().fill_bitmasks(bitmask, [(row + 1, m) for row, m in rows])


@pytest.mark.parametrize("broken", [_AllowsEverything, _NoOpApply, _BatchFillOffByOne])
def test_the_kit_catches_a_broken_backend(broken, tok):
    with pytest.raises(AssertionError, match="fill_bitmasks" if broken is _BatchFillOffByOne else None):
        check_grammar_backend(broken, tok, seeds=1)


class _RollsBackOneToken(XGrammarBackend):
    """Grammar audit 34: a rollback that always undoes one token passed the kit, which only ever rolled back one."""

    def new_matcher(self, compiled):
        m = super().new_matcher(compiled)
        real = m.rollback
        m.rollback = lambda n: real(min(n, 1))
        return m


def test_the_kit_rolls_back_several_tokens_at_once(tok):
    with pytest.raises(AssertionError, match=r"rollback\([23]\) did not restore the state"):
        check_grammar_backend(_RollsBackOneToken, tok, seeds=2)


def _masking(clear):
    """An xgrammar backend whose masks also clear the tokens `clear(allowed, stops, texts, token)` picks."""

    class Masking(XGrammarBackend):
        def fill_bitmasks(self, bitmask, rows):  # row by row, through the narrowed matchers
            GrammarBackend.fill_bitmasks(self, bitmask, rows)

        def new_matcher(self, compiled):
            m = super().new_matcher(compiled)
            texts = [self.tokenizer.decode([t]) for t in range(len(self.tokenizer))]
            stops = set(self.stop_token_ids)

            class Narrowed(type(m)):
                def fill_bitmask(self, bitmask, row):
                    super().fill_bitmask(bitmask, row)
                    allowed = [t for t in range(len(texts)) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1]
                    for t in allowed:
                        if clear(allowed, stops, texts, t):
                            bitmask[row, t // 32] = int(bitmask[row, t // 32]) & ~(1 << (t % 32))

            m.__class__ = Narrowed
            return m

    return Masking


# the outside audit's two bugs the kit let through, and a backend that skips half-character tokens
_STOP_ONLY_WHEN_FORCED = _masking(lambda allowed, stops, texts, t: t in stops and set(allowed) - stops)
_NEVER_THE_NO_BRANCH = _masking(lambda allowed, stops, texts, t: texts[t].startswith("n")
                                and any(texts[a].startswith("y") for a in allowed))
_SKIPS_PARTIAL_UTF8 = _masking(lambda allowed, stops, texts, t: "\ufffd" in texts[t])


@pytest.mark.parametrize("broken, words", [
    (_STOP_ONLY_WHEN_FORCED, r"regex '\[0-9\]\+'.*drops a stop token, although the output is a complete match"),
    (_NEVER_THE_NO_BRANCH, r"regex '\(yes\|no\)!'.*after b'' the mask drops valid continuations"),
    (_SKIPS_PARTIAL_UTF8, r"regex '\(é\|ü\)\{1,3\}!'"),
], ids=["stop-held-back", "branch-dropped", "byte-tokens-skipped"])
def test_the_kit_checks_each_mask_against_its_reference(broken, words, tok):
    with pytest.raises(AssertionError, match=words):
        check_grammar_backend(broken, tok, seeds=1)


def test_the_kits_reference_mask(tok):
    """What the kit holds a mask to: every viable token, the stop token after a complete match even
    if it could go on, byte tokens of a two-byte character, and the text a constraint forces."""
    from radixserve.testing.grammar_reference import RegexReference

    def names(ids):
        return sorted(tok.convert_ids_to_tokens(t) for t in ids)

    digits = RegexReference(r"[0-9]+", tok, [EOS])
    assert EOS not in digits.allowed(b"") and EOS in digits.allowed(b"1") and "2" in names(digits.allowed(b"1"))
    yes_no = RegexReference(r"(yes|no)!", tok, [EOS])
    assert {"y", "yes", "n", "no"} <= set(names(yes_no.allowed(b""))) and yes_no.forced(b"") == b""
    assert yes_no.forced(b"y") == b"es!" and yes_no.allowed(b"yes!") == {EOS}
    accents = RegexReference(r"(é|ü){1,3}!", tok, [EOS])
    half = tok.convert_tokens_to_ids("Ã")  # the byte 0xC3, the first of both characters
    assert half in accents.allowed(b"") and accents.forced(b"") == b"\xc3"
    assert tok.convert_tokens_to_ids("©") in accents.allowed(b"\xc3")  # 0xA9: "é"


def test_xgrammar_fills_a_large_batch_in_one_parallel_call_with_the_per_row_result(tok, monkeypatch):
    from radixserve_grammar_xgrammar import backend as xb

    monkeypatch.setattr(xb, "_fill_threads", lambda: 2)  # real threads even on a 2-core machine
    b = XGrammarBackend(tok, len(tok), [tok.eos_token_id])
    compiled = b.compile("json_schema", json.dumps({"type": "object", "properties": {"a": {"enum": [1, 2]}}}))
    matchers = [b.new_matcher(compiled) for _ in range(12)]
    for m in matchers[::2]:  # half of them one token in: different masks
        assert m.accept_token(tok.encode("{", add_special_tokens=False)[0])
    rows = [(2 * i, m) for i, m in enumerate(matchers)]
    got, want = b.allocate_bitmask(24), b.allocate_bitmask(24)
    b.fill_bitmasks(got, rows)
    assert b._batch is not None, "12 rows must take xgrammar's batch path"
    for row, m in rows:
        m.fill_bitmask(want, row)
    assert torch.equal(got, want)
    assert not torch.equal(got[0], got[2])


def test_grammar_is_a_plugin_kind_with_both_backends_registered():
    assert "grammar" in KINDS
    reg = Registry.discover()
    assert reg.names("grammar")[:2] == ["xgrammar", "llguidance"]  # priority order: xgrammar is the default
    assert issubclass(reg.load("grammar", "llguidance"), GrammarBackend)


def test_reference_bitmask_masks_exactly_the_cleared_bits():
    vocab = 70
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[1, 2] = 1 << 5  # token 69
    logits = torch.zeros(2, vocab + 2)
    apply_bitmask_torch(logits, bitmask, vocab)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2, 70, 71]  # padding untouched
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [69, 70, 71]


# ---- configuration and validation ------------------------------------------------------------


def test_stack_grammar_defaults_to_xgrammar_and_can_be_off_or_named():
    reg = Registry.discover()
    assert resolve_stack(Config.build({}), reg, "cpu").grammar.name == "xgrammar"
    assert resolve_stack(Config.build({"stack": {"grammar": "none"}}), reg, "cpu").grammar is None
    assert resolve_stack(Config.build({"stack": {"grammar": "llguidance"}}), reg, "cpu").grammar.name == "llguidance"
    with pytest.raises(PluginError, match="no grammar component named 'outlines'.*xgrammar"):
        resolve_stack(Config.build({"stack": {"grammar": "outlines"}}), reg, "cpu")


def test_the_grammar_backend_is_built_after_the_models_tokenizer_is_loaded(tok):
    """Chaos audit 32: a fresh server's first grammar backend imported xgrammar (which imports transformers)
    while the scheduler's thread loaded the tokenizer; transformers' first import is not thread-safe and
    structured output failed for the server's life. The tokenizer's load (one at a time, under a lock)
    comes first, so transformers is whole before the backend's import runs."""
    from radixserve.scheduler.scheduler import grammar_service

    order = []
    reg = Registry.discover()

    class Runner:
        device, vocab_size, eos_token_ids, model_path = "cpu", 300, (0,), ""

        @property
        def tokenizer(self):
            order.append("tokenizer")
            return tok

    class Recording:
        def __getattr__(self, name):
            return getattr(reg, name)

        def load(self, kind, name):
            order.append(f"load {kind}")
            return reg.load(kind, name)

    service = grammar_service(Config.build({}), Runner(), Recording())
    assert service.backend() is not None
    assert order == ["tokenizer", "load grammar"]


@pytest.mark.parametrize(
    "params, field",
    [
        ({"json_schema": "{not json"}, "sampling_params.json_schema"),
        ({"json_schema": "[1, 2]"}, "sampling_params.json_schema"),
        ({"regex": "a+", "ebnf": 'root ::= "a"'}, "sampling_params.ebnf"),
        ({"regex": ""}, "sampling_params.regex"),
        ({"regex": 5}, "sampling_params.regex"),
        # fuzz audit 31: a grammar with no end, which the backends compiled; the request then ended in an abort
        ({"json_schema": {"$ref": "#"}}, "sampling_params.json_schema"),
        ({"json_schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
         "sampling_params.json_schema"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(params, field):
    with pytest.raises(InvalidRequest) as e:
        sampling_from_dict(params, ModelLimits())
    assert e.value.param == field


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"child": {"$ref": "#"}}},  # recursion with a base case: fine
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
])
def test_recursive_schemas_that_can_end_are_accepted(schema):
    sampling_from_dict({"json_schema": schema}, ModelLimits())


def test_generate_accepts_a_schema_given_as_an_object():
    sp = sampling_from_dict({"json_schema": {"type": "object"}}, ModelLimits())
    assert json.loads(sp.json_schema) == {"type": "object"}


# ---- the scheduler on the toy runner ---------------------------------------------------------


def make_scheduler(tok, backend="xgrammar", overlap=False, **scheduler) -> Scheduler:
    runner = ToyRunner(vocab_size=VOCAB, eos_token_ids=(EOS,), **scheduler.pop("runner", {}))
    config = Config.build({"scheduler": scheduler, "runtime": {"overlap": overlap}})
    cls = BACKENDS[backend]
    service = GrammarService(backend, lambda: cls(tok, VOCAB, [EOS]))
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    return Scheduler(config, runner, cache, reg.load("policy", "fcfs")(), tok, grammar=service)


def run(s: Scheduler, max_steps: int = 5000) -> dict[str, dict]:
    got: dict[str, dict] = {}
    for _ in range(max_steps):
        if not s.has_work():
            break
        for out in s.step():
            r = got.setdefault(out.rid, {"ids": [], "error": None, "finish": None})
            r["ids"].extend(out.new_ids)
            r["error"] = r["error"] or out.error
            r["finish"] = out.finished_reason or r["finish"]
    assert not s.has_work(), "the scheduler still has work"
    return got


def compiled(s: Scheduler) -> Scheduler:
    """`s` once every grammar it was given has compiled. Tests that count batches, steps or
    retractions depend on which requests are admitted together: with compiles finishing at
    different times (a loaded machine: CI, session 37) requests are admitted apart."""
    for fut, _ in list(s._grammar_pending.values()):
        fut.result(timeout=60)
    return s


def add(s: Scheduler, rid: str, prompt: list[int], max_new: int = 40, **constraint) -> None:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0, **constraint)
    s.add_request(GenerateRequest(rid=rid, input_ids=prompt, sampling_params=sp))


def text(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t != EOS])


SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"type": "boolean"}}, "required": ["a", "b"],
          "additionalProperties": False}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_constrained_rows_follow_their_grammar_and_others_are_unchanged(tok, backend, overlap):
    s = make_scheduler(tok, backend, overlap)
    plain = {f"p{i}": [7 + i, 30, 40 + i, 5] for i in range(3)}
    for rid, prompt in plain.items():
        add(s, rid, prompt, max_new=25)
    add(s, "re", [3, 4, 5], regex=r"(yes|no)! [a-c]{3}")
    add(s, "js", [3, 4, 6], json_schema=json.dumps(SCHEMA))
    got = run(s)
    for rid, prompt in plain.items():  # the toy's own greedy output, masks or not in the same batches
        assert got[rid]["ids"] == toy_reference(prompt, 25, VOCAB, frozenset({EOS}))
    assert re.fullmatch(r"(yes|no)! [a-c]{3}", text(tok, got["re"]["ids"]))
    value = json.loads(text(tok, got["js"]["ids"]))
    assert value["a"] in (1, 2) and isinstance(value["b"], bool) and set(value) == {"a", "b"}
    assert got["re"]["finish"]["type"] == "stop" and got["js"]["finish"]["type"] == "stop"


def test_speculation_pauses_while_a_constrained_request_runs(tok):
    """A verify scores several tokens per request but the grammar mask has one row per request:
    steps with a constrained request decode plainly; outputs are those without speculation."""
    from radixserve.testing import drafter_info
    from test_speculative_scheduler import ToyDrafter

    runner = ToyRunner(vocab_size=VOCAB, eos_token_ids=(EOS,))
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    service = GrammarService("xgrammar", lambda: XGrammarBackend(tok, VOCAB, [EOS]))
    drafter = ToyDrafter(drafter_info(vocab_size=VOCAB, num_draft_tokens=4), mode="right")
    s = Scheduler(Config.build({}), runner, cache, reg.load("policy", "fcfs")(), tok, drafter=drafter, grammar=service)
    add(s, "plain", [7, 30, 40, 5], max_new=60)
    add(s, "js", [3, 4, 6], json_schema=json.dumps(SCHEMA))
    got = run(s)
    assert got["plain"]["ids"] == toy_reference([7, 30, 40, 5], 60, VOCAB, frozenset({EOS}))
    value = json.loads(text(tok, got["js"]["ids"]))
    assert value["a"] in (1, 2) and isinstance(value["b"], bool)
    assert s.metrics.spec_verifies > 0  # the plain request drafted once the constrained one finished


def test_invalid_constraint_ends_only_that_request_with_a_400_message(tok):
    s = make_scheduler(tok)
    add(s, "bad", [1, 2, 3], regex="a(b")
    add(s, "ok", [1, 2, 4], max_new=5)
    got = run(s)
    assert got["bad"]["error"].startswith("regex: invalid regex:") and not got["bad"]["ids"]
    assert got["ok"]["ids"] == toy_reference([1, 2, 4], 5, VOCAB, frozenset({EOS}))


@pytest.mark.parametrize(("kind", "text", "where"), [
    ("regex", "\x00", "the regex"),
    ("regex", "a\x00b", "the regex"),  # compiled, but cut at the NUL: "a" then stop, not matching the regex
    ("json_schema", json.dumps({"type": "string", "pattern": "\x00"}), "the pattern at /pattern"),
    ("json_schema", json.dumps({"type": "object", "patternProperties": {"\x00": {"type": "string"}}}),
     "the pattern at /patternProperties"),
])
def test_a_raw_nul_in_a_pattern_is_refused_before_xgrammar_sees_it(tok, kind, text, where):
    """Fuzz audit 31: xgrammar's compiler killed the scheduler process (SIGSEGV) on a raw NUL in a regex or a
    schema pattern; the escape \\x00 compiles."""
    backend = XGrammarBackend(tok, VOCAB, [EOS])
    with pytest.raises(GrammarError, match=f"{where} holds a raw NUL character"):
        backend.compile(kind, text)
    backend.compile("regex", "a\\x00b")
    backend.compile("json_schema", json.dumps({"type": "string", "pattern": "^a\\x00$"}))


@pytest.mark.parametrize("name", ["\t", "\x1f", 'quote"', "back\\slash", "\nline"])
def test_a_property_name_xgrammar_cannot_write_is_refused_naming_it(tok, name):
    """Refuzz audit 31: a tab or U+001F in a property name came out raw (json.loads refused the output); a quote or
    a backslash was a lexer error about a line of xgrammar's own grammar."""
    backend = XGrammarBackend(tok, VOCAB, [EOS])
    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    with pytest.raises(GrammarError, match=r"property name .* \(at /properties\) holds a quote, a backslash or a "
                                           r"control character"):
        backend.compile("json_schema", json.dumps(schema))
    backend.compile("json_schema", json.dumps({"type": "object", "properties": {"名前 🎉": {"type": "integer"}}}))


def test_a_remote_ref_or_a_schema_nested_too_deeply_is_said_plainly(tok):
    """Refuzz audit 31: a remote $ref was dropped (the value unconstrained, a 200); 300 levels were a 400 in
    Python's RecursionError words."""
    backend = XGrammarBackend(tok, VOCAB, [EOS])
    remote = {"type": "object", "properties": {"v": {"$ref": "http://example.com/x.json"}}}
    with pytest.raises(GrammarError, match=r"the \$ref at /properties/v/\$ref is not a reference inside the schema"):
        backend.compile("json_schema", json.dumps(remote))
    deep: dict = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    with pytest.raises(GrammarError, match="the json_schema is nested too deeply for the xgrammar backend"):
        backend.compile("json_schema", json.dumps(deep))


def test_kind_the_backend_does_not_support_is_refused(tok):
    class RegexOnly(XGrammarBackend):
        supported_kinds = ("regex",)

    runner = ToyRunner(vocab_size=VOCAB, eos_token_ids=(EOS,))
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    service = GrammarService("regex-only", lambda: RegexOnly(tok, VOCAB, [EOS]))
    s = Scheduler(Config.build({}), runner, cache, reg.load("policy", "fcfs")(), tok, grammar=service)
    add(s, "e", [1, 2], ebnf='root ::= "a"')
    assert "does not support ebnf" in run(s)["e"]["error"]


def test_no_grammar_backend_is_a_400_naming_the_field(tok):
    runner = ToyRunner(vocab_size=VOCAB)
    s = Scheduler.from_config(Config.build({"stack": {"grammar": "none"}}), runner, Registry.discover())
    add(s, "j", [1, 2], json_schema='{"type": "object"}')
    err = run(s)["j"]["error"]
    assert err.startswith("json_schema:") and "no" in err and "grammar backend" in err


def _service_scheduler(tok, service: GrammarService) -> Scheduler:
    runner = ToyRunner(vocab_size=VOCAB, eos_token_ids=(EOS,))
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    return Scheduler(Config.build({}), runner, cache, reg.load("policy", "fcfs")(), tok, grammar=service)


def _errors(s: Scheduler) -> dict[str, tuple[str, int]]:
    """(error, status) of each refused request."""
    got = {}
    while s.has_work():
        for out in s.step():
            if out.error is not None:
                got[out.rid] = (out.error, out.error_status)
    return got


def test_a_backend_that_cannot_be_built_is_logged_once_and_named_per_field(tok, caplog):
    """An outside audit: a constructor that raised left no trace in the log, and the 400 named no
    field (param null)."""
    from radixserve.runtime.tokenizer_manager import _runtime_rejection

    def explode():
        raise RuntimeError("toy init exploded")

    s = _service_scheduler(tok, GrammarService("toy", explode))
    with caplog.at_level("ERROR", logger="radixserve.scheduler.grammar"):
        add(s, "r", [1, 2], regex="a+")
        add(s, "j", [1, 3], json_schema='{"type": "object"}')
        got = _errors(s)
    assert got["r"] == ("regex: the grammar backend 'toy' is unavailable: toy init exploded", 400)
    assert got["j"][0].startswith("json_schema: the grammar backend 'toy' is unavailable")
    logged = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(logged) == 1 and "'toy' could not be built" in logged[0].getMessage()
    assert logged[0].exc_info and "toy init exploded" in str(logged[0].exc_info[1])
    assert _runtime_rejection(*got["r"]).param == "sampling_params.regex"


def test_a_compile_that_breaks_the_contract_is_a_500_not_the_inputs_fault(tok, caplog):
    """compile may raise only GrammarError: anything else is the backend's bug, a 500 for that
    request (not "regex: invalid regex: ValueError(...)", which blamed the input), logged."""

    class Buggy(XGrammarBackend):
        def compile(self, kind, text):
            if text == "a+":
                raise ValueError("toy compile bug")
            return super().compile(kind, text)

    s = _service_scheduler(tok, GrammarService("buggy", lambda: Buggy(tok, VOCAB, [EOS])))
    with caplog.at_level("ERROR", logger="radixserve.scheduler.grammar"):
        add(s, "bug", [1, 2], regex="a+")
        add(s, "bad", [1, 3], regex="a(b")
        add(s, "ok", [1, 4], regex="(yes|no)")
        got = _errors(s)
    error, status = got["bug"]
    assert status == 500 and "invalid regex" not in error and "failed while compiling" in error, got["bug"]
    assert got["bad"][1] == 400 and got["bad"][0].startswith("regex: invalid regex:")
    assert "ok" not in got
    assert any(r.exc_info and "toy compile bug" in str(r.exc_info[1]) for r in caplog.records)


def test_one_compile_thread_builds_the_backend_before_the_first_compile(tok):
    """stack.grammar_compile_threads=1: the backend's build was queued behind the first compile, which waited
    for it in the same one-thread pool: every constrained request hung."""
    service = GrammarService("xgrammar", lambda: XGrammarBackend(tok, VOCAB, [EOS]), threads=1)
    assert service.compile("regex", "a+").result(timeout=60) is not None


def test_a_constraint_slower_than_the_compile_timeout_ends_its_request_not_the_others(tok):
    """A compile that never returns (an adversarial regex) held its request, and with every thread busy every
    new constraint, forever: after stack.grammar_compile_timeout_s the slow one is a 400, one queued behind it a
    503, while a request without a constraint and a cached constraint are served (audit leftovers 31-33)."""
    import threading

    release = threading.Event()

    class Stuck(XGrammarBackend):
        def compile(self, kind, text):
            if text == "(ab)+c":  # stands for an adversarial regex (one that would really take minutes here)
                release.wait(30)
            return super().compile(kind, text)

    service = GrammarService("stuck", lambda: Stuck(tok, VOCAB, [EOS]), threads=1)
    runner = ToyRunner(vocab_size=VOCAB, eos_token_ids=(EOS,))
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    s = Scheduler(Config.build({"stack": {"grammar_compile_timeout_s": 0.5}}), runner, cache,
                  reg.load("policy", "fcfs")(), tok, grammar=service)
    try:
        add(s, "slow", [1, 2], regex="(ab)+c")
        add(s, "queued", [1, 3], regex="(yes|no)")
        add(s, "plain", [1, 4])
        got = _errors(s)
    finally:
        release.set()
    assert got["slow"][1] == 400 and got["slow"][0].startswith("regex: the constraint did not compile within 0.5 s "
                                                               "(stack.grammar_compile_timeout_s; it was compiling for")
    assert got["queued"][1] == 503 and "was not compiled within 0.5 s: it waited 0.5 s for a compile thread" in \
        got["queued"][0], got["queued"]
    assert "plain" not in got
    service.compile("regex", "(yes|no)").result(timeout=30)  # the queued compile still ran: later requests use it
    add(s, "later", [1, 5], regex="(yes|no)")
    assert _errors(s) == {}


def test_a_timeout_blames_the_constraint_only_when_its_own_compile_took_most_of_it():
    """Grammar audit 34: a 1 s compile that had waited 7 s for a thread was told to simplify itself (a 400)."""
    import time as clock
    from types import SimpleNamespace

    from radixserve.scheduler.grammar import grammar_timeout_refusal

    waited = SimpleNamespace(compile_started=[clock.monotonic() - 1.0])
    message, status = grammar_timeout_refusal("regex", waited, 8.0)
    assert status == 503 and "it waited 7.0 s for a compile thread or the grammar backend" in message, message
    slow = SimpleNamespace(compile_started=[clock.monotonic() - 6.0])
    message, status = grammar_timeout_refusal("regex", slow, 8.0)
    assert status == 400 and "it was compiling for 6.0 s of them" in message and "simplify it" in message


def test_a_token_the_matcher_refuses_after_its_mask_allowed_it_leaves_the_output(tok, caplog):
    """Grammar audit 34: a backend whose accept_token refused a token its mask allowed ended the request with
    `abort`, but the refused token stayed in the text, which then broke the constraint."""

    class Refuses(XGrammarBackend):
        def new_matcher(self, compiled):
            matcher = super().new_matcher(compiled)
            real = matcher.accept_token
            seen = []

            def accept(token):
                seen.append(token)
                return real(token) if len(seen) < 3 else False  # the third token: refused

            matcher.accept_token = accept
            return matcher

        def accept_tokens(self, matchers, tokens):  # one by one, so the refusal above is what the core sees
            return [m.accept_token(t) for m, t in zip(matchers, tokens, strict=True)]

    s = _service_scheduler(tok, GrammarService("refuses", lambda: Refuses(tok, VOCAB, [EOS])))
    add(s, "r", [1, 2], regex="[a-z]{10}")
    outs = []
    with caplog.at_level("ERROR"):
        while s.has_work():
            outs += s.step()
    ids = [t for o in outs if o.rid == "r" for t in o.new_ids]
    final = [o for o in outs if o.rid == "r" and o.finished_reason][-1]
    assert final.finished_reason["type"] == "abort" and len(ids) == 2, (ids, final.finished_reason)
    assert any("refused token" in r.getMessage() for r in caplog.records)


def test_a_matcher_that_cannot_start_is_a_500_too(tok):
    class NoMatchers(XGrammarBackend):
        def new_matcher(self, compiled):
            raise RuntimeError("no matcher today")

    s = _service_scheduler(tok, GrammarService("nomatch", lambda: NoMatchers(tok, VOCAB, [EOS])))
    add(s, "r", [1, 2], regex="a+")
    error, status = _errors(s)["r"]
    assert status == 500 and "no matcher today" in error


def test_identical_constraints_compile_once(tok):
    calls = []

    class Counting(XGrammarBackend):
        def compile(self, kind, text):
            calls.append(text)
            return super().compile(kind, text)

    runner = ToyRunner(vocab_size=VOCAB, eos_token_ids=(EOS,))
    reg = Registry.discover()
    cache = reg.load("prefix_cache", "radix")(runner.req_to_token_pool, runner.token_allocator)
    service = GrammarService("counting", lambda: Counting(tok, VOCAB, [EOS]))
    s = Scheduler(Config.build({}), runner, cache, reg.load("policy", "fcfs")(), tok, grammar=service)
    for i in range(4):
        add(s, f"r{i}", [1, 2, i + 3], regex="(yes|no)")
    got = run(s)
    assert calls == ["(yes|no)"]
    assert all(text(tok, got[f"r{i}"]["ids"]) in ("yes", "no") for i in range(4))


def test_chunked_prefill_and_retraction_keep_the_grammar_state(tok):
    # 160 KV slots for 8 requests admitted optimistically (a tiny reservation for future tokens):
    # prompts are prefilled in 8-token chunks and decode runs out of memory and must retract
    s = make_scheduler(tok, chunked_prefill_size=8, schedule_conservativeness=0.05, runner={"max_total_tokens": 160})
    pattern = r"\((yes|no)(, (yes|no)){8,12}\)"
    prompts = {f"r{i}": [10 + i] * 3 + list(range(20, 32)) for i in range(8)}
    for rid, prompt in prompts.items():
        add(s, rid, prompt, max_new=100, regex=pattern)
    got = run(compiled(s))  # all 8 admitted together, as the retraction needs
    for rid in prompts:
        assert got[rid]["error"] is None
        assert re.fullmatch(pattern, text(tok, got[rid]["ids"])), got[rid]
    assert s.metrics.retractions > 0, "the pool was meant to force retraction"
    assert s.flush_cache() and s.allocator.available_size() == s.allocator.size


def test_abort_while_the_grammar_compiles(tok):
    s = make_scheduler(tok)
    add(s, "a", [1, 2], regex="[a-z]{1,3}")
    assert s.abort("a")
    got = run(s)
    assert got["a"]["finish"] == {"type": "abort"}


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_keywords_a_backend_cannot_enforce_are_refused_not_ignored(name, tok):
    backend = BACKENDS[name](tok, VOCAB, [EOS])
    for keyword, schema in [
        ("uniqueItems", {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}),
        ("not", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
        ("if", {"if": {"type": "integer"}, "then": {"minimum": 5}}),
    ]:
        with pytest.raises(GrammarError, match=keyword):
            backend.compile("json_schema", json.dumps(schema))
    # the same words as property names or enum values are data, not keywords
    fine = {"type": "object", "properties": {"not": {"enum": ["if", "uniqueItems"]}}, "required": ["not"]}
    assert backend.compile("json_schema", json.dumps(fine)) is not None


@pytest.mark.parametrize("schema, reason", [
    ({"type": "object", "properties": {"builtin": {"type": "object", "enum": ["MODIFIABLE", "DELETABLE"]}}},
     "not of the declared type object"),
    ({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["id", "name"]},
     "'id' that is not declared"),
    ({"type": "object", "properties": {"updatedAt": {"type": "string"}},
      "patternProperties": {"^[a-zA-Z]+$": {"type": "number"}}}, "both `properties` and `patternProperties`"),
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 3}}},
     "`pattern` together with `maxLength`"),
    # outside reports: "175", "1,5" and 1.08 came back for these, finish_reason "stop"
    ({"type": "number", "minimum": 0.5, "maximum": 1.5}, "a number with both `minimum` and `maximum`"),
    ({"type": "object", "properties": {"p": {"minimum": 0, "maximum": 1}}}, "a number with both"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 99}}, "contains"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}, "additionalProperties": {"type": "integer"}},
     "propertyNames"),
])
def test_xgrammar_refuses_constructs_it_compiles_but_does_not_enforce(schema, reason, tok):
    """Each of these made SmolLM2 write invalid JSON for a real corpus schema
    (benchmarks/results/cpu-structured-output.md): refused with the construct named, not answered."""
    backend = BACKENDS["xgrammar"](tok, VOCAB, [EOS])
    with pytest.raises(GrammarError, match=re.escape(reason)):
        backend.compile("json_schema", json.dumps(schema))
    fine = {"type": "object", "properties": {"kind": {"type": "string", "enum": ["a", "b"]}, "n": {"type": "integer",
            "enum": [1, 2.0]}, "i": {"type": "integer", "minimum": 0, "maximum": 5},
            "x": {"type": "number", "minimum": 0.5}}, "required": ["kind"],
            "anyOf": [{"required": ["kind"], "properties": {"n": {}}}]}
    assert backend.compile("json_schema", json.dumps(fine)) is not None


@pytest.mark.parametrize("additional", [True, {"type": "integer"}, {}])
def test_xgrammar_never_writes_a_declared_property_through_additional_properties(additional):
    """xgrammar generates an `additionalProperties` property under any name, declared ones included:
    SmolLM2 wrote `"status": 200` for a declared string enum on 5 corpus schemas. The backend narrows
    such objects to their declared properties (valid for the original schema) before compiling."""
    from radixserve_grammar_xgrammar.backend import json_schema_grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema = {"type": "object", "properties": {"status": {"type": "string", "enum": ["draft", "done"]},
                                               "tags": {"type": "object", "properties": {"a": {"type": "boolean"}},
                                                        "additionalProperties": additional}},
              "additionalProperties": additional}
    grammar = json_schema_grammar(json.dumps(schema))
    assert accepts(grammar, '{"status": "draft", "tags": {"a": true}}')
    for bad in ('{"status": 200}', '{"status": "draft", "status": 5}', '{"tags": {"a": 1}}', '{"other": 1}'):
        assert not accepts(grammar, bad), bad
    # a free-form map (no declared properties) keeps its additional properties
    free = json_schema_grammar(json.dumps({"type": "object", "additionalProperties": {"type": "integer"}}))
    assert accepts(free, '{"x": 1, "y": 2}')


def test_xgrammar_rewrites_schemas_it_would_misread_into_ones_it_enforces():
    """Two more corpus failures, fixed by an equivalent schema rather than refused: a parent `type`
    that xgrammar ignores in `anyOf` branches without one (`{}` came out for a string), and an
    `enum` whose string bounds made xgrammar drop the enum ("SrI" for ["Jr", "Sr", ...])."""
    from radixserve_grammar_xgrammar.backend import json_schema_grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    typed = {"type": "object", "properties": {"s": {"type": "string", "anyOf": [{"pattern": "^a+$"}, {"format": "uri"}]}},
             "required": ["s"]}
    g = json_schema_grammar(json.dumps(typed))
    assert accepts(g, '{"s": "aaa"}') and not accepts(g, '{"s": {}}') and not accepts(g, '{"s": 1}')
    suffix = {"type": "object", "properties": {"x": {"type": "string", "enum": ["Jr", "Sr", "Md", "Toolong"],
                                                     "minLength": 1, "maxLength": 3}}}
    g = json_schema_grammar(json.dumps(suffix))
    assert accepts(g, '{"x": "Sr"}') and not accepts(g, '{"x": "SrI"}') and not accepts(g, '{"x": "Toolong"}')


def test_xgrammar_names_the_schema_root_and_refuses_an_empty_enum_plainly(tok):
    """An outside audit: "(at ; give one bound ...)" for root-level constructs, and `{"enum": []}`
    answered with xgrammar's internal "EBNF parser error at line 12"."""
    backend = BACKENDS["xgrammar"](tok, VOCAB, [EOS])
    for schema in ({"type": "number", "minimum": 0.5, "maximum": 1.5},
                   {"type": "object", "required": ["b"], "properties": {"a": {}}},
                   {"type": "string", "pattern": "a+", "maxLength": 3}, {"type": "string", "enum": [1]}):
        with pytest.raises(GrammarError) as e:
            backend.compile("json_schema", json.dumps(schema))
        assert "(at the schema root" in str(e.value) and "(at ;" not in str(e.value) and "(at )" not in str(e.value)
    for schema, where in (({"enum": []}, "/enum"), ({"type": "object", "properties": {"a": {"anyOf": []}}},
                                                   "/properties/a/anyOf")):
        with pytest.raises(GrammarError) as e:
            backend.compile("json_schema", json.dumps(schema))
        key = where.rsplit("/", 1)[1]
        assert str(e.value).startswith(f"{key} must not be empty (at {where})") and "EBNF" not in str(e.value)


@pytest.mark.parametrize("pattern, escape", [(r"^[\x00-\x1f]$", '"\\\\"'), (r'^[^"]*$', '"\\""'),
                                             (r'^[^\\]*$', '"\\\\"'), (r'^[^\n"]{1,4}$', '"\\""')])
def test_llguidance_patterns_it_would_escape_wrongly_are_refused(pattern, escape, tok):
    """llguidance 1.9 (derivre's json_quote) allows the escapes \\" and \\\\ in any character class that
    holds every control character: an outside audit got the JSON string "\\\\" (a backslash) for
    ^[\\x00-\\x1f]$, with finish_reason stop. The llguidance backend refuses such patterns."""
    import llguidance as llg

    assert not re.search(pattern, json.loads(escape))  # the pattern forbids the escaped character
    backend = BACKENDS["llguidance"](tok, VOCAB, [EOS])
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps({"type": "string", "pattern": pattern}),
                                                     defaults={"whitespace_flexible": False})
    raw = llg.LLMatcher(backend._tok, grammar)
    ids = tok.encode(escape, add_special_tokens=False)
    # the library still accepts it (once this fails, pattern_guard.py can go)
    assert raw.validate_tokens(ids) == len(ids) and all(raw.consume_token(t) for t in ids) and raw.is_accepting()
    nested = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    with pytest.raises(GrammarError, match=r"every control character.*\(at /properties/s/pattern\)|"
                                           r"\(at /properties/s/pattern\).*every control character"):
        backend.compile("json_schema", json.dumps(nested))
    # without the control characters the class is translated exactly: no escaped quote
    fine = backend.new_matcher(backend.compile("json_schema", json.dumps({"type": "string",
                                                                           "pattern": r'^[^"\x00-\x1f]*$'})))
    assert not all(fine.accept_token(t) for t in tok.encode('"\\""', add_special_tokens=False))


def test_xgrammar_errors_read_without_its_assertion_text(tok):
    # the 400 quoted xgrammar's C++ assertion ("Check failed: (!(start && end) || ...) is false: ...")
    backend = BACKENDS["xgrammar"](tok, VOCAB, [EOS])
    with pytest.raises(GrammarError) as e:
        backend.compile("json_schema", json.dumps({"type": "integer", "minimum": 5, "maximum": 1}))
    assert "minimum greater than maximum" in str(e.value) and "Check failed" not in str(e.value), str(e.value)


def test_resolve_json_pointer_follows_local_references_and_refuses_the_rest():
    from radixserve.interfaces.grammar import resolve_json_pointer

    schema = {"$defs": {"a/b": [{"type": "string"}, {"x~y": {"type": "integer"}}]}, "": {"type": "null"}}
    assert resolve_json_pointer(schema, "#") is schema
    assert resolve_json_pointer(schema, "#/$defs/a~1b/1/x~0y") == {"type": "integer"}  # RFC 6901 escapes, list index
    assert resolve_json_pointer(schema, "#/") == {"type": "null"}  # the empty key
    for ref, words in [("#/$defs/missing", "names nothing"), ("#/$defs/a~1b/2", "names nothing"),
                       ("other.json#/x", "not a JSON pointer"), ("#anchor", "not a JSON pointer"), (None, "not a JSON")]:
        with pytest.raises(LookupError, match=words):
            resolve_json_pointer(schema, ref)
