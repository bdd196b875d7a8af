"""Which tool-call and reasoning parsers the server uses, chosen once at start-up.

`server.tool_call_parser` / `--tool-call-parser` and `server.reasoning_parser` /
`--reasoning-parser` name a registered component (kinds `tool_parser`, `reasoning_parser`), or
`none` to switch the feature off; unset, the first registered parser (by priority) whose
`matches_template` accepts the model's chat template is used, if any. An unknown name is a
start-up error listing the installed parsers."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from radixserve.interfaces.reasoning_parser import ReasoningParser
from radixserve.interfaces.tool_parser import ToolParser
from radixserve.plugins.registry import PluginError
from radixserve.server.template_traits import TemplateTraits
from radixserve.serving_tokenizer import template_texts

logger = logging.getLogger("radixserve.server")

OFF = "none"


@dataclass
class OutputParsers:
    tool_parser: type[ToolParser] | None = None
    tool_parser_name: str | None = None
    reasoning_parser: type[ReasoningParser] | None = None
    reasoning_parser_name: str | None = None
    generic_tool_prompt: bool = False  # describe tools in a system message when the template cannot
    installed_tool_parsers: tuple[str, ...] = ()
    template: TemplateTraits = field(default_factory=TemplateTraits)  # what the chat template renders
    _generic_prompt_noted: bool = field(default=False, init=False, repr=False)  # warned once (below)

    def note_generic_tool_prompt(self) -> None:
        """A request's tools go into the generic (Hermes-format) prompt, so hermes parses its output:
        say once, as a warning, when that stands in for another tool parser the server names."""
        if self._generic_prompt_noted:
            return
        self._generic_prompt_noted = True
        if self.tool_parser_name not in (None, "hermes"):
            logger.warning(
                "the chat template does not render tools: server.generic_tool_prompt describes them in the "
                "Hermes format and parses the output with hermes, not with tool parser %r (it applies to "
                "templates that render tools; serve a tokenizer whose chat template does to use it)",
                self.tool_parser_name)


def _pick(registry: Any, kind: str, wanted: str | None, template: str | None, key: str) -> tuple[Any, str | None]:
    if wanted == OFF:
        return None, None
    if wanted is not None:
        try:
            return registry.load(kind, wanted), wanted
        except PluginError as e:
            raise PluginError(f"{key}={wanted!r}: {e}") from None
    if not template:
        return None, None
    # highest priority first, so a specific format wins over a generic one
    for spec in registry.components(kind):
        try:
            cls = registry.load(kind, spec.name)
            if cls.matches_template(template):
                return cls, spec.name
        except Exception as e:  # a broken plugin parser must not stop detection of the others
            logger.warning("%s %r (%s) skipped in template detection: %s", kind, spec.name, spec.distribution, e)
    return None, None


def check_parser_names(config: Any, registry: Any) -> None:
    """Fail fast (before the model loads) on a parser name that is not installed."""
    for kind, key in (("tool_parser", "tool_call_parser"), ("reasoning_parser", "reasoning_parser")):
        _pick(registry, kind, getattr(config.server, key), None, f"server.{key}")


def select_output_parsers(config: Any, registry: Any, chat_template: str | dict | None) -> OutputParsers:
    """The parsers for a model whose chat template text is `chat_template` (None: it has none; a dict:
    named templates, e.g. `default` and `tool_use`, whose texts are all read: the tool_use one renders
    the calls the parser must recognise)."""
    server = config.server
    template = "\n".join(template_texts(chat_template)) or None
    tool_cls, tool_name = _pick(registry, "tool_parser", server.tool_call_parser, template, "server.tool_call_parser")
    reasoning_cls, reasoning_name = _pick(
        registry, "reasoning_parser", server.reasoning_parser, template, "server.reasoning_parser"
    )
    if tool_name or reasoning_name:
        logger.info("output parsers: tool calls %s, reasoning %s", tool_name or "off", reasoning_name or "off")
    return OutputParsers(
        tool_parser=tool_cls,
        tool_parser_name=tool_name,
        reasoning_parser=reasoning_cls,
        reasoning_parser_name=reasoning_name,
        generic_tool_prompt=server.generic_tool_prompt,
        installed_tool_parsers=tuple(registry.names("tool_parser")),
    )
