"""GrammarBackend: constrained decoding (structured output) for JSON schemas, regexes and grammars."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

# The constraint kinds a request can carry (the SamplingParams field of the same name holds its
# text). "json_schema" text is a JSON schema serialised as JSON; `{"type": "object"}` is how the API
# asks for "any JSON object" (response_format json_object).
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


class GrammarError(ValueError):
    """A constraint the backend cannot compile: invalid syntax, or a feature it does not support.
    The message names the problem (the core prefixes the request field and returns HTTP 400).

    Added in plugin API 1.1."""


def resolve_json_pointer(root: Any, pointer: str) -> Any:
    """The part of the schema (any JSON document) `root` that the local reference `pointer` names ("#" is `root`
    itself; "#/$defs/a~1b/0" walks keys and list indexes, with RFC 6901's `~1` for "/" and `~0` for
    "~"). Raises LookupError when `pointer` is not local (does not start with "#") or names nothing.
    A helper for backends that rewrite schemas (`$ref`s to `$defs`); the core checks schemas with it too.

    Added in plugin API 1.17."""
    if not isinstance(pointer, str) or not (pointer == "#" or pointer.startswith("#/")):
        raise LookupError(f"{str(pointer)[:80]!r} is not a JSON pointer inside the schema (\"#\" or \"#/...\")")
    node = root
    for part in pointer[2:].split("/") if pointer != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise LookupError(f"{pointer[:80]!r} names nothing in the schema")
    return node


def bitmask_width(vocab_size: int) -> int:
    """32-bit words per bitmask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


class GrammarMatcher(abc.ABC):
    """The state of one request's constraint: which tokens may come next.

    Contract:
    - A fresh matcher is at the start of the output (no token accepted).
    - `fill_bitmask(bitmask, row)` writes the allowed next tokens into `bitmask[row]`; it does not
      change the state. The mask is exact:
      - sound: a token is allowed only if its bytes continue the output so far towards some valid
        output (never special tokens other than the stop tokens, never ids >= len(tokenizer));
      - complete: every token whose bytes continue towards a valid output is allowed, so every valid
        output stays reachable; the one freedom is text the constraint forces (one way on, e.g.
        `es!` after `y` in `(yes|no)!`), of which a backend may allow some tokenizations only
        (llguidance allows the tokenizer's own: `es`, not `e`);
      - the stop tokens given to the backend are allowed exactly when the text so far is a complete
        match, also when it could still be extended (`[0-9]+` after `1`); when nothing may follow,
        they are the only allowed tokens.
      A token's bytes are what it adds to the decoded text: a byte-level BPE piece through the GPT-2
      byte table, a `<0xNN>` byte-fallback token its byte, `▁` a space (see
      `radixserve.serving_tokenizer.TokenBytes`). A token holding part of a UTF-8 character (its
      `decode` alone is U+FFFD) is judged by its bytes like any other, never skipped.
    - `accept_token(token)` advances the state by one token and returns True, or returns False and
      leaves the state unchanged when the token is not allowed. Accepting a stop token where the
      constraint is complete terminates the matcher.
    - `rollback(n)` undoes the last `n` accepted tokens (speculative decoding rejects drafts);
      `n` is at most the number accepted and at most `max_rollback_tokens`.
    - `is_terminated()` is True once a stop token was accepted at the end of the constraint; the
      core then ends the request (finish reason "stop").
    - One matcher serves one request; the core calls it from one thread at a time (the scheduler's).

    Added in plugin API 1.1.
    """

    # how many accepted tokens `rollback` can undo at least (the core never asks for more)
    max_rollback_tokens: ClassVar[int] = 0

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into one row of a bitmask.

        :param bitmask: int32 CPU tensor [batch, ceil(vocab_size / 32)] from
            `GrammarBackend.allocate_bitmask`; token t is allowed iff bit t % 32 of word t // 32 of
            the row is set. Every word of the row must be written (the core reuses buffers).
        :param row: the row to fill.
        :return: nothing.
        Restrictions: must not change the matcher's state; must return quickly (it runs between
        forward passes, once per constrained request per step: well under a millisecond is the aim).
        Added in plugin API 1.1.
        """

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one generated token.

        :param token_id: the sampled token (a row of the model's vocabulary).
        :return: True when accepted; False when the constraint does not allow it (the state is then
            unchanged; the core ends the request with an error, since its mask allowed the token).
        Added in plugin API 1.1.
        """

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (0 is a no-op).

        Restrictions: `num_tokens` <= tokens accepted and <= `max_rollback_tokens`; a terminated
        matcher rolled back past its stop token is no longer terminated.
        Added in plugin API 1.1.
        """

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted where the constraint is complete.

        Added in plugin API 1.1.
        """


class GrammarBackend(abc.ABC):
    """Compiles constraints for one tokenizer and makes per-request matchers. Kind "grammar",
    selected by the config key `stack.grammar` (default: the highest-priority installed one; "none"
    turns structured output off).

    Contract:
    - Built once per scheduler, in a worker thread, as
      `Backend(tokenizer, vocab_size, stop_token_ids)`: `tokenizer` is the model's
      Hugging Face tokenizer (a `PreTrainedTokenizerFast`), `vocab_size` the width of the model's
      logits (may exceed `len(tokenizer)`: the extra rows are never allowed), `stop_token_ids` the
      model's end-of-sequence ids (the tokens that may end a complete constraint). Raise
      GrammarError when the tokenizer cannot be used.
    - `compile(kind, text)` turns a constraint into an opaque compiled grammar. It runs in a
      thread pool, possibly several at once, so it must be thread-safe; it may be slow (the core
      caches the result by (backend, kind, text, tokenizer) and never compiles the same key twice).
      Invalid or unsupported constraints raise GrammarError naming the problem.
    - `new_matcher(compiled)` returns a fresh GrammarMatcher (cheap; called on the scheduler thread).
    - `apply_bitmask_inplace(logits, bitmask)` sets the logits of disallowed tokens to -inf; the
      default is a torch implementation for any device; a backend may override it with a fused
      kernel (same result).
    - `supported_kinds` lists the kinds of GRAMMAR_KINDS it compiles; a request with another kind
      is refused with HTTP 400 before it reaches `compile`.

    Check a backend with `radixserve.testing.check_grammar_backend(MyBackend, tokenizer)`.

    Added in plugin API 1.1.
    """

    supports_tensor_parallel: bool = True
    """Class flag: this component works when `runtime.tp_size > 1`. True by default: grammars run in
    the rank-0 scheduler and mask the full-vocabulary logits every rank gathers. Set False to
    make the stack resolution refuse it with tp_size > 1. Added in plugin API 1.3."""

    supported_kinds: ClassVar[tuple[str, ...]] = GRAMMAR_KINDS

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)

    @abc.abstractmethod
    def compile(self, kind: str, text: str) -> Any:
        """Compile one constraint.

        :param kind: one of `supported_kinds`.
        :param text: the constraint (JSON schema as JSON text, regex, or EBNF in the backend's
            dialect; xgrammar's is GBNF-like with `root ::= ...`).
        :return: any object `new_matcher` accepts; it is shared by every request with the same
            constraint, so it must not hold per-request state.
        Restrictions: thread-safe; raises GrammarError (never another exception) for bad input.
        Added in plugin API 1.1.
        """

    @abc.abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A matcher at the start of `compiled` for one request.

        Added in plugin API 1.1.
        """

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """An int32 CPU tensor [batch_size, ceil(vocab_size / 32)] with every token allowed.

        Added in plugin API 1.1."""
        import torch

        return torch.full((batch_size, bitmask_width(self.vocab_size)), -1, dtype=torch.int32)

    def fill_bitmasks(self, bitmask: torch.Tensor, rows: Sequence[tuple[int, GrammarMatcher]]) -> None:
        """Fill several rows of one bitmask: `matcher.fill_bitmask(bitmask, row)` for each pair.

        :param bitmask: as for `GrammarMatcher.fill_bitmask`.
        :param rows: (row, matcher) pairs, rows distinct; the matchers are this backend's.
        :return: nothing.
        The default fills the rows one after another. A backend may override it to fill them in
        parallel (the core calls it once per step with every constrained row, so a batch of 64 rows
        costs one call), with the same result. Restrictions: as `fill_bitmask` (no state change);
        it may use threads of its own but must return only when every row is written.
        Added in plugin API 1.6.
        """
        for row, matcher in rows:
            matcher.fill_bitmask(bitmask, row)

    def accept_tokens(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[bool]:
        """Advance several matchers by one token each: `matchers[k].accept_token(tokens[k])`.

        :param matchers: distinct matchers of this backend.
        :param tokens: one sampled token per matcher.
        :return: one flag per matcher, as `accept_token` returns it (a refused token leaves its
            matcher unchanged).
        The default accepts them one after another; a backend may override it with one call into
        its library (the core calls it once per step with every constrained row). Restrictions: as
        `accept_token`.
        Added in plugin API 1.7.
        """
        return [m.accept_token(t) for m, t in zip(matchers, tokens, strict=True)]

    def apply_bitmask_inplace(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Set `logits[i, t]` to -inf wherever bit t of `bitmask[i]` is clear.

        :param logits: float [batch, V] on the model's device (V >= vocab_size may include padding,
            which stays untouched beyond the bitmask's width).
        :param bitmask: int32 [batch, ceil(vocab_size / 32)] on the same device.
        Added in plugin API 1.1.
        """
        apply_bitmask_torch(logits, bitmask, self.vocab_size)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """The reference bitmask application (any device): unpack the words, mask the logits."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    banned = (((bitmask.unsqueeze(-1) >> shifts) & 1) == 0).flatten(1)  # [batch, 32 * words]
    n = min(vocab_size, logits.shape[-1])
    logits[:, :n].masked_fill_(banned[:, :n], float("-inf"))
