"""XGrammarBackend: RadixServe's grammar contract over xgrammar's compiler and matcher."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch
import xgrammar as xgr
from radixserve.interfaces.grammar import GrammarBackend, GrammarError, GrammarMatcher, resolve_json_pointer

from radixserve_grammar_xgrammar.enum_trie import factor_literal_choices
from radixserve_grammar_xgrammar.json_strings import exclude_control_characters
from radixserve_grammar_xgrammar.number_range import expand_number_ranges, mark_number_range
from radixserve_grammar_xgrammar.schema_rewrites import location, prepare_schema

MAX_ROLLBACK_TOKENS = 16  # what we promise (xgrammar keeps the whole history): any draft the core allows (<= 16)
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: "; users need only the rest
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")
# ... and an assertion's condition before its message: "Check failed: (a <= b) is false: Invalid range"
_CPP_CHECK = re.compile(r"^Check failed: \(.*?\) is false:\s*")


# JSON-schema keywords xgrammar 0.1.27 accepts but does not enforce (checked one by one): a
# schema using them is refused (HTTP 400) rather than answered with output that may violate it
UNENFORCED_KEYWORDS = (
    "uniqueItems", "multipleOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
    "dependencies", "exclusiveMinimum", "exclusiveMaximum", "contains", "minContains", "maxContains",
    "propertyNames",
)
# keywords whose value maps names to subschemas, and keywords whose value is data, not a schema
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples", "required", "title", "description")


def unenforced_keyword(schema: Any, path: str = "") -> str | None:
    """The location of the first keyword of UNENFORCED_KEYWORDS in `schema`, or None."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            found = unenforced_keyword(sub, f"{path}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in UNENFORCED_KEYWORDS and not (key == "uniqueItems" and value is False):
            return f"{path}/{key}"
        if key in _DATA:
            continue
        subs = value.items() if key in _SCHEMA_MAPS and isinstance(value, dict) else [("", value)]
        for name, sub in subs:
            found = unenforced_keyword(sub, f"{path}/{key}" + (f"/{name}" if name else ""))
            if found:
                return found
    return None


def _subschemas(schema: Any, path: str = "", branch: bool = False):
    """Every (path, subschema dict, is a branch of anyOf/oneOf/allOf) of `schema`, itself first."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            yield from _subschemas(sub, f"{path}/{i}", branch)
        return
    if not isinstance(schema, dict):
        return
    yield path, schema, branch
    for key, value in schema.items():
        if key in _DATA:
            continue
        subs = value.items() if key in _SCHEMA_MAPS and isinstance(value, dict) else [("", value)]
        for name, sub in subs:
            yield from _subschemas(sub, f"{path}/{key}" + (f"/{name}" if name else ""),
                                   key in ("anyOf", "oneOf", "allOf"))


def empty_choice(schema: Any) -> str | None:
    """The location of the first `enum`, `anyOf` or `oneOf` without alternatives, or None."""
    for path, sub, _ in _subschemas(schema):
        for key in ("enum", "anyOf", "oneOf"):
            if sub.get(key) == []:
                return f"{path}/{key}"
    return None


_JSON_TYPES = {"string": (str,), "boolean": (bool,), "null": (type(None),), "object": (dict,), "array": (list,),
               "integer": (int,), "number": (int, float)}
_ANNOTATIONS = {"required", "title", "description", "$comment", "examples"}


def _has_type(value: Any, json_type: str) -> bool:
    if json_type in ("integer", "number") and isinstance(value, bool):
        return False
    if json_type == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(json_type, (object,)))


def unenforced_construct(schema: Any) -> str | None:
    """Why `schema` holds a construct xgrammar 0.1.27 compiles without enforcing it, or None.

    Found by validating its outputs on a corpus of real schemas (benchmarks/results/
    cpu-structured-output.md): an `anyOf`/`oneOf` whose branches only list `required` properties
    (the branch is not chosen), an `enum`/`const` value without the declared `type` (xgrammar follows
    one of the two), a `required` property missing from `properties` (strict mode never writes
    undeclared properties, so the output always misses it), and a declared property that a
    `patternProperties` pattern also matches (its value must satisfy both; xgrammar picks one)."""
    for path, sub, branch in _subschemas(schema):
        for union in ("anyOf", "oneOf"):
            branches = sub.get(union)
            if isinstance(branches, list) and any(isinstance(b, dict) and b and set(b) - {"type"} <= _ANNOTATIONS
                                                  and "required" in b for b in branches):
                return f"{union} branches that only list `required` properties (at {path}/{union})"
        types = sub.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if types:
            values = list(sub["enum"]) if isinstance(sub.get("enum"), list) else []
            values += [sub["const"]] if "const" in sub else []
            for value in values:
                if not any(_has_type(value, t) for t in types):
                    return (f"enum/const value {json.dumps(value)[:40]} that is not of the declared type "
                            f"{'/'.join(types)} (at {location(path)})")
        props, required = sub.get("properties"), sub.get("required")
        patterns = sub.get("patternProperties")
        if isinstance(props, dict) and isinstance(patterns, dict):
            for pattern in patterns:
                try:
                    overlap = next((name for name in props if re.search(pattern, name)), None)
                except re.error:
                    overlap = None
                if overlap is not None:
                    return (f"property {overlap!r} matched by both `properties` and `patternProperties` pattern "
                            f"{pattern!r} (at {location(path)}; its value must satisfy both)")
        if "minimum" in sub and "maximum" in sub and (not types or "number" in types):
            # its grammar for a two-sided range of reals matches any character in place of the
            # decimal point and more digits than the bounds allow ("1,5", "175" for [0.5, 1.5])
            return (f"a number with both `minimum` and `maximum` (at {location(path)}; give one bound, integer bounds "
                    "at most 1000 apart, or an integer range)")
        pattern = sub.get("pattern")
        lengths = [key for key in ("minLength", "maxLength") if key in sub]
        if isinstance(pattern, str) and lengths:
            return (f"a string `pattern` together with `{lengths[0]}` (at {location(path)}; xgrammar enforces the "
                    "pattern and ignores the length)")
        if isinstance(required, list) and not sub.get("patternProperties") and (isinstance(props, dict) or branch):
            declared = props if isinstance(props, dict) else {}
            missing = [name for name in required if isinstance(name, str) and name not in declared]
            if missing:
                # a union branch too: xgrammar does not merge the parent's `properties` into a branch
                return (f"required property {missing[0]!r} that is not declared in the same `properties` "
                        f"(at {location(path)}; undeclared properties are never generated)")
    return None


_NUL = "\x00"
_NUL_REFUSED = ("a raw NUL character (U+0000), which xgrammar cannot compile (its compiler crashed the process on "
                "one): write it as the escape \\x00")


def nul_in_patterns(schema: Any) -> str | None:
    """Where a `pattern`, or a `patternProperties` pattern, holds a raw NUL character, or None."""
    for path, sub, _ in _subschemas(schema):
        if isinstance(sub.get("pattern"), str) and _NUL in sub["pattern"]:
            return f"{path}/pattern"
        patterns = sub.get("patternProperties")
        if isinstance(patterns, dict) and any(_NUL in key for key in patterns):
            return f"{path}/patternProperties"
    return None


def unusable_ref(schema: Any) -> str | None:
    """Why the first unusable `$ref` of `schema` cannot be compiled, or None: one that points outside the
    schema (`http://...`, `other.json#/x`: xgrammar drops it with a warning and leaves that value
    unconstrained, refuzz audit 31), or a local one that names nothing (xgrammar's own message, "Cannot
    find field $defs in #/$defs/x", gave no location: corpus audit 32)."""
    for path, sub, _ in _subschemas(schema):
        ref = sub.get("$ref")
        if not isinstance(ref, str):
            continue
        if not ref.startswith("#"):
            return (f"the $ref at {path}/$ref is not a reference inside the schema (#/...): the xgrammar backend would "
                    "leave that value unconstrained")
        try:
            resolve_json_pointer(schema, ref)
        except LookupError:
            return f"the $ref at {path}/$ref ({ref[:80]!r}) names nothing in the schema"
    return None


def unwritable_property_name(schema: Any) -> str | None:
    """Where a declared property name (`properties`, `required`) holds a quote, a backslash or a control
    character, or None: xgrammar writes names into its grammar unescaped, so these broke its grammar (a
    lexer error about a line of it the client never saw) or came out raw (invalid JSON: refuzz audit 31)."""
    def unwritable(name: Any) -> bool:
        return isinstance(name, str) and any(c in '"\\' or ord(c) < 0x20 for c in name)

    for path, sub, _ in _subschemas(schema):
        for key in ("properties", "required"):
            names = sub.get(key)
            bad = next((n for n in names if unwritable(n)), None) if isinstance(names, dict | list) else None
            if bad is not None:
                return f"property name {json.dumps(bad)} (at {path}/{key})"
    return None


def _clean(e: Exception) -> str:
    text = _CPP_PREFIX.sub("", str(e).strip()).strip()
    return _CPP_CHECK.sub("", text).strip() or text or type(e).__name__


def normalize_schema(schema: Any) -> Any:
    """A copy of `schema` rewritten into an equivalent or narrower one that xgrammar enforces (every
    output of the result is valid for `schema`): schema_rewrites.prepare_schema (union siblings into
    the branches, no extra keys next to declared properties; ValueError naming the place for a union
    it cannot merge), then _enum_without_string_bounds on every subschema."""
    schema = prepare_schema(schema)
    for _, sub, _ in _subschemas(schema):  # each node before its children are visited
        _enum_without_string_bounds(sub)
        mark_number_range(sub)  # number_range.py: a grammar of our own for two-sided number ranges
    return schema


_STRING_BOUNDS = ("minLength", "maxLength", "pattern", "format")


def _enum_without_string_bounds(sub: dict) -> None:
    """An `enum` with `minLength`/`maxLength`/`pattern`: xgrammar enforces only one side of the two.
    The enum values that meet the bounds are kept and the bounds removed (the same set of valid
    strings; `format` is dropped as well)."""
    values = sub.get("enum")
    if not isinstance(values, list) or not any(key in sub for key in _STRING_BOUNDS):
        return
    lo, hi, pattern = sub.get("minLength", 0), sub.get("maxLength"), sub.get("pattern")

    def meets(v: Any) -> bool:
        if not isinstance(v, str):
            return True
        if len(v) < lo or (hi is not None and len(v) > hi):
            return False
        try:
            return pattern is None or re.search(pattern, v) is not None
        except re.error:
            return True

    kept = [v for v in values if meets(v)]
    if kept:
        sub["enum"] = kept
        for key in _STRING_BOUNDS:
            sub.pop(key, None)


def json_schema_grammar(schema: str) -> xgr.Grammar:
    """xgrammar's grammar for `schema` (compact JSON, undeclared fields not generated) with raw
    control characters kept out of strings (xgrammar lets them into length-limited and `pattern`
    strings), after normalize_schema's rewrites and with enum alternations factored into a prefix
    tree (enum_trie.py: xgrammar 0.1.27 over-merges them). Raises ValueError for a union that
    cannot be rewritten."""
    return _normalized_schema_grammar(normalize_schema(json.loads(schema)))


def _normalized_schema_grammar(schema: Any) -> xgr.Grammar:
    """json_schema_grammar of a schema normalize_schema already rewrote."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return xgr.Grammar.from_ebnf(factor_literal_choices(exclude_control_characters(expand_number_ranges(str(grammar)))))


# fewer constrained rows than this are filled one by one (a thread hand-off costs more than it saves)
_PARALLEL_FILL_MIN_ROWS = 8


def _fill_threads() -> int:
    """Threads for a batch fill: half the cores the process may use (the other half keep running the
    forward pass and the scheduler), at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores // 2))


class XGrammarMatcher(GrammarMatcher):
    max_rollback_tokens = MAX_ROLLBACK_TOKENS

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._m = xgr.GrammarMatcher(compiled)  # its rollback history is unbounded

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(int(num_tokens))

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XGrammarBackend(GrammarBackend):
    """JSON schema, regex and EBNF (xgrammar's GBNF dialect, `root ::= ...`).

    JSON is generated compactly (`{"a": 1, "b": [2, 3]}`: no free whitespace): with free
    whitespace a small model can emit newlines until its token budget ends, leaving invalid JSON.
    `strict_mode`: properties and items the schema does not declare are not generated. Strings
    never hold a raw control character (U+0000-U+001F), which JSON forbids: see json_strings.py."""

    supported_kinds = ("json_schema", "regex", "ebnf")

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        try:
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids) or None
            )
        except Exception as e:
            raise GrammarError(f"xgrammar cannot use this tokenizer: {_clean(e)}") from None
        # one thread per compile: the core runs several compiles at once in its own pool, and
        # caches compiled grammars itself (xgrammar's cache would hold a second copy)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._batch: xgr.BatchGrammarMatcher | None = None  # made on the first parallel fill

    def fill_bitmasks(self, bitmask: torch.Tensor, rows) -> None:
        """One call into xgrammar for every row of the step: its C++ threads fill them in parallel
        (a batch of 64 JSON-schema rows is several milliseconds of host work done one by one)."""
        if len(rows) < _PARALLEL_FILL_MIN_ROWS or not all(isinstance(m, XGrammarMatcher) for _, m in rows):
            super().fill_bitmasks(bitmask, rows)
            return
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=_fill_threads())
        self._batch.batch_fill_next_token_bitmask([m._m for _, m in rows], bitmask, indices=[r for r, _ in rows])

    def accept_tokens(self, matchers, tokens) -> list[bool]:
        """One call into xgrammar for every row of the step (the Python wrappers of 64 single
        accepts cost more than xgrammar's work)."""
        if not all(isinstance(m, XGrammarMatcher) for m in matchers):
            return super().accept_tokens(matchers, tokens)
        ok = xgr.BatchGrammarMatcher.batch_accept_token([m._m for m in matchers], [int(t) for t in tokens])
        return [bool(x) for x in ok]

    def compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        try:
            if kind == "json_schema":
                schema = normalize_schema(json.loads(text))  # what is checked is what gets compiled
                nul = nul_in_patterns(schema)
                if nul:
                    raise GrammarError(f"the pattern at {nul} holds {_NUL_REFUSED}")
                bad_ref = unusable_ref(schema)
                if bad_ref:
                    raise GrammarError(bad_ref)
                name = unwritable_property_name(schema)
                if name:
                    raise GrammarError(f"{name} holds a quote, a backslash or a control character, which the xgrammar "
                                       "backend cannot write as a property name")
                empty = empty_choice(schema)
                if empty:  # xgrammar reports it as an error in its generated EBNF
                    raise GrammarError(f"{empty.rsplit('/', 1)[1]} must not be empty (at {empty}): no value could "
                                       "match it")
                where = unenforced_keyword(schema)
                if where:
                    raise GrammarError(
                        f"{where.rsplit('/', 1)[1]} (at {where}) is not supported by the xgrammar backend: it cannot "
                        "be enforced while generating"
                    )
                why = unenforced_construct(schema)
                if why:
                    raise GrammarError(f"the schema has {why}: the xgrammar backend cannot enforce it while generating")
                return self._compiler.compile_grammar(_normalized_schema_grammar(schema))
            if kind == "regex":
                if _NUL in text:  # a crash of the whole scheduler process, or (mid-text) a regex cut short there
                    raise GrammarError(f"the regex holds {_NUL_REFUSED}")
                return self._compiler.compile_regex(text)
            if kind == "ebnf":
                return self._compiler.compile_grammar(text)
        except GrammarError:
            raise
        except RecursionError:  # Python's own words ("maximum recursion depth exceeded ...") said nothing useful
            raise GrammarError(f"the {kind} is nested too deeply for the xgrammar backend") from None
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with a C++ location prefix
            raise GrammarError(_clean(e)) from None
        raise GrammarError(f"xgrammar does not compile constraints of kind {kind!r}")

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(compiled)

    def apply_bitmask_inplace(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        # xgrammar's kernels: fused on CUDA (one pass over the logits, no unpacked mask), and a
        # native loop on CPU that is several times faster than unpacking the bits with torch ops
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size)
