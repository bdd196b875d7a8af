"""How a chat request with tools or reasoning is prepared: the conversation rendered through the
model's chat template (tools, tool results and earlier tool calls included), the constraint that
`tool_choice="required"` or a named function puts on the output, and the parsers of each choice.

tool_choice:
- `none` (the default without tools): the tools are not shown to the model, nothing is parsed.
- `auto` (the default with tools): the tools go to the template; the model's own format is parsed
  by the server's tool-call parser.
- `required`: the output is constrained (grammar backend) to a JSON array of
  `{"name", "arguments"}` objects for the given tools, parsed directly into calls.
- a named function: the output is constrained to that function's arguments object.

A template that ignores `tools` (renders the same prompt with and without them) cannot offer
tools to the model: a 400, unless `server.generic_tool_prompt` is on, in which case the tools are
described in a system message in the Hermes format and parsed with the `hermes` parser.

Earlier calls in the history (an assistant message's `tool_calls`) go to the template as well; one that
does not render them gets them as Hermes blocks under `server.generic_tool_prompt`, otherwise the
request is a 400, so that the model never answers a conversation with its calls cut out. A `developer`
message is rendered as `system` unless the template has a rendering of its own for the role.
What the template renders is learned once (`template_traits.py`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.chat_output import ChoiceOutput
from radixserve.server.constraint_errors import about_json_schema, response_format_refusal, tool_choice_refusal
from radixserve.server.errors import APIError
from radixserve.server.parser_selection import OutputParsers
from radixserve.server.template_traits import render
from radixserve.server.tool_parsers.constrained import NamedCallParser, RequiredCallsParser
from radixserve.server.tool_parsers.hermes import HermesToolParser
from radixserve.server.tool_schema import named_call_schema, required_calls_schema

_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "tokenize", "documents", "conversation"}

@dataclass
class ChatPlan:
    ids: list[int]
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    make_output: Callable[[], ChoiceOutput] | None = None  # None: the text is the content, as is
    tool_choice: str = "none"  # none | auto | required | named
    response_format: bool = False  # response_format constrains the output
    tools: list[dict[str, Any]] = field(default_factory=list)  # the request's tools, as dicts
    named_tool: int | None = None  # the index of the function a named tool_choice picks

    def explain_refusal(self, param: str | None, message: str) -> APIError | None:
        """A validation error caused by this plan's constraint, in terms the client sent."""
        if not about_json_schema(param, message):
            return None
        if "json_schema" in self.sampling_overrides:
            return tool_choice_refusal(message, self.tool_choice, self.tools, self.named_tool)
        if self.response_format:  # the runtime names it (sampling_params.)json_schema
            return response_format_refusal(param, message)
        return None


def _tool_choice(req: Any) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function)."""
    choice = req.tool_choice
    if choice is None:
        return ("auto" if req.tools else "none"), None
    if isinstance(choice, str):
        if choice in ("required",) and not req.tools:
            raise APIError("tool_choice='required' needs `tools`", 400, "tool_choice")
        return choice, None
    name = choice.function.name
    names = [t.function.name for t in req.tools or []]
    if name not in names:
        raise APIError(
            f"tool_choice names the function {name!r}, which is not in `tools` ({', '.join(names) or 'none given'})",
            400,
            "tool_choice",
        )
    return "named", name


def template_messages(req: Any) -> list[dict[str, Any]]:
    """The conversation as chat templates expect it (transformers' conventions): assistant tool
    calls with their arguments as objects, tool results with `tool_call_id` and the function's
    `name` (found from the call they answer)."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = []
            for j, call in enumerate(m.tool_calls):
                names[call.id] = call.function.name
                msg["tool_calls"].append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": _arguments(call.function.arguments, f"messages.{i}.tool_calls.{j}"),
                        },
                    }
                )
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
            if m.tool_call_id in names and "name" not in msg:
                msg["name"] = names[m.tool_call_id]
        out.append(msg)
    return out


def _with_content_parts(messages: list[dict[str, Any]], given: list[Any]) -> list[dict[str, Any]]:
    """The messages whose content came as a list of text parts with that list again, for a template that
    loops over content itself (transformers gets the list from its caller: joining it changed the prompt)."""
    return [{**m, "content": [{"type": "text", "text": p.text} for p in g.content]} if isinstance(g.content, list)
            else m for m, g in zip(messages, given, strict=True)]


def _arguments(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise APIError(f"{where}.function.arguments is not valid JSON: {e}", 400, f"{where}.function.arguments") from None
    if not isinstance(value, dict):
        raise APIError(f"{where}.function.arguments must be a JSON object", 400, f"{where}.function.arguments")
    return value


GENERIC_TOOL_PROMPT = (
    "You can call functions to help with the user's request. The functions are described by these "
    "JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call functions, reply with one block per call, each holding a JSON object with the function's "
    "name and its arguments:\n<tool_call>\n"
    '{{"name": "<function name>", "arguments": {{"<argument>": "<value>"}}}}\n</tool_call>\n'
    "Results come back inside <tool_response></tool_response>. If no function fits, answer directly."
)


def generic_tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that cannot render tools: the tools described in the system
    message, and the history as `generic_tool_history` writes it."""
    prompt = GENERIC_TOOL_PROMPT.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
    out = generic_tool_history(messages)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def generic_tool_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier calls written into their assistant message as `<tool_call>` blocks, tool results as
    user turns in `<tool_response>`: the Hermes format, for a template that renders neither."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            continue
        msg = {"role": m["role"], "content": m["content"]}
        for call in m.get("tool_calls") or []:
            block = json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
            msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + f"<tool_call>\n{block}\n</tool_call>"
        out.append(msg)
    return out


def _as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`developer` messages as `system` ones, for a template with no rendering of its own for the role
    (OpenAI's developer messages are what system messages were)."""
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]


def _history_for_template(tm: Any, messages: list[dict[str, Any]], parsers: OutputParsers,
                          with_tools: bool) -> list[dict[str, Any]]:
    """Earlier tool calls as the template can show them: itself, as Hermes blocks under
    `server.generic_tool_prompt`, or a 400, never dropped without a word. `with_tools`: the request's
    tools reach the template (which may then render with another of its named templates)."""
    with_calls = next((i for i, m in enumerate(messages) if m.get("tool_calls")), None)
    if with_calls is None or parsers.template.tool_calls(tm, with_tools):
        return messages
    if parsers.generic_tool_prompt:
        return generic_tool_history(messages)
    raise APIError(
        f"messages.{with_calls}.tool_calls: the chat template of {tm.model_name} does not render tool calls, so the "
        "model would not see them; start the server with server.generic_tool_prompt=true to write them as "
        "<tool_call> blocks, or serve a model whose template supports tools",
        400,
        f"messages.{with_calls}.tool_calls",
    )


def plan_chat(tm: Any, req: Any, parsers: OutputParsers) -> ChatPlan:
    """Render the request's conversation and decide how its output is constrained and parsed.
    Raises APIError (400) naming the field for what cannot be served."""
    choice, named = _tool_choice(req)
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise APIError(f"chat_template_kwargs must not set {reserved[0]!r}", 400, "chat_template_kwargs")
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    messages = template_messages(req)
    if not parsers.template.developer_role(tm):
        messages = _as_system(messages)
    generic = False
    if tools and choice != "none":
        if parsers.template.tools(tm):
            kwargs["tools"] = tools
        elif parsers.generic_tool_prompt:
            generic = True
            parsers.note_generic_tool_prompt()
            messages = generic_tool_messages(messages, tools)
        else:
            raise APIError(
                f"the chat template of {tm.model_name} does not render tools (it ignores `tools`), so the model "
                "cannot be offered them; start the server with server.generic_tool_prompt=true to describe the "
                "tools in a system message instead, or serve a model whose template supports tools",
                400,
                "tools",
            )
    if not generic:
        messages = _history_for_template(tm, messages, parsers, "tools" in kwargs)
        if parsers.template.content_parts(tm):
            messages = _with_content_parts(messages, req.messages)
    ids = _render_checked(tm, messages, req.add_generation_prompt, kwargs)

    fmt = getattr(req, "response_format", None)  # structured output constrains the same output
    names = [t["function"]["name"] for t in tools]
    plan = ChatPlan(ids=ids, tool_choice=choice, response_format=fmt is not None and fmt.schema_text() is not None,
                    tools=tools, named_tool=names.index(named) if choice == "named" else None)
    tool_parser: Callable[[], Any] | None = None
    max_calls = None if req.parallel_tool_calls is not False else 1
    if choice == "auto" and tools:
        cls = HermesToolParser if generic else parsers.tool_parser
        if cls is None:
            installed = ", ".join(parsers.installed_tool_parsers) or "none"
            raise APIError(
                f"no tool-call parser is set for {tm.model_name} and none recognises its chat template; start the "
                f"server with --tool-call-parser NAME (installed: {installed})",
                400,
                "tools",
            )
        if cls.needs_special_tokens:
            plan.sampling_overrides["skip_special_tokens"] = False

        def tool_parser() -> Any:
            return cls(names)
    elif choice == "required":
        try:
            plan.sampling_overrides["json_schema"] = required_calls_schema(tools, req.parallel_tool_calls is not False)
        except ValueError as e:
            raise APIError(f"tools: {e}", 400, "tools") from None

        def tool_parser() -> Any:
            return RequiredCallsParser(names)
    elif choice == "named":
        tool = next(t for t in tools if t["function"]["name"] == named)
        plan.sampling_overrides["json_schema"] = named_call_schema(tool)

        def tool_parser() -> Any:
            return NamedCallParser([named])

    if "json_schema" in plan.sampling_overrides and fmt is not None and getattr(fmt, "type", "text") != "text":
        raise APIError("response_format cannot be combined with tool_choice required or a named function: both "
                       "constrain the output", 400, "response_format")
    reasoning_cls = parsers.reasoning_parser if req.separate_reasoning else None
    # where the output starts: inside the reasoning if the prompt opened it; never when a grammar
    # constrains it from the first token; otherwise as the parser's family does by default
    start: dict[str, bool] = {}
    if "json_schema" in plan.sampling_overrides:
        start["starts_in_reasoning"] = False
    elif reasoning_cls is not None and _prompt_opens(tm, ids, reasoning_cls.start_tag):
        start["starts_in_reasoning"] = True
    end_tag = getattr(reasoning_cls, "end_tag", "")  # getattr: parsers written before the base declared it
    if (end_tag and fmt is not None and fmt.schema_text() is not None and "json_schema" not in plan.sampling_overrides
            and not _prompt_opens(tm, ids, end_tag)):
        # response_format constrains the answer, not the reasoning: the grammar starts after the end
        # tag (unless the prompt already closed the section, e.g. Qwen3 with enable_thinking=false)
        plan.sampling_overrides["grammar_after"] = end_tag
    if tool_parser is not None or reasoning_cls is not None:

        def make_output() -> ChoiceOutput:
            return ChoiceOutput(
                reasoning_cls(**start) if reasoning_cls is not None else None,
                tool_parser() if tool_parser is not None else None,
                max_calls,
            )

        plan.make_output = make_output
    return plan


def _render_checked(tm: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any]) -> list[int]:
    try:
        return render(tm, messages, add_generation_prompt, kwargs)
    except Exception as e:  # a template that rejects the conversation (e.g. role order)
        if "tools" in kwargs:
            try:
                render(tm, messages, add_generation_prompt, {k: v for k, v in kwargs.items() if k != "tools"})
            except Exception:
                pass
            else:
                raise APIError(f"the chat template cannot render these tools: {e}", 400, "tools") from None
        raise APIError(f"cannot apply the chat template: {e}", 400, "messages") from None


def _prompt_opens(tm: Any, ids: list[int], tag: str) -> bool:
    """Whether the rendered prompt ends inside an opened reasoning section (`...<think>\\n`)."""
    if not tag:
        return False
    try:
        tail = tm.tokenizer.decode(ids[-(8 + len(tag)) :])  # the tag, and whitespace after it
    except Exception:
        return False
    return tail.rstrip().endswith(tag)
