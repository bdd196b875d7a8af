"""Stop strings matched where tokens are made: incremental decoding of a request's output.

The scheduler ends a request on the step its text first contains a stop string (no extra decode
steps, no round trip through the detokenizer); the detokenizer uses the same decoding to cut and
stream the text, so both processes agree on where the stop string starts.

Why offsets: decoding only the new ids loses context (leading spaces of sentencepiece/BPE pieces,
multi-byte characters split over tokens). Each step decodes a small window twice, from
`prefix_offset` to `read_offset` and from `prefix_offset` to the end, and takes the difference,
but only when it does not end in U+FFFD (an incomplete UTF-8 sequence): those bytes wait for the
next token instead of becoming a broken character.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDecoder:
    """Text of a growing id sequence, decoded in the context of `context_ids` (never part of it)."""

    def __init__(self, tokenizer: Any, context_ids: list[int] | None = None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(context_ids or [])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def push(self, new_ids: list[int], final: bool = False) -> str | None:
        """The text completed by adding `new_ids`; None while they end inside a multi-byte character
        (`final`: no more ids come, so an unfinished character is dropped instead)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if final:
            new_text = new_text.rstrip(REPLACEMENT_CHAR)
        elif new_text.endswith(REPLACEMENT_CHAR):
            return None
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token: nothing to show, and nothing pending either
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]


def find_stop(text: str, stop: list[str], after: int) -> tuple[int, str] | None:
    """(position, string) of the earliest stop string in `text` that ends past `text[:after]`, or None.

    Callers pass the text length before the newest piece: a stop string wholly inside older text was
    either found when that text arrived or was not searched for then (`min_new_tokens` held it), and
    must not end the request now."""
    best: tuple[int, str] | None = None
    for s in stop:
        i = text.find(s, max(0, after - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string: text that a
    later token may turn into a stop string, so it must not be shown yet."""
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class StopStringMatcher:
    """Finds the first stop string in one request's output as its tokens arrive (scheduler side).

    After each `push(token, search)`:
    - `matched`: the stop string, once the output text contains one that ends in text a token pushed
      with `search` completed (push returns it then); text completed by tokens pushed without it (the
      request's first `min_new_tokens`, as vLLM and SGLang hold stop strings back) is never matched,
      though a stop string may start there and end later;
    - `held`: how many leading tokens were pushed without `search` (the detokenizer makes the same cut);
      `keep` is then the number of output tokens that lie wholly before it: the request returns
      only those (their ids and logprobs), and the text is cut where the stop string starts.
    - `safe`: how many leading output tokens no later match can take back (none of their text is
      part of a possible stop-string prefix or an unfinished character); a stream may send them.
    """

    def __init__(
        self, tokenizer: Any, stop: list[str], context_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self.stop = [s for s in stop if s]
        if not self.stop:
            raise ValueError("StopStringMatcher needs at least one non-empty stop string")
        self._decoder = IncrementalDecoder(tokenizer, context_ids, skip_special_tokens)
        self._text = ""
        self._ends: list[int] = []  # per decoded output token: text length once it was decoded
        self._pushed = 0
        self.held = 0
        self.matched: str | None = None
        self.keep = 0
        self.safe = 0

    def push(self, token: int, search: bool = True) -> str | None:
        """Add one output token; the matched stop string, or None. `search=False` (only for a prefix of
        the output: once True, always True) adds its text without looking for stop strings in it."""
        if self.matched is not None:
            return self.matched
        if not search and self.held < self._pushed:
            raise ValueError("stop strings can be held back only for leading tokens")
        self._pushed += 1
        self.held += not search
        piece = self._decoder.push([token])
        if piece is None:
            return None  # the token ends mid-character: decided with the next one
        before = len(self._text)
        self._text += piece
        self._ends.extend([len(self._text)] * (self._pushed - len(self._ends)))
        hit = find_stop(self._text, self.stop, before) if search else None
        if hit is not None:
            start, self.matched = hit
            self.keep = bisect_right(self._ends, start)
            self.safe = self.keep
            return self.matched
        self.safe = bisect_right(self._ends, len(self._text) - stop_prefix_len(self._text, self.stop))
        return None
