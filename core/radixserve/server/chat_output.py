"""What one chat choice's raw output becomes: reasoning, content and tool calls.

`ChoiceOutput` runs the reasoning parser, then the tool parser on what follows the reasoning, on
the whole text so far (both parsers are prefix-stable, see their contracts). Non-streaming it
returns the parts; streaming it returns only what is new since the last call, shaped the way
OpenAI's client joins deltas: a call's first delta has its id, type and name (arguments ""), the
next ones argument fragments, all with the call's index.

An output cut off by max_tokens (finish_reason "length") inside a tool call ends with that call,
its arguments as far as they were written (not valid JSON then, as with OpenAI), rather than with
its text as content: what streaming already sent of the call stands, and the non-streamed message
is the same. A call cut off before its name is complete is content (under `auto`) or nothing
(under `required`, whose output is never content)."""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field

from radixserve.interfaces.reasoning_parser import ReasoningParser
from radixserve.interfaces.tool_parser import ParsedToolCall, ToolParse, ToolParser
from radixserve.server.tool_parsers.json_scan import json_prefix_length

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
        self._final_calls: int | None = None  # calls of the final parse, once the stream's last delta is made
        self._refused_logged = False
        self._unstable_logged = False

    @property
    def has_calls(self) -> bool:
        """Whether the choice ends with calls (its finish reason "tool_calls"): the final parse's calls,
        as the non-streamed answer has them; a call streamed and then dropped as malformed does not
        count (tools audit 30: the stream said "tool_calls" where the same answer unstreamed said "stop")."""
        return bool(self._final_calls) if self._final_calls is not None else bool(self._sent_calls)

    @property
    def _constrained(self) -> bool:
        """The grammar shapes the whole output as calls (tool_choice required or named)."""
        return bool(getattr(self.tools, "constrained", False))

    def _parts(self, text: str, final: bool, truncated: bool = False) -> tuple[str, str, tuple[ParsedToolCall, ...]]:
        try:
            reasoning, rest = self.reasoning.split(text, final) if self.reasoning else ("", text)
        except Exception as e:  # parsers audit 32: a 500 that named no plugin
            raise RuntimeError(f"the reasoning parser {_label(self.reasoning)} failed: {type(e).__name__}: {e}") from e
        if self.tools is None:
            return reasoning.strip(), rest.strip(), ()
        try:
            parsed = self.tools.parse(rest, final)
            if final and truncated:
                parsed = self._cut_off(rest, parsed)
            calls = parsed.calls if self.max_calls is None else parsed.calls[: self.max_calls]
            content = parsed.content
        except Exception as e:
            raise RuntimeError(f"the tool parser {_label(self.tools)} failed: {type(e).__name__}: {e}") from e
        calls = self._offered(calls, complete=final and not truncated)
        # whitespace around the parts is held back while streaming: a prefix-stable trim
        return reasoning.strip(), content.strip(), calls

    def _offered(self, calls: tuple[ParsedToolCall, ...], complete: bool) -> tuple[ParsedToolCall, ...]:
        """The calls a client may be given: to a function the request offers and, once the output is
        complete, with a JSON object as arguments (the ToolParser contract; parsers audit 32: a parser
        that broke it sent non-JSON arguments and functions nobody offered). Others are dropped, logged
        once naming the parser."""
        offered = getattr(self.tools, "tool_names", None)
        kept = tuple(c for c in calls if (not offered or c.name in offered) and (not complete or _is_object(c.arguments)))
        if len(kept) < len(calls) and not self._refused_logged:
            self._refused_logged = True
            bad = next(c for c in calls if c not in kept)
            logger.warning("the tool parser %s returned a call the contract forbids (function %r, arguments %r: a "
                           "function the request offers and a JSON object are required); the call is dropped",
                           _label(self.tools), bad.name, bad.arguments[:80])
        return kept

    def _cut_off(self, rest: str, whole: ToolParse) -> ToolParse:
        """The parse of an output cut off by max_tokens: the last snapshot of a stream (the call
        being written, with its arguments so far) when the output ends inside a call, else the
        complete output's parse."""
        growing = self.tools.parse(rest, False)
        if self._constrained:
            return growing
        done = len(whole.calls)
        if len(growing.calls) > done and growing.calls[:done] == whole.calls:
            return growing
        return whole

    def finish(self, text: str, truncated: bool = False) -> ChoiceParts:
        """The parts of a complete (non-streamed) output; `truncated`: it ended by max_tokens."""
        reasoning, content, calls = self._parts(text, True, truncated)
        self._sent_calls = [CallOut(new_call_id(), c.name, c.arguments) for c in calls]
        return ChoiceParts(
            content=content if content or not (calls or self._constrained) else None,
            reasoning=reasoning or None,
            calls=list(self._sent_calls),
        )

    def delta(self, text: str, final: bool, truncated: bool = False) -> ChoiceDelta:
        """What is new in `text` (the whole output so far) since the previous call; `truncated`
        (with `final`): the output ended by max_tokens."""
        reasoning, content, calls = self._parts(text, final, truncated)
        if final:
            self._final_calls = len(calls)
        out = ChoiceDelta(reasoning=self._grown(self._sent_reasoning, reasoning, "reasoning"),
                          content=self._grown(self._sent_content, content, "content"))
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
        # only what can still be the start of a JSON value: arguments that stop being one (`{"tz": C`) are a
        # call the final parse will drop, and a client parsing them as they come must not see that part
        fragment = call.arguments[len(sent.arguments) : json_prefix_length(call.arguments)]
        if fragment:
            sent.arguments += fragment
            out.calls.append(CallDelta(index, None, None, fragment))

    def _grown(self, sent: str, now: str, what: str) -> str:
        """The new tail of `now` after `sent`; nothing when a parser broke prefix stability (what was
        streamed cannot be taken back), logged once a choice naming the parsers."""
        if now.startswith(sent):
            return now[len(sent) :]
        if not sent.startswith(now) and not self._unstable_logged:
            self._unstable_logged = True
            logger.warning("a parser's %s is not prefix-stable (reasoning parser %s, tool parser %s); this stream keeps "
                           "what it sent and drops the changes", what, _label(self.reasoning), _label(self.tools))
        return ""


def _label(parser: object) -> str:
    """How log lines and errors name a parser: its class and module (a plugin's module names its package)."""
    return "none" if parser is None else f"{type(parser).__qualname__} ({type(parser).__module__})"


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False
