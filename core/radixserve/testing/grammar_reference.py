"""The grammar kit's reference mask for its regex-like cases: the exact set of tokens a backend must
allow after an output prefix, computed from each token's bytes with the `regex` module's partial
matching. This is what catches a mask that drops valid continuations, or that holds the stop token
back while the output is a complete match that could still go on (`[0-9]+` after `1`).

A token's bytes are what it adds to the decoded text (`radixserve.serving_tokenizer.TokenBytes`): a
byte-level BPE piece through the GPT-2 byte table, a `<0xNN>` byte-fallback token its byte, `▁` a
space. A token holding part of a UTF-8 character (its `decode` alone is U+FFFD) still has its bytes,
and a backend must allow it wherever they continue a valid output. Special tokens other than the
stop tokens are never allowed."""

from __future__ import annotations

from typing import Any

from radixserve.serving_tokenizer import TokenBytes


class RegexReference:
    """Which tokens may follow an output prefix under a regex (whole output must fullmatch it).
    Characters outside ASCII are completed only from those the pattern spells literally, which is
    enough for the kit's own cases."""

    def __init__(self, pattern: str, tokenizer: Any, stop_token_ids: list[int]) -> None:
        import regex  # a dependency of transformers: partial matching, which `re` lacks

        self._rx = regex.compile(pattern)
        self._chars = sorted({c for c in pattern if ord(c) > 127})
        self._bytes = TokenBytes(tokenizer.backend_tokenizer)
        special = set(getattr(tokenizer, "all_special_ids", None) or ())
        every = [t for t in range(len(tokenizer)) if t not in special]
        self._tokens = [t for t in every if self._bytes(t)]
        self.unjudged = frozenset(every) - frozenset(self._tokens)  # no bytes: nothing to say about them
        self.stops = frozenset(stop_token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes(token_id)

    def complete(self, data: bytes) -> bool:
        """The output so far is a whole match: a stop token must be allowed."""
        try:
            return self._rx.fullmatch(data.decode()) is not None
        except UnicodeDecodeError:
            return False

    def viable(self, data: bytes) -> bool:
        """Some match starts with these bytes."""
        try:
            return self._rx.fullmatch(data.decode(), partial=True) is not None
        except UnicodeDecodeError as e:
            if e.end < len(data) or len(data) - e.start > 3:  # bytes no UTF-8 text starts with
                return False
            head, tail = data[: e.start], data[e.start :]
            return any(c.encode().startswith(tail) and self.viable(head + c.encode()) for c in self._chars)

    def forced(self, data: bytes, limit: int = 64) -> bytes:
        """The bytes every valid output that starts with `data` continues with (empty where it may
        end or branch)."""
        out = b""
        while len(out) < limit and not self.complete(data + out):
            nexts = [b for b in range(256) if self.viable(data + out + bytes([b]))]
            if len(nexts) != 1:
                break
            out += bytes(nexts)
        return out

    def allowed(self, data: bytes) -> set[int]:
        """The tokens a conforming mask allows after the output `data`."""
        out = {t for t in self._tokens if self.viable(data + self._bytes(t))}
        return out | self.stops if self.complete(data) else out
