"""Reasoning separation for `<think>...</think>` models (components of kind `reasoning_parser`).

Two built-in flavours differ only in where the output starts:
- `qwen3`: outside the reasoning section unless the output opens it with `<think>` (Qwen3,
  QwQ; with `enable_thinking=false` the template closes the section itself and the output is all
  content);
- `deepseek_r1`: inside it, because the generation prompt of DeepSeek-R1 opens it (a leading
  `<think>` the model writes anyway is dropped).
Either starts inside when the rendered prompt ends with `<think>` (the server checks per request),
and neither when the output is constrained from its first token (tool_choice required / named)."""

from __future__ import annotations

from radixserve.interfaces.reasoning_parser import ReasoningParser
from radixserve.server.tool_parsers.common import partial_marker_len


class ThinkTagReasoningParser(ReasoningParser):
    """`<think>reasoning</think>content`; see the module docstring for where the output starts."""

    start_tag, end_tag = "<think>", "</think>"
    template_markers = ("<think>", "</think>")

    def split(self, text: str, final: bool) -> tuple[str, str]:
        head = text.lstrip()
        if head.startswith(self.start_tag):
            text = head[len(self.start_tag) :]
        elif not final and self.start_tag.startswith(head):  # "" or "<thi": may still open it
            return "", ""
        elif not self.starts_in_reasoning:
            return "", text
        end = text.find(self.end_tag)
        if end < 0:
            return (text if final else text[: len(text) - partial_marker_len(text, self.end_tag)]), ""
        return text[:end], text[end + len(self.end_tag) :]


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    pass


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    template_markers = ("<｜Assistant｜>", "</think>")

    @classmethod
    def matches_template(cls, template: str) -> bool:
        return all(m in template for m in cls.template_markers)

    def __init__(self, starts_in_reasoning: bool = True) -> None:
        super().__init__(starts_in_reasoning=starts_in_reasoning)
