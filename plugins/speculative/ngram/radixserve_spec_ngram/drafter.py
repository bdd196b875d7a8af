"""NgramDrafter: proposes what followed the request's latest tokens elsewhere in the text seen so far.

Copy-heavy requests (rewrite this passage, quote the document, edit this code) repeat long runs of
their own prompt. The drafter keeps one n-gram trie (`trie.NgramTrie`) fed with every request's
prompt and verified output, shared across requests, and for each request looks up the longest
suffix of its tokens (between `min_match_window` and `max_match_window` tokens) that was seen
followed by something; the continuation becomes the draft: a chain of the best-ranked next
tokens, or, when the core verifies trees and `speculative.topk` > 1, a tree of the most probable
continuations. No draft model, nothing on the device: the cost is host-side dict lookups
(`python -m radixserve_spec_ngram.measure` prints it: tens of microseconds per request and step).

Options (keyword arguments, set with `speculative.options` in the config):
  min_match_window  shortest suffix to match, in tokens (default 1)
  max_match_window  longest suffix to match (default 8); longer matches are tried first. The
                    trie stores n-grams of up to max_match_window + 1 tokens, so feeding a token
                    costs about max_match_window + 1 dict steps; a draft longer than that
                    re-matches on its own latest tokens at each step
  capacity          most trie nodes kept across all requests (default 400000, about 100 MB);
                    the least recently used n-grams are evicted beyond it
  rank              "frequency" (default: most frequent continuation first, the most recent
                    among equals) or "recency" (the latest continuation first)
  max_tracked_requests  per-request cursors kept at most (default 4096); a safety net only,
                    the core drops a request's cursor through `on_finished`
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from radixserve.interfaces.drafter import Drafter, DraftProposal

from radixserve_spec_ngram.trie import NgramTrie

_RANKS = ("frequency", "recency")


@dataclass
class _RequestState:
    cursor: list[tuple[int, int]]  # the trie nodes (id, generation) of the request's current suffixes
    fed: int  # tokens of prompt + output fed to the trie so far
    prompt_len: int
    last_token: int  # the latest fed token: a reused rid with other tokens is detected and reset


class NgramDrafter(Drafter):
    """Prompt-and-history lookup drafter (kind "drafter", name "ngram"). See the module docstring."""

    def __init__(
        self,
        info: Any = None,
        *,
        min_match_window: int = 1,
        max_match_window: int = 8,
        capacity: int = 400_000,
        rank: str = "frequency",
        max_tracked_requests: int = 4096,
    ) -> None:
        self.info = info
        for name, value in (("min_match_window", min_match_window), ("max_match_window", max_match_window),
                            ("capacity", capacity),
                            ("max_tracked_requests", max_tracked_requests)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative.options.{name} must be a positive integer, got {value!r}")
        if min_match_window > max_match_window:
            raise ValueError(f"speculative.options.min_match_window ({min_match_window}) must be <= "
                             f"max_match_window ({max_match_window})")
        if capacity < 4 * (max_match_window + 1):
            raise ValueError(f"speculative.options.capacity must be >= 4 * (max_match_window + 1) = "
                             f"{4 * (max_match_window + 1)}, got {capacity}")
        if rank not in _RANKS:
            raise ValueError(f"speculative.options.rank must be one of {list(_RANKS)}, got {rank!r}")
        self.min_match_window = min_match_window
        self.max_match_window = max_match_window
        self.rank = rank
        self.max_tracked_requests = max_tracked_requests
        self.trie = NgramTrie(max_match_window + 1, capacity)
        topk = int(getattr(info, "topk", 1) or 1)
        # trees only when the verifying attention backend takes a tree mask (DrafterInfo.supports_tree)
        self.topk = topk if getattr(info, "supports_tree", False) else 1
        vocab = getattr(info, "vocab_size", None)
        self._vocab_size = int(vocab) if vocab else None
        self._states: OrderedDict[str, _RequestState] = OrderedDict()

    # ---- the Drafter contract ----------------------------------------------------------------
    def propose(self, reqs: list, num_draft_tokens: int) -> DraftProposal:
        trie = self.trie
        tokens: list[list[int]] = []
        parents: list[list[int]] = []
        for req in reqs:
            state = self._sync(req)
            node = trie.match(state.cursor, self.min_match_window, self.max_match_window)
            if node is None or num_draft_tokens < 1:
                draft, tree = [], []
            else:
                tail = self._tail(req)
                if self.topk > 1:
                    draft, tree = trie.tree(node, tail, num_draft_tokens, self.topk, self.min_match_window,
                                            self.max_match_window, self.rank)
                else:
                    draft = trie.chain(node, tail, num_draft_tokens, self.min_match_window, self.max_match_window,
                                       self.rank)
                    tree = list(range(-1, len(draft) - 1))
            if self._vocab_size is not None and any(t >= self._vocab_size for t in draft):
                draft, tree = self._cut_to_vocab(draft, tree)
            tokens.append(draft)
            parents.append(tree)
        return DraftProposal(tokens, parents if self.topk > 1 else None)

    def on_accepted(self, req, accepted: list[int]) -> None:
        # req.output_ids already ends with `accepted` (the contract): catching up feeds exactly them
        self._sync(req)

    def on_finished(self, req) -> None:
        self._states.pop(req.rid, None)

    # ---- internals ---------------------------------------------------------------------------
    @property
    def tracked_requests(self) -> int:
        """Requests whose cursor is kept (for tests and statistics)."""
        return len(self._states)

    def _tail(self, req) -> list[int]:
        """The request's last max_match_window tokens (the context drafts re-match on)."""
        w, output = self.max_match_window, req.output_ids
        if len(output) >= w:
            return list(output[-w:])
        return list(req.origin_input_ids[max(0, len(req.origin_input_ids) - (w - len(output))) :]) + list(output)

    def _sync(self, req) -> _RequestState:
        """Feed the request's tokens the trie has not seen yet; return its state."""
        prompt, output = req.origin_input_ids, req.output_ids
        total = len(prompt) + len(output)
        state = self._states.get(req.rid)
        if state is not None and not self._consistent(state, prompt, output, total):
            state = None  # a reused rid (or a request whose history changed): start over
        if state is None:
            state = _RequestState(cursor=[], fed=0, prompt_len=len(prompt), last_token=-1)
            self._states[req.rid] = state
            while len(self._states) > self.max_tracked_requests:
                self._states.popitem(last=False)
        else:
            self._states.move_to_end(req.rid)
        if state.fed < total:
            new = prompt[state.fed :] if state.fed < len(prompt) else []
            new = list(new) + list(output[max(0, state.fed - len(prompt)) :])
            state.cursor = self.trie.feed(state.cursor, new)
            state.fed = total
            state.last_token = new[-1]
        return state

    @staticmethod
    def _consistent(state: _RequestState, prompt, output, total: int) -> bool:
        if state.prompt_len != len(prompt) or state.fed > total:
            return False
        if state.fed == 0:
            return True
        i = state.fed - 1
        return (prompt[i] if i < len(prompt) else output[i - len(prompt)]) == state.last_token

    def _cut_to_vocab(self, draft: list[int], tree: list[int]) -> tuple[list[int], list[int]]:
        # a token outside the target's vocabulary (a trie fed by another model's requests) ends its branch
        keep: list[int] = []
        index: dict[int, int] = {}
        for j, (t, p) in enumerate(zip(draft, tree)):
            if t < self._vocab_size and (p == -1 or p in index):
                index[j] = len(keep)
                keep.append(j)
        return [draft[j] for j in keep], [index[tree[j]] if tree[j] != -1 else -1 for j in keep]
