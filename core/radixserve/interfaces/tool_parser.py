"""ToolParser: turns a model's raw chat output into plain content and OpenAI tool calls."""

from __future__ import annotations

import abc
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class ParsedToolCall:
    """One function call found in the output.

    `arguments` is JSON text (an object once the call is complete). While the output is still
    growing it may be a prefix of the final text, e.g. `{"city": "Par`."""

    name: str
    arguments: str = ""


@dataclass(frozen=True)
class ToolParse:
    """A snapshot of what an output holds: the text meant for the user (`content`, the tool-call
    markup removed) and the calls, in the order the model wrote them."""

    content: str = ""
    calls: tuple[ParsedToolCall, ...] = field(default_factory=tuple)


class ToolParser(abc.ABC):
    """Parses one model family's tool-call format (Hermes `<tool_call>` JSON, Mistral
    `[TOOL_CALLS]`, ...). The server builds one instance per choice of a request that offers
    tools with `tool_choice="auto"`, and calls `parse` on the text generated so far: once at the
    end for a non-streamed response, after every streamed step and once more at the end when
    streaming. Streaming and non-streaming therefore give the same result by construction.

    Contract:
    - `parse(text, final)` is a pure function of its arguments (the instance holds only the
      constructor's arguments); it never raises on model output: text it cannot read as calls is
      content.
    - Prefix stability while streaming (`final=False`): for outputs `a` then `a + more`, the
      content of the first snapshot is a prefix of the second's; each call of the first is in the
      second at the same position with the same `name`, and its `arguments` a prefix of the
      second's, unless the call turned out malformed: then it is dropped (its text becomes
      content when it ends, at the latest with `final=True`). So the parser holds back what is
      still ambiguous: a tail of the text that could be the start of a marker (`<tool_c`), and a
      call until its name is complete. The server cannot take back what it streamed: a dropped
      call stays with the client (with the arguments it had), and later calls get new indices.
    - Never leak markup into content: the markers and the calls' JSON are not content. A call that
      does not parse (malformed JSON, a name that is not one of `tool_names`, arguments that are not
      an object) is content, markup included, so nothing the model wrote is lost.
    - `arguments` of a complete call is a JSON object's text (`{}` when the model gave none).

    Selection: `stack`-independent; the server takes the parser named by `server.tool_call_parser`
    (`--tool-call-parser`), or the first registered parser, by priority, whose `matches_template`
    accepts the model's chat template text.

    Check a parser with `radixserve.testing.check_tool_parser(MyParser, samples, tool_names)`.

    Added in plugin API 1.2.
    """

    supports_tensor_parallel: bool = True
    """Class flag: this component works when `runtime.tp_size > 1`. True by default: parsers run in
    the HTTP process, which tensor parallelism does not change. Set False to make the stack
    resolution refuse it with tp_size > 1. Added in plugin API 1.3."""

    #: substrings of a chat template that identify this format (used by `matches_template`)
    template_markers: ClassVar[tuple[str, ...]] = ()
    #: the format's markers are special tokens (Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`):
    #: requests parsed by this parser are decoded with skip_special_tokens=False so they stay in
    #: the text
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tool_names: Collection[str]) -> None:
        """:param tool_names: the functions the request offers; a call to any other name is content."""
        self.tool_names = frozenset(tool_names)

    @classmethod
    def matches_template(cls, template: str) -> bool:
        """Whether a chat template (its Jinja text) renders this format. Default: any marker is in it.

        Added in plugin API 1.2."""
        return any(m in template for m in cls.template_markers)

    @abc.abstractmethod
    def parse(self, text: str, final: bool) -> ToolParse:
        """The content and calls of `text`.

        :param text: the output so far (after any reasoning section was removed).
        :param final: True when the output is complete: resolve everything held back (a tail that
            turned out not to be a marker is content; an unfinished call is content).
        :return: a `ToolParse` obeying the prefix-stability rule above.

        Added in plugin API 1.2.
        """
