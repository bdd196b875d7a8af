"""What one chat choice's raw output becomes: reasoning, content and tool calls.

`ChoiceOutput` runs the reasoning parser, then the tool parser on what follows the reasoning, on
the whole text so far (both parsers are prefix-stable, see their contracts). Non-streaming it
returns the parts; streaming it returns only what is new since the last call, shaped the way
OpenAI's client joins deltas: a call's first delta has its id, type and name (arguments ""), the
next ones argument fragments, all with the call's index."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from radixserve.interfaces.reasoning_parser import ReasoningParser
from radixserve.interfaces.tool_parser import ParsedToolCall, ToolParser

logger = logging.getLogger("radixserve.server")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallOut:
    id: str
    name: str
    arguments: str


@dataclass
class ChoiceParts:
    """A finished choice: `content` None when the output is only tool calls."""

    content: str | None
    reasoning: str | None
    calls: list[CallOut]


@dataclass
class CallDelta:
    index: int
    id: str | None  # set on the call's first delta only (with the name)
    name: str | None
    arguments: str


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ChoiceOutput:
    """One choice's parsers and what has been streamed of it."""

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None = None
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls  # parallel_tool_calls=false: 1
        self._sent_reasoning = ""
        self._sent_content = ""
        self._sent_calls: list[CallOut] = []
        self._bound: list[int] = []  # the client's index of each call of the parser's snapshot

    @property
    def has_calls(self) -> bool:
        return bool(self._sent_calls)

    def _parts(self, text: str, final: bool) -> tuple[str, str, tuple[ParsedToolCall, ...]]:
        reasoning, rest = self.reasoning.split(text, final) if self.reasoning else ("", text)
        if self.tools is None:
            return reasoning.strip(), rest.strip(), ()
        parsed = self.tools.parse(rest, final)
        calls = parsed.calls if self.max_calls is None else parsed.calls[: self.max_calls]
        # whitespace around the parts is held back while streaming: a prefix-stable trim
        return reasoning.strip(), parsed.content.strip(), calls

    def finish(self, text: str) -> ChoiceParts:
        """The parts of a complete (non-streamed) output."""
        reasoning, content, calls = self._parts(text, True)
        self._sent_calls = [CallOut(new_call_id(), c.name, c.arguments) for c in calls]
        return ChoiceParts(
            content=content if content or not calls else None,
            reasoning=reasoning or None,
            calls=list(self._sent_calls),
        )

    def delta(self, text: str, final: bool) -> ChoiceDelta:
        """What is new in `text` (the whole output so far) since the previous call."""
        reasoning, content, calls = self._parts(text, final)
        out = ChoiceDelta(
            reasoning=_grown(self._sent_reasoning, reasoning, "reasoning"),
            content=_grown(self._sent_content, content, "content"),
        )
        self._sent_reasoning += out.reasoning
        self._sent_content += out.content
        for j, call in enumerate(calls):
            if j < len(self._bound):
                sent = self._sent_calls[self._bound[j]]
                if call.name == sent.name and call.arguments.startswith(sent.arguments):
                    self._grow(out, self._bound[j], call)
                    continue
                # the parser dropped the call streamed here (it turned out malformed; its text
                # becomes content): the client keeps it, later calls get new indices
                logger.info("a streamed tool call (%s) turned out malformed; its text is sent as content", sent.name)
                del self._bound[j:]
            index = len(self._sent_calls)
            self._bound.append(index)
            self._sent_calls.append(CallOut(new_call_id(), call.name, ""))
            out.calls.append(CallDelta(index, self._sent_calls[index].id, call.name, ""))
            self._grow(out, index, call)
        del self._bound[len(calls) :]
        return out

    def _grow(self, out: ChoiceDelta, index: int, call: ParsedToolCall) -> None:
        sent = self._sent_calls[index]
        fragment = call.arguments[len(sent.arguments) :]
        if fragment:
            sent.arguments += fragment
            out.calls.append(CallDelta(index, None, None, fragment))


def _grown(sent: str, now: str, what: str) -> str:
    """The new tail of `now` after `sent`; nothing when a parser broke prefix stability (what was
    streamed cannot be taken back)."""
    if now.startswith(sent):
        return now[len(sent) :]
    if not sent.startswith(now):
        logger.warning("a parser's %s is not prefix-stable; dropping the change", what)
    return ""
