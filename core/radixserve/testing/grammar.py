"""Conformance kit for grammar backends (`GrammarBackend`), and a tiny tokenizer to run it with.

`check_grammar_backend(MyBackend, tokenizer)` drives the backend the way the scheduler does: it
compiles constraints, walks random valid outputs with the bitmask (a stop token when it is the only
choice, else half the time), checks that each output fullmatches its regex or parses and follows its
schema, that the mask of each regex-like case equals the reference's at every step (every valid
continuation allowed, the stop token whenever the output is a complete match, nothing else), that a
masked-out token is refused without changing the state, that `rollback` restores the state, that
bad constraints raise GrammarError, that `fill_bitmasks` over many rows equals per-row fills (and
`accept_tokens` per-row accepts), and that
`apply_bitmask_inplace` masks exactly the cleared bits.
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from radixserve.interfaces.grammar import GrammarBackend, GrammarError, apply_bitmask_torch, bitmask_width
from radixserve.testing.grammar_reference import RegexReference

# (kind, text, checker of the produced text)
_PERSON = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ann", "bob"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "ok", "tags"],
    "additionalProperties": False,
}


def _follows_person(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "ok", "tags"}
        and value["name"] in ("ann", "bob")
        and isinstance(value["ok"], bool)
        and isinstance(value["tags"], list)
        and 1 <= len(value["tags"]) <= 3
        and all(t in ("x", "y") for t in value["tags"])
    )


def _json_check(check):
    def run(text: str) -> bool:
        try:
            return check(json.loads(text))
        except ValueError:
            return False

    return run


CASES: list[tuple[str, str, Any]] = [
    ("regex", r"(yes|no)!", lambda s: re.fullmatch(r"(yes|no)!", s) is not None),
    ("regex", r"[a-c]{2,4}x[0-9]", lambda s: re.fullmatch(r"[a-c]{2,4}x[0-9]", s) is not None),
    ("json_schema", json.dumps(_PERSON), _json_check(_follows_person)),
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
                                "additionalProperties": False}),
     _json_check(lambda v: isinstance(v, dict) and v.get("a") in (1, 2) and set(v) == {"a"})),
    ("ebnf", 'root ::= "(" [0-9] ("+" [0-9])* ")"', lambda s: re.fullmatch(r"\([0-9](\+[0-9])*\)", s) is not None),
    # complete after one digit yet extendable: a stop token must be allowed from then on
    ("regex", r"[0-9]+", lambda s: re.fullmatch(r"[0-9]+", s) is not None),
    # characters of two bytes: each byte may be a token of its own, whose decode alone is U+FFFD
    ("regex", r"(é|ü){1,3}!", lambda s: re.fullmatch(r"(é|ü){1,3}!", s) is not None),
]
# the exact mask of these cases is checked at every step against grammar_reference.RegexReference
REFERENCE_REGEX = {
    ("regex", r"(yes|no)!"): r"(yes|no)!",
    ("regex", r"[a-c]{2,4}x[0-9]"): r"[a-c]{2,4}x[0-9]",
    ("ebnf", 'root ::= "(" [0-9] ("+" [0-9])* ")"'): r"\([0-9](\+[0-9])*\)",
    ("regex", r"[0-9]+"): r"[0-9]+",
    ("regex", r"(é|ü){1,3}!"): r"(é|ü){1,3}!",
}
INVALID = {"regex": "a(b", "json_schema": '{"type": "object", "properties": ', "ebnf": "root ::= ("}
MAX_STEPS = 120


def tiny_tokenizer():
    """A byte-level BPE `PreTrainedTokenizerFast` (~300 tokens) trained here on JSON-like text, with
    `</s>` (id 0) as its end-of-sequence token: enough to exercise multi-character tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        '{"name": "ann", "ok": true, "tags": ["x", "y"]}',
        '{"name": "bob", "ok": false, "tags": ["y"]}',
        "yes! no! abcx1 (1+2+3) [0, 1, 2] {\"a\": 1}",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def _allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    words = bitmask[row].tolist()
    return [t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1]


def _fill(matcher, bitmask: torch.Tensor, row: int = 0) -> torch.Tensor:
    bitmask[row] = 0x5A5A5A5A  # garbage: fill_bitmask must write every word of the row
    matcher.fill_bitmask(bitmask, row)
    return bitmask[row].clone()


def _walk(backend: GrammarBackend, compiled: Any, tokenizer: Any, stop: set[int], rng: random.Random, where: str,
          reference: RegexReference | None = None):
    """One random valid output; returns (token ids without the stop token, the matcher). A stop token
    ends it when it is the only choice, else half the time (complete outputs that can go on are
    walked on). With a `reference`, every mask must equal the reference's."""
    real_vocab = len(tokenizer)
    m = backend.new_matcher(compiled)
    bitmask = backend.allocate_bitmask(2)
    out: list[int] = []
    rows: list[torch.Tensor] = []  # the mask before each token of `out`
    for step in range(MAX_STEPS):
        row = _fill(m, bitmask, 1)
        assert torch.equal(row, _fill(m, bitmask, 1)), f"{where}: fill_bitmask changed the state (step {step})"
        allowed = _allowed(bitmask, 1, backend.vocab_size)
        assert allowed, f"{where}: no token allowed after {out}"
        assert all(t < real_vocab for t in allowed), f"{where}: a padding row past the tokenizer is allowed"
        if reference is not None:
            _check_mask(reference, out, set(allowed), tokenizer, where)
        stops = [t for t in allowed if t in stop]
        if stops and (len(stops) == len(allowed) or rng.random() < 0.5):
            assert m.accept_token(stops[0]), f"{where}: refused stop token {stops[0]} that its mask allowed"
            assert m.is_terminated(), f"{where}: not terminated after a stop token at the end"
            return out, m
        assert not m.is_terminated(), f"{where}: terminated before any stop token"
        refused = next((t for t in range(real_vocab) if t not in set(allowed)), None)
        if refused is not None and step % 3 == 0:
            assert not m.accept_token(refused), f"{where}: accepted token {refused}, which its mask forbids"
            assert torch.equal(_fill(m, bitmask, 1), row), f"{where}: a refused token changed the state"
        tok = rng.choice([t for t in allowed if t not in stop])
        assert m.accept_token(tok), f"{where}: refused token {tok} that its mask allowed"
        if m.max_rollback_tokens >= 1 and step % 4 == 1:
            m.rollback(1)
            assert torch.equal(_fill(m, bitmask, 1), row), f"{where}: rollback(1) did not restore the state"
            assert m.accept_token(tok), f"{where}: refused token {tok} again after a rollback"
        out.append(tok)
        rows.append(row)
        k = min(3, m.max_rollback_tokens, len(out))
        if k >= 2 and step % 5 == 4:  # several tokens at once, as a rejected draft's (grammar audit 34: only 1 ran)
            m.rollback(k)
            assert torch.equal(_fill(m, bitmask, 1), rows[-k]), f"{where}: rollback({k}) did not restore the state"
            for again in out[-k:]:
                assert m.accept_token(again), f"{where}: refused token {again} again after rollback({k})"
    raise AssertionError(f"{where}: no stop token allowed after {MAX_STEPS} tokens: {tokenizer.decode(out)!r}")


def _check_mask(reference: RegexReference, out: list[int], allowed: set[int], tokenizer: Any, where: str) -> None:
    data = b"".join(reference.token_bytes(t) for t in out)
    want = reference.allowed(data)
    forced = reference.forced(data)  # text with one way on: a backend may allow some tokenizations of it only
    missing = sorted(t for t in want - allowed if not (forced and forced.startswith(reference.token_bytes(t))))
    if missing:
        what = "a stop token, although the output is a complete match" if set(missing) & set(reference.stops) else (
            f"valid continuations such as {[reference.token_bytes(t) for t in missing[:5]]}")
        raise AssertionError(f"{where}: after {data!r} the mask drops {what} (tokens {missing[:5]})")
    extra = sorted(allowed - want - reference.unjudged)
    assert not extra, (f"{where}: after {data!r} the mask allows tokens {extra[:5]} "
                       f"({[tokenizer.convert_ids_to_tokens(t) for t in extra[:5]]}), which cannot continue a match")


def check_grammar_backend(
    backend_cls: type[GrammarBackend],
    tokenizer: Any = None,
    stop_token_ids: list[int] | None = None,
    seeds: int = 3,
) -> None:
    """Raise AssertionError naming the first broken rule of the GrammarBackend contract.

    :param backend_cls: the backend class (built as `backend_cls(tokenizer, vocab_size, stop_ids)`).
    :param tokenizer: a fast HF tokenizer (default: `tiny_tokenizer()`).
    :param stop_token_ids: default: the tokenizer's eos id.
    :param seeds: random walks per constraint.
    """
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    stop = list(stop_token_ids) if stop_token_ids is not None else [tokenizer.eos_token_id]
    vocab = len(tokenizer) + 37  # model vocabularies are often padded past the tokenizer's
    backend = backend_cls(tokenizer, vocab, stop)
    name = backend_cls.__name__
    bm = backend.allocate_bitmask(3)
    assert bm.dtype == torch.int32 and tuple(bm.shape) == (3, bitmask_width(vocab)) and bool((bm == -1).all()), (
        f"{name}.allocate_bitmask(3) must be int32 [3, {bitmask_width(vocab)}] with every bit set, got {bm.dtype} "
        f"{tuple(bm.shape)}"
    )
    for kind, text, check in CASES:
        if kind not in backend.supported_kinds:
            continue
        where = f"{name} {kind} {text!r}"
        compiled = backend.compile(kind, text)
        pattern = REFERENCE_REGEX.get((kind, text))
        reference = RegexReference(pattern, tokenizer, stop) if pattern is not None else None
        for seed in range(seeds):
            ids, m = _walk(backend, compiled, tokenizer, set(stop), random.Random(seed), f"{where} (seed {seed})",
                           reference)
            text_out = tokenizer.decode(ids)
            assert check(text_out), f"{where} (seed {seed}): produced {text_out!r}, which does not satisfy it"
            if m.max_rollback_tokens >= 1:
                m.rollback(1)
                assert not m.is_terminated(), f"{where}: still terminated after rolling back its stop token"
    for kind, text in INVALID.items():
        if kind in backend.supported_kinds:
            try:
                backend.compile(kind, text)
            except GrammarError:
                continue
            except Exception as e:
                raise AssertionError(f"{name}.compile({kind!r}, {text!r}) raised {e!r}, not GrammarError") from None
            raise AssertionError(f"{name}.compile({kind!r}, {text!r}) accepted an invalid constraint")
    kind, text, _ = CASES[2]
    if kind in backend.supported_kinds:
        with ThreadPoolExecutor(4) as pool:  # compile is called from several threads at once
            results = list(pool.map(lambda _: backend.compile(kind, text), range(4)))
        assert all(r is not None for r in results), f"{name}: concurrent compiles failed"
    _check_fill_bitmasks(backend, tokenizer, name)
    _check_apply(backend, vocab, name)


def _check_fill_bitmasks(backend: GrammarBackend, tokenizer: Any, name: str) -> None:
    """`fill_bitmasks` over many rows (matchers of different constraints at different points, rows out
    of order, some rows left alone) writes what each matcher's `fill_bitmask` writes, and only there."""
    rng = random.Random(7)
    cases = [(kind, text) for kind, text, _ in CASES if kind in backend.supported_kinds]
    if not cases:
        return
    pairs = []
    for row in range(3, 43, 2):  # 20 rows (enough for a backend's parallel path), every other row skipped
        kind, text = cases[row % len(cases)]
        m = backend.new_matcher(backend.compile(kind, text))
        scratch = backend.allocate_bitmask(1)
        for _ in range(rng.randrange(6)):  # walk a few allowed tokens in
            allowed = _allowed(_fill_row(m, scratch), 0, backend.vocab_size)
            choice = [t for t in allowed if t < len(tokenizer) and t != tokenizer.eos_token_id]
            if not choice or not m.accept_token(rng.choice(choice)):
                break
        pairs.append((row, m))
    rng.shuffle(pairs)
    got = backend.allocate_bitmask(44)
    got[:] = 0x5A5A5A5A
    backend.fill_bitmasks(got, pairs)
    want = backend.allocate_bitmask(44)
    want[:] = 0x5A5A5A5A
    for row, m in pairs:
        m.fill_bitmask(want, row)
    assert torch.equal(got, want), f"{name}.fill_bitmasks differs from filling each row with its matcher's fill_bitmask"
    _check_accept_tokens(backend, pairs, want, rng, name)


def _check_accept_tokens(backend: GrammarBackend, pairs: list, masks: torch.Tensor, rng: random.Random, name: str) -> None:
    """`accept_tokens` over many matchers gives each the flag `accept_token` gives (allowed tokens
    accepted, masked-out ones refused) and leaves each where `accept_token` leaves it."""
    matchers, tokens, want = [], [], []
    for k, (row, m) in enumerate(pairs):
        every = set(_allowed(masks, row, backend.vocab_size))
        allowed = every - set(backend.stop_token_ids)  # a matcher stays live (it is filled below)
        refused = [t for t in range(backend.vocab_size) if t not in every]
        if not allowed or (k % 3 == 0 and refused):
            tokens.append(rng.choice(refused))
            want.append(False)
        else:
            tokens.append(rng.choice(sorted(allowed)))
            want.append(True)
        matchers.append(m)
    got = [bool(x) for x in backend.accept_tokens(matchers, tokens)]
    assert got == want, f"{name}.accept_tokens returned {got}, accept_token would return {want}"
    if not any(want) or any(m.max_rollback_tokens < 1 for m in matchers):
        return
    after = backend.allocate_bitmask(len(matchers))
    again = backend.allocate_bitmask(len(matchers))
    for k, m in enumerate(matchers):
        m.fill_bitmask(after, k)
        if want[k]:  # the same token through accept_token: the same state
            m.rollback(1)
            assert m.accept_token(tokens[k]), f"{name}: accept_token refused a token accept_tokens accepted"
        m.fill_bitmask(again, k)
    assert torch.equal(after, again), f"{name}.accept_tokens left a matcher elsewhere than accept_token does"


def _fill_row(matcher, bitmask: torch.Tensor) -> torch.Tensor:
    matcher.fill_bitmask(bitmask, 0)
    return bitmask


def _check_apply(backend: GrammarBackend, vocab: int, name: str) -> None:
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, bitmask_width(vocab)), dtype=torch.int32, generator=g)
    logits = torch.randn(3, vocab + 5, generator=g)  # padded past the vocabulary: those stay as they are
    want = logits.clone()
    apply_bitmask_torch(want, bitmask, vocab)
    got = logits.clone()
    backend.apply_bitmask_inplace(got, bitmask)
    assert torch.equal(got, want), f"{name}.apply_bitmask_inplace differs from the reference masking"
    assert torch.equal(got[:, vocab:], logits[:, vocab:]), f"{name}.apply_bitmask_inplace touched padding columns"
