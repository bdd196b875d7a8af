"""Keep raw control characters out of the JSON strings an xgrammar JSON-schema grammar generates.

JSON (RFC 8259, section 7) forbids U+0000-U+001F unescaped inside a string. xgrammar 0.1.27's
JSON-schema converter respects that only in its unbounded string rule: strings with `minLength` /
`maxLength` use the class `[^"\\\\\\r\\n]`, and `pattern` strings use the regex's classes as they
are (`.` becomes `[\\0-\\U0010ffff]`, `\\s` includes `\\f` and `\\v`), so a model can emit e.g. U+0010
inside a string and the output is not valid JSON (strict parsers such as Python's `json.loads`
refuse it).

`exclude_control_characters(ebnf)` rewrites the printed grammar (`str(xgr.Grammar)`): every
character class that can produce string content loses U+0000-U+001F (and, in the classes it
rewrites, the quote and the backslash, which a `pattern`'s `.` would otherwise emit raw). The classes that legitimately
hold control characters are JSON's inter-token whitespace and the lookaheads built on it (`[ \\n\\t]`,
`[ \\n\\t,}\\]]`): a class is left alone when every character in it is JSON whitespace or structural
punctuation. Escaped forms (`\\n`, `\\u0010`) stay possible where the grammar allows escapes.

Known residue: a `pattern` whose class holds only whitespace and punctuation (e.g. `[ \\n]`) keeps
its `\\n`; a `pattern` with a literal control character (`\\x10` outside a class) is left as written."""

from __future__ import annotations

CONTROL = (0x00, 0x1F)
# what JSON forbids unescaped inside a string: control characters, the quote and the backslash
FORBIDDEN: list[tuple[int, int]] = [CONTROL, (0x22, 0x22), (0x5C, 0x5C)]
# characters the JSON grammar uses between tokens (whitespace) and in lookaheads after a value
_STRUCTURAL = frozenset(map(ord, " \t\n\r,}]:"))
_SIMPLE_ESCAPES = {"0": 0, "a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "e": 27}
_HEX_LENGTH = {"x": 2, "u": 4, "U": 8}

Ranges = list[tuple[int, int]]  # inclusive code point ranges


def exclude_control_characters(ebnf: str) -> str:
    """`ebnf` (xgrammar's printed grammar) with U+0000-U+001F removed from every character class
    that can generate string content (see the module docstring). Classes that change are printed
    again with hex escapes; all other text is kept byte for byte. Raises ValueError when a class
    holds nothing but forbidden characters (e.g. a `pattern` of `[\\x00-\\x1f]`)."""
    out: list[str] = []
    i, n = 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c == '"':  # a string literal: copy it (its brackets are not classes)
            j = _literal_end(ebnf, i)
            out.append(ebnf[i:j])
            i = j
        elif c == "[":
            j, negated, ranges = _parse_class(ebnf, i)
            out.append(_rewrite(ebnf[i:j], negated, ranges))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _literal_end(text: str, start: int) -> int:
    i = start + 1
    while text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _parse_class(text: str, start: int) -> tuple[int, bool, Ranges]:
    """Parse the class opening at `start`: (index after its `]`, negated, its ranges)."""
    i = start + 1
    negated = text[i] == "^"
    if negated:
        i += 1
    ranges: Ranges = []
    while text[i] != "]":
        lo, i = _class_char(text, i)
        if text[i] == "-" and text[i + 1] != "]":
            hi, i = _class_char(text, i + 1)
        else:
            hi = lo
        ranges.append((lo, hi))
    return i + 1, negated, ranges


def _class_char(text: str, i: int) -> tuple[int, int]:
    """One (possibly escaped) character of a class at `i`: (code point, next index)."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    e = text[i + 1]
    if e in _HEX_LENGTH:
        j = i + 2
        while j < len(text) and j < i + 2 + _HEX_LENGTH[e] and text[j] in "0123456789abcdefABCDEF":
            j += 1
        return int(text[i + 2:j], 16), j
    return _SIMPLE_ESCAPES.get(e, ord(e)), i + 2


def _rewrite(original: str, negated: bool, ranges: Ranges) -> str:
    if negated:  # in xgrammar's JSON grammars a negated class is always string content
        if all(_covers(ranges, span) for span in FORBIDDEN):
            return original
        return _print(True, _normalise(ranges + FORBIDDEN))
    members = _normalise(ranges)
    if not any(lo <= CONTROL[1] for lo, _ in members):
        return original  # no control character (structural classes: digits, escapes, lookaheads)
    if _only_structural(members):
        return original  # whitespace between tokens, or a lookahead on it
    kept = _subtract(members, FORBIDDEN)
    if not kept:  # xgrammar has no empty class (it clamps `[^\0-\U0010ffff]` to ASCII)
        raise ValueError(f"the character class {original} holds only characters a JSON string must escape "
                         "(control characters, quote, backslash); they cannot be generated raw")
    return _print(False, kept)


def _covers(ranges: Ranges, span: tuple[int, int]) -> bool:
    lo, hi = span
    return any(a <= lo and b >= hi for a, b in _normalise(ranges))


def _subtract(ranges: Ranges, removed: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in ranges:
        pieces = [(lo, hi)]
        for r_lo, r_hi in removed:
            pieces = [p for a, b in pieces for p in ((a, min(b, r_lo - 1)), (max(a, r_hi + 1), b)) if p[0] <= p[1]]
        out += pieces
    return out


def _only_structural(ranges: Ranges) -> bool:
    return all(hi - lo < 64 and all(c in _STRUCTURAL for c in range(lo, hi + 1)) for lo, hi in ranges)


def _normalise(ranges: Ranges) -> Ranges:
    merged: Ranges = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _print(negated: bool, ranges: Ranges) -> str:
    body = "".join(_esc(lo) if lo == hi else f"{_esc(lo)}-{_esc(hi)}" for lo, hi in ranges)
    return f"[{'^' if negated else ''}{body}]"


def _esc(cp: int) -> str:
    if chr(cp).isalnum() and cp < 0x80:
        return chr(cp)
    if cp < 0x100:
        return f"\\x{cp:02x}"
    if cp < 0x10000:
        return f"\\u{cp:04x}"
    return f"\\U{cp:08x}"
