"""A forgiving reader of JSON that may still be growing: where values start and end, which object
members are complete. The parsers use it to stream a call's arguments as the model writes them;
`json.loads` still has the last word on a complete value."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

WS = " \t\r\n"
_SCALAR_END = WS + ",]}"


class Malformed(Exception):
    """The text cannot be the start of the expected JSON."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


# a string's characters and escapes up to its closing quote ("unrolled": one fast scan per run)
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)
_STRUCTURAL = re.compile(r'["{}\[\]]')


def string_end(text: str, i: int) -> int | None:
    """Index just past the string starting at `text[i] == '"'`; None when it is not closed yet."""
    j = _STRING_BODY.match(text, i + 1).end()
    return j + 1 if j < len(text) and text[j] == '"' else None


def value_end(text: str, i: int, final: bool = False) -> int | None:
    """Index just past the JSON value starting at `text[i]` (not whitespace); None when the value
    is not complete yet. Raises Malformed on a character no value can start with or an unbalanced
    bracket. Only the structure is checked; `json.loads` checks the rest."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        stack: list[str] = []
        j = i
        while True:  # jump from one structural character to the next (regex: fast on long values)
            m = _STRUCTURAL.search(text, j)
            if m is None:
                return None
            j = m.start()
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                stack.append("}" if c == "{" else "]")
            elif c in "}]":
                if not stack or stack.pop() != c:
                    raise Malformed(f"unbalanced {c!r}")
                if not stack:
                    return j + 1
            j += 1
    if c in "-0123456789tfn":
        j = i
        while j < len(text) and text[j] not in _SCALAR_END:
            j += 1
        # a number at the very end may still grow ("1" -> "12")
        return j if (j < len(text) or final) else None
    raise Malformed(f"a JSON value cannot start with {c!r}")


@dataclass
class Member:
    key: str
    start: int  # where the value starts
    end: int | None  # just past the value; None: not complete yet


@dataclass
class ObjectScan:
    members: list[Member] = field(default_factory=list)
    end: int | None = None  # just past the closing brace; None: not closed yet

    def get(self, *keys: str) -> Member | None:
        for m in self.members:
            if m.key in keys:
                return m
        return None


def scan_object(text: str, i: int, final: bool = False) -> ObjectScan:
    """The members of the object starting at `text[i] == '{'` as far as the text goes.
    Raises Malformed when it cannot be an object."""
    out = ObjectScan()
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        out.end = j + 1
        return out
    while j < len(text):
        if text[j] != '"':
            raise Malformed("expected a member name")
        key_end = string_end(text, j)
        if key_end is None:
            return out
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            raise Malformed("bad member name") from None
        j = skip_ws(text, key_end)
        if j >= len(text):
            return out
        if text[j] != ":":
            raise Malformed("expected ':'")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return out
        end = value_end(text, j, final)
        out.members.append(Member(key, j, end))
        if end is None:
            return out
        j = skip_ws(text, end)
        if j >= len(text):
            return out
        if text[j] == "}":
            out.end = j + 1
            return out
        if text[j] != ",":
            raise Malformed("expected ',' or '}'")
        j = skip_ws(text, j + 1)
    return out


_LITERALS = ("true", "false", "null")
_CHARS = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'
_CLOSED_STRING = re.compile(_CHARS, re.S)  # a string's body between its quotes
_OPEN_STRING = re.compile(_CHARS + r"(?:\\(?:u[0-9a-fA-F]{0,3})?)?", re.S)  # ... still being written
_NUMBER_PREFIX = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")


def json_prefix_length(text: str) -> int:
    """How much of `text` is the start of some JSON value: its length when all of it could still grow into
    valid JSON, else where it stopped being able to (a streamed call's arguments are sent up to there, so
    a client never sees `{"tz": C`). Strict about structure, lenient where a token is still being written
    (a number's digits, a literal's letters, a string's escape)."""
    stack: list[str] = []  # "{" / "[" of the open containers
    expect = "value"  # value | key | colon | comma (after a value inside a container) | done
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in WS:
            i += 1
            continue
        if expect in ("value", "key") and c == '"':
            end = string_end(text, i)
            if end is None:  # still being written: valid if its escapes so far are
                body = text[i + 1:]
                return n if _OPEN_STRING.fullmatch(body) else i
            if not _CLOSED_STRING.fullmatch(text, i + 1, end - 1):
                return i
            i, expect = end, ("colon" if expect == "key" else "comma")
        elif expect == "value" and c in "{[":
            stack.append(c)
            i += 1
            expect = "key" if c == "{" else "value"
            if c == "[" and text[i:].lstrip(WS)[:1] == "]":  # an empty array
                i = text.index("]", i) + 1
                stack.pop()
                expect = "comma"
        elif expect == "key" and c == "}" and stack and stack[-1] == "{" and \
                text[:i].rstrip(WS).endswith("{"):  # an empty object
            stack.pop()
            i += 1
            expect = "comma"
        elif expect == "value" and (c == "-" or c.isdigit()):
            j = _NUMBER_PREFIX.match(text, i).end()
            if j == n:
                return n
            if text[j] not in _SCALAR_END or not re.fullmatch(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?",
                                                              text[i:j]):
                return j if text[j] not in _SCALAR_END else i
            i, expect = j, "comma"
        elif expect == "value" and c in "tfn":
            word = next((w for w in _LITERALS if w.startswith(text[i:i + len(w)]) and w[0] == c), None)
            if word is None:
                return i
            if not text.startswith(word, i):
                return n if word.startswith(text[i:]) else i
            i, expect = i + len(word), "comma"
        elif expect == "colon" and c == ":":
            i, expect = i + 1, "value"
        elif expect == "comma" and stack and c == ",":
            i, expect = i + 1, ("key" if stack[-1] == "{" else "value")
        elif expect == "comma" and stack and c == ("}" if stack[-1] == "{" else "]"):
            stack.pop()
            i += 1
            expect = "comma" if stack else "done"
        else:
            return i
        if expect == "comma" and not stack:
            expect = "done"
    return n
