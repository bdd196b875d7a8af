"""Schema `pattern`s llguidance 1.9 generates wrong JSON strings for (refused, not answered).

llguidance turns a `pattern` into a regex over the JSON-escaped text (derivre's `json_quote`). For a
character class that holds every control character U+0000-U+001F (or all of them but `\\n`), it
emits one shortcut that also allows the escapes `\\"` and `\\\\`, whether or not the class holds `"`
or `\\`: `^[^"]*$` lets `"\\""` (a quote) through, `^[\\x00-\\x1f]$` lets `"\\\\"` (a backslash)
through. Checked by walking the pattern with Python's regex parser; a pattern it cannot parse
(other dialect features) is left to llguidance."""

from __future__ import annotations

import re
from typing import Any

try:
    from re import _parser as sre  # Python 3.11+
except ImportError:  # pragma: no cover
    import sre_parse as sre  # type: ignore[no-redef]

_ASCII = frozenset(range(128))
_CONTROLS = frozenset(range(32))
_CATEGORY = {"CATEGORY_DIGIT": r"\d", "CATEGORY_NOT_DIGIT": r"\D", "CATEGORY_SPACE": r"\s",
             "CATEGORY_NOT_SPACE": r"\S", "CATEGORY_WORD": r"\w", "CATEGORY_NOT_WORD": r"\W"}


def _class_chars(op: Any, av: Any) -> frozenset[int] | None:
    """The ASCII code points one single-character node matches, or None if it is not one."""
    name = str(op)
    if name == "LITERAL":
        return frozenset({av}) & _ASCII
    if name == "NOT_LITERAL":
        return _ASCII - {av}
    if name == "ANY":
        return _ASCII - {10}
    if name == "RANGE":
        return frozenset(range(av[0], min(av[1], 127) + 1))
    if name == "CATEGORY":
        rx = re.compile(_CATEGORY.get(str(av), r"[^\s\S]"))
        return frozenset(c for c in _ASCII if rx.match(chr(c)))
    if name == "IN":
        chars: set[int] = set()
        negate = False
        for sub_op, sub_av in av:
            if str(sub_op) == "NEGATE":
                negate = True
                continue
            chars |= _class_chars(sub_op, sub_av) or frozenset()
        return _ASCII - chars if negate else frozenset(chars)
    return None


def _classes(parsed: Any):
    """Every single-character node of a parsed pattern, nested groups and repeats included."""
    for op, av in parsed:
        chars = _class_chars(op, av)
        if chars is not None:
            yield chars
            continue
        for part in av if isinstance(av, (tuple, list)) else (av,):
            if isinstance(part, sre.SubPattern):
                yield from _classes(part)
            elif isinstance(part, list):  # BRANCH: a list of alternatives
                for alt in part:
                    if isinstance(alt, sre.SubPattern):
                        yield from _classes(alt)


def misquoted_escape(pattern: str) -> str | None:
    """Which escape (`\\"` or `\\\\`) llguidance would wrongly allow for `pattern`, or None."""
    try:
        parsed = sre.parse(pattern)
    except Exception:  # another dialect's syntax: not ours to judge
        return None
    for chars in _classes(parsed):
        if _CONTROLS - {10} <= chars:
            for ch in ('"', "\\"):
                if ord(ch) not in chars:
                    return ch
    return None


def misquoted_pattern(schema: Any, path: str = "") -> str | None:
    """A message about the first `pattern` (or `patternProperties` key) of `schema` that
    llguidance would let wrong strings through for, or None."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            found = misquoted_pattern(sub, f"{path}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    candidates = [(f"{path}/pattern", schema.get("pattern"))]
    props = schema.get("patternProperties")
    if isinstance(props, dict):
        candidates += [(f"{path}/patternProperties", key) for key in props]
    for where, pattern in candidates:
        ch = misquoted_escape(pattern) if isinstance(pattern, str) else None
        if ch is not None:
            escape = "\\" + ch
            return (
                f"the pattern {pattern!r} (at {where}) has a character class that holds every control character but "
                f"not `{ch}`: llguidance would still generate the escape `{escape}` for it (a `{ch}` the pattern "
                "forbids), so the llguidance backend refuses it; leave the control characters out of the "
                'class (e.g. [^"\\x00-\\x1f]) or use the xgrammar backend'
            )
    for key, value in schema.items():
        if key in ("enum", "const", "default", "examples", "required"):
            continue  # data, not subschemas
        found = misquoted_pattern(value, f"{path}/{key}") if isinstance(value, (dict, list)) else None
        if found:
            return found
    return None
