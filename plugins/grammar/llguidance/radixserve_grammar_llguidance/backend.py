"""LLGuidanceBackend: RadixServe's grammar contract over llguidance's matcher.

llguidance has no separate compile step: a grammar is a JSON document that each LLMatcher parses
(lazily building its lexer). `compile` therefore converts the constraint and validates it against
the tokenizer, so a bad constraint is still a 400 before the request runs."""

from __future__ import annotations

import json
from typing import Any

import llguidance as llg
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import any_to_lark
from radixserve.interfaces.grammar import GrammarBackend, GrammarError, GrammarMatcher

from radixserve_grammar_llguidance.pattern_guard import misquoted_pattern

MAX_ROLLBACK_TOKENS = 16  # llguidance keeps the whole history; the core never rolls back more


class LLGuidanceMatcher(GrammarMatcher):
    """llguidance stops by itself once nothing may follow; RadixServe's contract terminates on the
    stop token, so a stop token accepted after that is kept here (`_virtual_stop`), not in llguidance."""

    max_rollback_tokens = MAX_ROLLBACK_TOKENS

    def __init__(self, tokenizer: Any, grammar: str, stop_token_ids: tuple[int, ...]) -> None:
        self._m = llg.LLMatcher(tokenizer, grammar)
        if self._m.is_error():
            raise GrammarError(self._m.get_error())
        self._stops = frozenset(stop_token_ids)
        self._terminated = False
        self._virtual_stop = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        t = int(token_id)
        if self._terminated:
            return False
        if t in self._stops:
            if self._m.is_stopped():
                self._terminated = self._virtual_stop = True
                return True
            if not self._m.is_accepting():
                return False
            self._terminated = bool(self._m.consume_token(t))
            return self._terminated
        # consume_token on a refused token would leave the matcher in its error state: check first
        if self._m.is_stopped() or self._m.validate_tokens([t]) < 1:
            return False
        return bool(self._m.consume_token(t))

    def rollback(self, num_tokens: int) -> None:
        n = int(num_tokens)
        if n and self._virtual_stop:
            n -= 1
            self._virtual_stop = False
        if n:
            self._m.rollback(n)
        if num_tokens:
            self._terminated = False

    def is_terminated(self) -> bool:
        return self._terminated


class LLGuidanceBackend(GrammarBackend):
    """JSON schema, regex, and EBNF in xgrammar's GBNF dialect (`root ::= ...`, converted to Lark
    by llguidance) or in Lark itself (detected by its syntax). JSON is generated
    compactly (`{"a":1}`)."""

    supported_kinds = ("json_schema", "regex", "ebnf")

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        try:
            self._tok = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=self.vocab_size, eos_token=list(self.stop_token_ids) or None
            )
        except Exception as e:
            raise GrammarError(f"llguidance cannot use this tokenizer: {e}") from None

    def compile(self, kind: str, text: str) -> str:
        try:
            if kind == "json_schema":
                problem = _schema_problem(text)
                if problem:
                    raise GrammarError(problem)
                grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(text)
            elif kind == "ebnf":
                lark = any_to_lark(text)  # GBNF converted; Lark passes through
                grammar = llg.LLMatcher.grammar_from_lark(lark)
            else:
                raise GrammarError(f"llguidance does not compile constraints of kind {kind!r}")
        except GrammarError:
            raise
        except Exception as e:
            raise GrammarError(str(e).strip()) from None
        problem = llg.LLMatcher.validate_grammar(grammar, self._tok)
        if problem:
            raise GrammarError(problem.strip())
        return grammar

    def new_matcher(self, compiled: str) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._tok, compiled, self.stop_token_ids)


def _schema_problem(text: str) -> str | None:
    """Why llguidance would generate strings `text`'s schema forbids (pattern_guard.py), or None;
    text that is not JSON is left to llguidance's own error."""
    try:
        schema = json.loads(text)
    except ValueError:
        return None
    return misquoted_pattern(schema)
