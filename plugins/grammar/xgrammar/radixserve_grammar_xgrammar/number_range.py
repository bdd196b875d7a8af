"""Numbers with both `minimum` and `maximum` (pydantic's `float = Field(ge=0, le=1)`), which xgrammar
(0.1.27 and 0.1.34) compiles to a grammar that lets values outside the range through ("1,5" and "175"
for [0.5, 1.5], "1.5" for [0, 1]). When both bounds are integers at most MAX_SPAN apart, the
subschema is replaced by a sentinel string `const` before xgrammar converts the schema, and the
sentinel's literal in the EBNF by a rule of our own that writes exactly the decimals in the range:
an integer part from the range, a fraction of at most MAX_FRACTION_DIGITS digits (only zeros after
the upper bound's integer part and after a negative lower bound's), no exponent. Every output is in
the range; a few values are not written ("-0", exponents, more fraction digits)."""

from __future__ import annotations

import math
import re

MAX_SPAN = 1000  # integer parts enumerated in the rule
MAX_FRACTION_DIGITS = 15
_SENTINEL = "RADIXSERVE-RANGE:{lo}:{hi}"
_IN_EBNF = re.compile(r'"\\"RADIXSERVE-RANGE:(-?\d+):(-?\d+)\\""')
# what may stand beside the range: keys without an assertion whose loss changes nothing ($defs would)
_BESIDE_A_RANGE = {"title", "description", "$comment", "examples", "default", "deprecated", "readOnly", "writeOnly"}


def mark_number_range(node: dict) -> None:
    """Replace, in place, `node` when it is `{"type": "number", "minimum": lo, "maximum": hi}` with integer
    lo <= hi at most MAX_SPAN apart (annotations aside, no other keyword) by its sentinel `const`."""
    bounds = _integer_bounds(node)
    if bounds is not None:
        node.clear()
        node["const"] = _SENTINEL.format(lo=bounds[0], hi=bounds[1])


def _integer_bounds(node: dict) -> tuple[int, int] | None:
    if node.get("type") != "number" or set(node) - _BESIDE_A_RANGE != {"type", "minimum", "maximum"}:
        return None
    lo, hi = node["minimum"], node["maximum"]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v == int(v)
               for v in (lo, hi)):
        return None
    lo, hi = int(lo), int(hi)
    return (lo, hi) if 0 <= hi - lo <= MAX_SPAN else None


def expand_number_ranges(ebnf: str) -> str:
    """`ebnf` (xgrammar's text for a marked schema) with each sentinel literal replaced by its range rule."""
    rules: dict[str, str] = {}

    def replace(m: re.Match) -> str:
        lo, hi = int(m[1]), int(m[2])
        name = f"radixserve_range_{'m' if lo < 0 else ''}{abs(lo)}_{'m' if hi < 0 else ''}{abs(hi)}"
        if name not in rules:
            rules[name] = _range_rules(name, lo, hi)
        return name

    body = _IN_EBNF.sub(replace, ebnf)
    return body + "".join("\n" + r for r in rules.values())


def _range_rules(name: str, lo: int, hi: int) -> str:
    any_fraction = f'("" | ("." [0-9]{{1,{MAX_FRACTION_DIGITS}}}))'
    zero_fraction = f'("" | ("." [0]{{1,{MAX_FRACTION_DIGITS}}}))'
    parts, rules = [], []

    def ints(tag: str, first: int, last: int) -> str:  # a rule choosing one of the integers first..last
        rules.append(f"{name}_{tag} ::= (" + " | ".join(f'("{k}")' for k in range(first, last + 1)) + ")")
        return f"{name}_{tag}"

    if hi >= 1 and max(lo, 0) <= hi - 1:  # k + f with k in [max(lo, 0), hi - 1]
        parts.append(f"({ints('p', max(lo, 0), hi - 1)} {any_fraction})")
    if hi >= 0 and hi >= lo:  # hi itself (zeros after it); 0 when the range is [lo, 0]
        parts.append(f'("{hi}" {zero_fraction})')
    if lo < 0:
        first = max(0, -hi)
        if first <= -lo - 1:  # -(k + f) with k in [max(0, -hi), -lo - 1]
            parts.append(f'("-" {ints("n", first, -lo - 1)} {any_fraction})')
        if -lo >= first:  # lo itself (zeros after it)
            parts.append(f'("-{-lo}" {zero_fraction})')
    return f"{name} ::= (" + " | ".join(parts) + ")" + "".join("\n" + r for r in rules)
