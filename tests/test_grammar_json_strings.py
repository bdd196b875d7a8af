"""JSON-schema and json_object grammars never let a raw control character (U+0000-U+001F) into a
JSON string (the H200 run saw U+0010 inside a `maxLength` string from xgrammar: invalid JSON)."""

from __future__ import annotations

import json
import random

import pytest
import xgrammar as xgr
from radixserve.interfaces.grammar import GrammarError
from radixserve.testing import tiny_tokenizer
from radixserve_grammar_llguidance.backend import LLGuidanceBackend
from radixserve_grammar_xgrammar.backend import XGrammarBackend
from radixserve_grammar_xgrammar.json_strings import exclude_control_characters

VOCAB = 320
BACKENDS = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend}
# string schemas xgrammar 0.1.27 compiles to rules that admit control characters (before the fix)
STRING_SCHEMAS = {
    "plain": {"type": "string"},
    "maxLength": {"type": "string", "maxLength": 8},  # the H200 case
    "minLength": {"type": "string", "minLength": 1},
    "pattern-dot": {"type": "string", "pattern": "^a.*$"},
    "pattern-space": {"type": "string", "pattern": "^x\\s*$"},
}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request, tok):
    return BACKENDS[request.param](tok, VOCAB, [0])


def _one_token(tok, text: str) -> int:
    ids = tok.encode(text)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def _allowed_after(backend, tok, schema: dict, prefix_options: list[str]) -> set[int]:
    """The tokens allowed after the first prefix the grammar accepts (backends differ in spacing)."""
    compiled = backend.compile("json_schema", json.dumps(schema))
    for prefix in prefix_options:
        m = backend.new_matcher(compiled)
        if all(m.accept_token(t) for t in tok.encode(prefix)):
            bitmask = backend.allocate_bitmask(1)
            m.fill_bitmask(bitmask, 0)
            words = bitmask[0].tolist()
            return {t for t in range(VOCAB) if (words[t // 32] >> (t % 32)) & 1}
    raise AssertionError(f"no prefix of {prefix_options} accepted by {schema}")


@pytest.mark.parametrize("name", sorted(STRING_SCHEMAS))
def test_a_raw_control_character_is_not_allowed_inside_a_string(backend, tok, name):
    schema = {"type": "object", "properties": {"a": STRING_SCHEMAS[name]}, "required": ["a"],
              "additionalProperties": False}
    first = "x" if name == "pattern-space" else "a"
    allowed = _allowed_after(backend, tok, schema, ['{"a": "' + first, '{"a":"' + first])
    assert _one_token(tok, "\x10") not in allowed
    assert _one_token(tok, "\n") not in allowed
    assert _one_token(tok, "\x00") not in allowed
    assert _one_token(tok, "a") in allowed or name == "pattern-space"
    assert _one_token(tok, " ") in allowed


def test_json_object_keys_and_values_reject_control_characters(backend, tok):
    allowed_key = _allowed_after(backend, tok, {"type": "object"}, ['{"'])
    allowed_value = _allowed_after(backend, tok, {"type": "object"}, ['{"k": "', '{"k":"'])
    for allowed in (allowed_key, allowed_value):
        assert _one_token(tok, "\x10") not in allowed
        assert _one_token(tok, "a") in allowed
        assert _one_token(tok, "\\") in allowed  # the escaped form (\u0010) stays possible


def test_random_walks_through_bounded_strings_always_parse(backend, tok):
    """The H200 schema: whatever allowed tokens a sampler picks, the output is valid JSON."""
    schema = {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                               "note": {"type": "string", "pattern": "^.{0,6}$"}},
              "required": ["sku", "note"], "additionalProperties": False}
    compiled = backend.compile("json_schema", json.dumps(schema))
    rng = random.Random(0)
    bitmask = backend.allocate_bitmask(1)
    control = set(tok.encode("".join(map(chr, range(32)))))
    # ASCII tokens only: a random walk through multi-byte UTF-8 pieces says nothing about this bug
    ascii_ids = {t for t in range(len(tok)) if tok.decode([t]).isascii()}
    for _ in range(8):
        m, ids = backend.new_matcher(compiled), []
        for _ in range(64):
            m.fill_bitmask(bitmask, 0)
            words = bitmask[0].tolist()
            allowed = [t for t in sorted(ascii_ids) if (words[t // 32] >> (t % 32)) & 1]
            # favour control characters whenever they are allowed: the bug shows at once
            pick = rng.choice(sorted(control & set(allowed)) or allowed)
            assert m.accept_token(pick)
            if pick == 0:
                break
            ids.append(pick)
        assert m.is_terminated()
        value = json.loads(tok.decode(ids))  # strict: raw control characters are refused
        assert set(value) == {"sku", "note"} and len(value["sku"]) <= 8


def test_rewrite_keeps_json_whitespace_and_structural_classes():
    builtin = str(xgr.Grammar.builtin_json_grammar())
    assert exclude_control_characters(builtin) == builtin  # already correct: nothing changes
    assert exclude_control_characters('root ::= "[" [ \\n\\t]* [0-9] (=([ \\n\\t,}\\]]))') == \
        'root ::= "[" [ \\n\\t]* [0-9] (=([ \\n\\t,}\\]]))'
    assert exclude_control_characters('root ::= "\\"" [^\\"\\\\\\r\\n]* "\\""') == \
        'root ::= "\\"" [^\\x00-\\x1f\\x22\\x5c]* "\\""'
    assert exclude_control_characters("root ::= [\\0-\\U0010ffff]") == \
        "root ::= [\\x20-\\x21\\x23-\\x5b\\x5d-\\U0010ffff]"


def test_a_pattern_of_only_control_characters_is_refused_naming_it(tok):
    backend = XGrammarBackend(tok, VOCAB, [0])
    with pytest.raises(GrammarError, match="must escape"):
        backend.compile("json_schema", json.dumps({"type": "string", "pattern": "^[\\x00-\\x1f]$"}))
