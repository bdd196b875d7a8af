"""ReasoningParser: separates a model's reasoning section from its answer."""

from __future__ import annotations

import abc
from typing import ClassVar


class ReasoningParser(abc.ABC):
    """Splits raw output into (reasoning, rest), e.g. `<think>...</think>answer` of Qwen3 and
    DeepSeek-R1. The server builds one instance per choice and calls `split` on the text generated
    so far (like `ToolParser.parse`: at the end, and after every step when streaming). The rest is
    what tool-call parsing and the response's `content` see; the reasoning becomes the message's
    `reasoning_content`.

    Contract:
    - `split(text, final)` is a pure function of its arguments and the constructor's; it never
      raises.
    - Prefix stability while streaming (`final=False`): for outputs `a` then `a + more`, both parts
      of the first split are prefixes of the second's. Hold back a tail that could be the start of
      a tag (`</thi`).
    - `final=True`: everything is resolved; an unterminated reasoning section is all reasoning.
    - Tags are not part of either piece.

    :param starts_in_reasoning: the output begins inside the reasoning section. The server passes
        True when the rendered prompt ends with `start_tag` (DeepSeek-R1's and some Qwen3
        templates open the section themselves), False when a grammar constrains the output from its
        first token (tool_choice required / named), and nothing otherwise: a subclass's default
        then says how its family starts.

    Added in plugin API 1.2.
    """

    supports_tensor_parallel: bool = True
    """Class flag: this component works when `runtime.tp_size > 1`. True by default: parsers run in
    the HTTP process, which tensor parallelism does not change. Set False to make the stack
    resolution refuse it with tp_size > 1. Added in plugin API 1.3."""

    #: substrings of a chat template that identify this format (used by `matches_template`)
    template_markers: ClassVar[tuple[str, ...]] = ()
    #: the opening tag; the server checks whether the rendered prompt ends with it
    start_tag: ClassVar[str] = ""
    #: the closing tag. With a `response_format` the grammar starts after it (the reasoning stays
    #: free text); empty: the grammar constrains the output from its first token, so no reasoning
    #: section can be produced. The server has read it by name since structured output and
    #: reasoning combined; declared here in plugin API 1.12 (default unchanged) so that authors see it.
    end_tag: ClassVar[str] = ""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning

    @classmethod
    def matches_template(cls, template: str) -> bool:
        """Whether a chat template (its Jinja text) uses this format. Default: any marker is in it.

        Added in plugin API 1.2."""
        return any(m in template for m in cls.template_markers)

    @abc.abstractmethod
    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, rest) of `text`, the output so far.

        Added in plugin API 1.2."""
