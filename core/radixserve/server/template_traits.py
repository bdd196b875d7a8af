"""What a model's chat template does with the parts of an OpenAI conversation that not every template
knows: `tools`, an assistant message's `tool_calls`, and the `developer` role. Each is learned once,
by rendering a small probe conversation with and without the part (the template is fixed for the
server's life), so that the server never sends the model a prompt with a part silently missing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "radixserve_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"probe_argument": {"type": "string"}}},
    },
}
# nine alphanumerics: Mistral's templates refuse any other call id
_PROBE_CALL = {"id": "probecall", "type": "function",
               "function": {"name": "radixserve_probe_tool", "arguments": {"probe_argument": "x"}}}
_PROBE_ROLE = "radixserveproberole"  # a role no template has a rendering of its own for


def render(tm: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any]) -> list[int]:
    """The conversation's prompt ids through the model's chat template (`kwargs`: tools, template options)."""
    if kwargs:
        return list(tm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs))
    return list(tm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))


@dataclass
class TemplateTraits:
    """The chat template's answers, each None until a request first needs it. Owned by the server's
    `OutputParsers` (one per server: one template)."""

    renders_tools: bool | None = None  # shows `tools` to the model
    # shows an assistant message's `tool_calls`, by whether the request gives `tools` (a checkpoint's named
    # templates: `tool_use` renders calls, `default` may not)
    renders_tool_calls: dict[bool, bool] = field(default_factory=dict)
    has_developer_role: bool | None = None  # renders `developer` its own way (gpt-oss), not as any unknown role
    reads_parts: bool | None = None  # loops over a message's content: takes a list of parts (Gemma 3)

    def content_parts(self, tm: Any) -> bool:
        """Whether the template reads a message's content as OpenAI's list of parts (it loops over it), so
        a request's list is passed as it is rather than joined into one string."""
        if self.reads_parts is None:
            from radixserve.serving_tokenizer import template_reads_content_parts, template_texts

            texts = template_texts(getattr(tm.tokenizer, "chat_template", None))
            self.reads_parts = any(template_reads_content_parts(t) for t in texts)
        return self.reads_parts

    def tools(self, tm: Any) -> bool:
        if self.renders_tools is None:
            probe = [{"role": "user", "content": "hello"}]
            self.renders_tools = _differs(lambda: render(tm, probe, True, {}),
                                          lambda: render(tm, probe, True, {"tools": [_PROBE_TOOL]}))
        return self.renders_tools

    def tool_calls(self, tm: Any, with_tools: bool = False) -> bool:
        """Whether the template shows earlier calls, in a request that gives `tools` or one that does not."""
        if with_tools not in self.renders_tool_calls:
            options = {"tools": [_PROBE_TOOL]} if with_tools else {}

            def conversation(calls: bool, result: bool) -> list[dict[str, Any]]:
                assistant: dict[str, Any] = {"role": "assistant", "content": ""}
                if calls:
                    assistant["tool_calls"] = [_PROBE_CALL]
                answer = [{"role": "tool", "tool_call_id": "probecall", "content": "done"}] if result else []
                return [{"role": "user", "content": "hello"}, assistant, *answer]

            # with the call's result after it (templates that check the order) and without (templates
            # that know no `tool` role)
            self.renders_tool_calls[with_tools] = any(
                _differs(lambda r=result: render(tm, conversation(False, r), True, options),
                         lambda r=result: render(tm, conversation(True, r), True, options))
                for result in (True, False))
        return self.renders_tool_calls[with_tools]

    def developer_role(self, tm: Any) -> bool:
        if self.has_developer_role is None:
            def text(role: str) -> str:
                ids = render(tm, [{"role": role, "content": "probe"}, {"role": "user", "content": "hello"}], True, {})
                return str(tm.tokenizer.decode(ids))

            try:
                developer = text("developer")
            except Exception:  # a template that refuses the role has no rendering of its own for it
                self.has_developer_role = False
                return False
            try:
                unknown = text(_PROBE_ROLE).replace(_PROBE_ROLE, "developer")
            except Exception:  # refuses unknown roles, accepts developer: it knows the role
                self.has_developer_role = True
                return True
            self.has_developer_role = developer != unknown
        return self.has_developer_role


def _differs(without: Callable[[], list[int]], with_part: Callable[[], list[int]]) -> bool:
    """Whether adding the part changes the prompt (a template that raises on it does not render it)."""
    try:
        return without() != with_part()
    except Exception:
        return False
