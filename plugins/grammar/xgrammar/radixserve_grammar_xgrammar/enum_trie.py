"""Work around xgrammar 0.1.27's over-merging of alternations of string literals.

xgrammar builds a finite-state machine for a rule whose body is a choice of literals (a JSON
`enum`: `x ::= ("\\"Sr\\"") | ("\\"I\\"") | ("\\"II\\"")`) and then merges states it wrongly takes
for equivalent: that rule accepts `"SrI"`, `"IIII"`, ... (xgrammar issue #618, fixed upstream in
PR #632 after 0.1.34). Found by SmolLM2 writing `"SrI"` for an enum of name suffixes
(benchmarks/results/cpu-structured-output.md).

`factor_literal_choices(ebnf)` rewrites every such rule of a printed grammar into a prefix tree
whose branching points are nested groups (`"\\"" ("Sr\\"" | "I" ("\\"" | "I" ...))`). xgrammar turns
each nested group into a rule of its own whose alternatives start with distinct characters, which
its merging leaves correct (checked against the plain form on random enums: tests/test_grammar_enum_trie.py)."""

from __future__ import annotations

import re

_LITERAL = r'"(?:[^"\\]|\\.)*"'
# a whole rule that is a choice of two or more string literals, with an optional lookahead
_CHOICE_RULE = re.compile(
    rf"^(?P<name>\S+) ::= \((?P<alts>\({_LITERAL}\)(?: \| \({_LITERAL}\))+)\)(?P<rest>(?: \(=.*\))?)$"
)
# one character of a literal: an escape (\x1f, \u00e9, \U0001f600, \") or a plain character
_ATOM = re.compile(r"\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}|\\.|.", re.S)


def factor_literal_choices(ebnf: str) -> str:
    """`ebnf` with each rule that chooses among string literals rewritten as a prefix tree of the
    same strings (the same language); every other line is kept as it is."""
    out = []
    for line in ebnf.split("\n"):
        m = _CHOICE_RULE.match(line)
        if m:
            words = [tuple(_ATOM.findall(lit[2:-2])) for lit in re.findall(rf"\({_LITERAL}\)", m["alts"])]
            line = f"{m['name']} ::= ({_trie(sorted(set(words)))}){m['rest']}"
        out.append(line)
    return "\n".join(out)


def _trie(words: list[tuple[str, ...]]) -> str:
    """A choice expression for `words` (sequences of literal atoms) where alternatives start with
    distinct atoms."""
    by_first: dict[str, list[tuple[str, ...]]] = {}
    alts = []
    for w in words:
        if not w:
            alts.append('""')
        else:
            by_first.setdefault(w[0], []).append(w[1:])
    for first, rests in by_first.items():
        if len(rests) == 1:
            alts.append('"' + first + "".join(rests[0]) + '"')
        else:
            alts.append(f'"{first}" ({_trie(rests)})')
    return " | ".join(alts)
