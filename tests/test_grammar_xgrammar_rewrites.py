"""The xgrammar backend's schema rewrites and its enum work-around: each schema below made SmolLM2
write an output its grammar accepted but the schema does not (benchmarks/results/
cpu-structured-output.md); the compiled grammar must now refuse that output and accept a valid one."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
import xgrammar as xgr
from radixserve.interfaces import GrammarError
from radixserve.testing import tiny_tokenizer
from radixserve_grammar_xgrammar.backend import XGrammarBackend
from radixserve_grammar_xgrammar.enum_trie import factor_literal_choices


@pytest.fixture(scope="module")
def backend():
    return XGrammarBackend(tiny_tokenizer(), 1000, [0])


def accepts(backend, schema: dict, text: str) -> bool:
    matcher = xgr.GrammarMatcher(backend.compile("json_schema", json.dumps(schema)))
    return matcher.accept_string(text) and matcher.accept_token(0)  # the text, then the end


SUFFIX = {"type": "object", "properties": {"suffix": {"type": "string", "minLength": 1,
          "enum": ["Jr", "Sr", "I", "II", "III", "Md"]}}, "required": ["suffix"]}
MAPS_TO = {"type": "object", "properties": {"name": {"type": "string"}, "maps_to": {"type": "string"}},
           "required": ["name"], "additionalProperties": True}
STATUS = {"type": "object", "properties": {"_id": {"type": "string"}, "status": {"type": "string", "enum": ["draft"]}},
          "required": ["_id"], "additionalProperties": {"type": ["string", "integer"]}}
SHAPE = {"type": "object", "required": ["shape"],
         "properties": {"shape": {"type": "string", "enum": ["square", "circle"]}, "side": {"type": "number"},
                        "radius": {"type": "number"}},
         "oneOf": [{"properties": {"shape": {"const": "square"}}, "required": ["side"]},
                   {"properties": {"shape": {"const": "circle"}}, "required": ["radius"]}]}
AREA = {"type": "object", "properties": {"radius": {"type": "integer"}, "width": {"type": "integer"},
        "height": {"type": "integer"}},
        "oneOf": [{"required": ["radius"]}, {"required": ["width", "height"]}]}  # exactly one shape's fields
IGLU = {"type": "object", "properties": {"schema": {"type": "string", "anyOf": [{"pattern": "^iglu:[a-z]+$"},
        {"format": "uri"}]}}, "required": ["schema"], "additionalProperties": False}


ALL_OF = {"allOf": [{"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}, "required": ["a"]},
                    {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
ALL_OF_REF = {"$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
              "type": "object", "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"ok": {"type": "boolean"}},
                                                                      "required": ["ok"]}]}


@pytest.mark.parametrize("schema, bad, good", [
    # corpus audit 32: an allOf of several branches was left unconstrained ({"zz": [1]} passed)
    (ALL_OF, '{"a": "x"}', '{"a": "x", "b": 5}'),
    (ALL_OF, '{"zz": [1]}', '{"a": "xyz", "b": -1}'),
    (ALL_OF_REF, '{"ok": true}', '{"id": 3, "ok": true}'),
    (SUFFIX, '{"suffix": "SrI"}', '{"suffix": "III"}'),  # xgrammar merged the enum's FSM states
    (MAPS_TO, '{"name": "a", "maps_to": [1]}', '{"name": "a", "maps_to": "b"}'),  # extra key = declared name
    (STATUS, '{"_id": "a", "status": 200}', '{"_id": "a", "status": "draft"}'),
    (SHAPE, '{"shape": "circle"}', '{"shape": "circle", "radius": 2}'),  # the parent's keywords were dropped
    (IGLU, '{"schema": {}}', '{"schema": "iglu:abc"}'),
    (AREA, '{"radius": 1, "width": 2, "height": 3}', '{"width": 2, "height": 3}'),  # oneOf read as anyOf
    (AREA, '{"radius": 1, "width": 2}', '{"radius": 1}'),
])
def test_outputs_that_violated_their_schema_are_now_outside_the_grammar(backend, schema, bad, good):
    assert not accepts(backend, schema, bad)
    assert accepts(backend, schema, good)


def test_a_union_that_cannot_be_merged_with_its_siblings_is_refused_naming_it(backend):
    schema = {"type": "object", "properties": {"a": {"type": "string"}},
              "anyOf": [{"properties": {"a": {"type": "integer"}}}]}
    with pytest.raises(GrammarError, match="type excludes its parent's"):
        backend.compile("json_schema", json.dumps(schema))


def test_one_of_required_sets_that_contain_one_another_are_refused(backend):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "oneOf": [{"required": ["a"]}, {"required": ["a", "b"]}]}
    with pytest.raises(GrammarError, match="contain one another"):
        backend.compile("json_schema", json.dumps(schema))


def test_factored_enums_accept_exactly_their_values():
    """Random enums over a 3-letter alphabet, every string up to 4 letters between the quotes:
    the plain alternation accepts strings outside the enum (xgrammar 0.1.27), the factored one never."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([f"<{i}>" for i in range(8)]), cache_enabled=False)
    rng = random.Random(0)
    leaks = {"plain": 0, "factored": 0}
    for _ in range(40):
        words = sorted({'\\"' + "".join(rng.choice("abc") for _ in range(rng.randint(0, 3))) + '\\"'
                        for _ in range(rng.randint(2, 6))})
        plain = 'root ::= "{" x "}"\nx ::= (' + " | ".join(f'("{w}")' for w in words) + ")"
        for form, ebnf in (("plain", plain), ("factored", factor_literal_choices(plain))):
            compiled = compiler.compile_grammar(ebnf)
            for n in range(5):
                for mid in itertools.product("abc", repeat=n):
                    text = '{"' + "".join(mid) + '"}'
                    expected = '\\"' + "".join(mid) + '\\"' in words
                    leaks[form] += xgr.GrammarMatcher(compiled).accept_string(text) != expected
    assert leaks["plain"] > 0  # the bug is still there to work around (drop enum_trie.py when this fails)
    assert leaks["factored"] == 0


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "allOf": [{"properties": {"a": {"type": "string"}}, "additionalProperties": False},
                                  {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
     "allOf branch 0 (at the schema root) allows no properties besides its own, and another branch declares 'b'"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "type excludes"),
    ({"allOf": [{"$ref": "#/$defs/missing"}]}, "names nothing in the schema"),
    ({"allOf": [{"type": "string"}, False]}, "allOf branch 1 (at the schema root) is false"),
    # corpus audit 32: xgrammar's own words ("Cannot find field $defs in #/$defs/missing") had no location
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
     "the $ref at /properties/a/$ref ('#/$defs/missing') names nothing in the schema"),
])
def test_an_all_of_it_cannot_merge_or_a_ref_to_nothing_is_refused_naming_it(backend, schema, words):
    with pytest.raises(GrammarError, match=re.escape(words)):
        backend.compile("json_schema", json.dumps(schema))


@pytest.mark.parametrize("kind, text, good, bad", [
    # corpus audit 32, on xgrammar 0.1.27: [à-ÿ] took none of its characters (the output was lone UTF-8 lead
    # bytes) and [一-鿿] took "10"; a single non-ASCII character in a class ([éü]) took nothing
    ("regex", "[à-ÿ]{2,4}", "àé", "10"),
    ("regex", "[一-鿿]{2}", "日本", "10"),
    ("regex", "[a-zé]{2}", "bé", "é1"),
    ("regex", "[😀-🙏]", "😀", "a"),
    ("ebnf", "root ::= [à-ÿ]{2,4}", "àé", "10"),
    ("json_schema", json.dumps({"type": "string", "pattern": "^[Ѐ-ӿ]{2}$"}), '"дж"', '"10"'),
])
def test_non_ascii_characters_in_character_classes_are_enforced(backend, kind, text, good, bad):
    def takes(candidate: str) -> bool:
        return xgr.GrammarMatcher(backend.compile(kind, text)).accept_string(candidate)

    assert takes(good) and not takes(bad)


def _pydantic_schemas() -> tuple[dict, dict]:
    """Two everyday pydantic models (frameworks audit 32: both were a 400 on the xgrammar backend)."""
    from typing import Literal, Union

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int = Field(ge=0, le=9)

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pet(BaseModel):  # a discriminated union: "discriminator" beside the oneOf
        pet: Union[Cat, Dog] = Field(discriminator="kind")  # noqa: UP007 (pydantic's spelling in its docs)

    class Excl(BaseModel):  # gt / lt on an int: exclusiveMinimum / exclusiveMaximum
        x: int = Field(gt=0, lt=10)

    return Pet.model_json_schema(), Excl.model_json_schema()


def test_a_pydantic_discriminated_union_and_exclusive_integer_bounds_are_enforced(backend):
    pet, excl = _pydantic_schemas()
    assert "discriminator" in json.dumps(pet) and "exclusiveMaximum" in json.dumps(excl)
    assert accepts(backend, pet, '{"pet": {"kind": "dog", "good": true}}')
    assert accepts(backend, pet, '{"pet": {"kind": "cat", "lives": 9}}')
    assert not accepts(backend, pet, '{"pet": {"kind": "cat", "good": true}}')
    assert accepts(backend, excl, '{"x": 1}') and accepts(backend, excl, '{"x": 9}')
    assert not accepts(backend, excl, '{"x": 0}') and not accepts(backend, excl, '{"x": 10}')


@pytest.mark.parametrize("lo, hi", [(0, 1), (-2, 3), (-5, -2), (1, 5), (0, 100), (7, 7)])
def test_a_number_between_integer_bounds_is_written_exactly_in_the_range(backend, lo, hi):
    """pydantic's `float = Field(ge=0, le=1)` was a 400 (xgrammar's own range grammar lets "1,5", "175" and,
    for [0, 1], "1.5" through); number_range.py writes the range's decimals itself."""
    schema = {"type": "object", "properties": {"x": {"type": "number", "minimum": lo, "maximum": hi,
                                                     "title": "X"}}, "required": ["x"]}
    values = ["0", "0.5", "1", "1.0", "1.5", "1,5", "175", "-1", "-0.5", "-2", "-2.5", "-5", "-5.0", "-5.1", "-4.99",
              "2", "3", "3.01", "4.75", "5", "5.5", "7", "7.00", "7.01", "100", "99.99", "100.0", "101", "007"]
    for v in values:
        inside = "," not in v and not v.startswith("00") and lo <= float(v) <= hi
        assert accepts(backend, schema, '{"x": ' + v + '}') == inside, (lo, hi, v)
