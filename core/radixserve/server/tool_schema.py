"""JSON schemas of tools: a structural check of a function's `parameters` (a 400 names the bad
keyword before any generation), and the schema that constrains the output under
`tool_choice="required"` or a named function."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from radixserve.interfaces.grammar import resolve_json_pointer

_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames", "additionalItems",
              "if", "then", "else", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


# objects and arrays inside one function's parameters, nested: far past any real tool's (a schema level is
# two: `{"properties": {"a": ...}}`), and short of the recursion the constraint's compilation needs
MAX_SCHEMA_NESTING = 128


def check_parameters_schema(schema: Any) -> None:
    """A function's parameters: a JSON schema of an object. Raises ValueError naming the bad
    keyword's path (e.g. `properties.unit.enum must be a non-empty list`)."""
    if not isinstance(schema, dict):
        raise ValueError("must be a JSON schema object")
    if _nesting(schema) > MAX_SCHEMA_NESTING:  # fuzz audit 31: 300 levels were a RecursionError (a 500)
        raise ValueError(f"is nested too deeply (more than {MAX_SCHEMA_NESTING} levels of objects and arrays)")
    kind = schema.get("type")
    if kind is not None and kind != "object":
        raise ValueError(f"must describe an object (type 'object'), got type {kind!r}")
    _check(schema, "", schema)


def _nesting(value: Any) -> int:
    """How deep objects and arrays nest in `value` (without recursion: the value may be deeper than the
    interpreter's stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if deepest > MAX_SCHEMA_NESTING:
                break
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _check(s: Any, path: str, root: dict[str, Any]) -> None:
    at = path or "the schema"
    if isinstance(s, bool):
        return
    if not isinstance(s, dict):
        raise ValueError(f"{at} must be a JSON schema (an object), got {type(s).__name__}")
    kind = s.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        bad = [k for k in kinds if not isinstance(k, str) or k not in _TYPES]
        if bad or not kinds:
            raise ValueError(f"{_join(path, 'type')} must be one of {sorted(_TYPES)} (or a list of them), got {kind!r}")
    for key in _SCHEMA_MAPS:
        if key in s:
            if not isinstance(s[key], dict):
                raise ValueError(f"{_join(path, key)} must be an object mapping names to schemas")
            for name, sub in s[key].items():
                _check(sub, _join(path, f"{key}.{name}"), root)
    for key in _SUBSCHEMA:
        if key in s:
            if key == "items" and isinstance(s[key], list):
                for i, sub in enumerate(s[key]):
                    _check(sub, _join(path, f"items.{i}"), root)
            else:
                _check(s[key], _join(path, key), root)
    for key in _SCHEMA_LISTS:
        if key in s:
            if not isinstance(s[key], list) or not s[key]:
                raise ValueError(f"{_join(path, key)} must be a non-empty list of schemas")
            for i, sub in enumerate(s[key]):
                _check(sub, _join(path, f"{key}.{i}"), root)
    if "required" in s and not (isinstance(s["required"], list) and all(isinstance(x, str) for x in s["required"])):
        raise ValueError(f"{_join(path, 'required')} must be a list of property names")
    if "enum" in s and not (isinstance(s["enum"], list) and s["enum"]):
        raise ValueError(f"{_join(path, 'enum')} must be a non-empty list")
    for key in _COUNTS:
        if key in s and not (isinstance(s[key], int) and not isinstance(s[key], bool) and s[key] >= 0):
            raise ValueError(f"{_join(path, key)} must be an integer >= 0, got {s[key]!r}")
    for key in _NUMBERS:
        if key in s and (isinstance(s[key], bool) or not isinstance(s[key], int | float)):
            raise ValueError(f"{_join(path, key)} must be a number, got {s[key]!r}")
    if "pattern" in s:
        try:
            re.compile(s["pattern"])
        except (re.error, TypeError) as e:
            raise ValueError(f"{_join(path, 'pattern')} is not a valid regular expression: {e}") from None
    if "$ref" in s:
        ref = s["$ref"]
        if not isinstance(ref, str):
            raise ValueError(f"{_join(path, '$ref')} must be a string")
        if not _resolves(root, ref):  # a dangling reference was accepted under tool_choice=auto (tools audit 30)
            raise ValueError(f"{_join(path, '$ref')} {ref!r} points to nothing in this schema (only local references, "
                             "'#/$defs/NAME', are resolved)")


def _resolves(root: dict[str, Any], ref: str) -> bool:
    """Whether `ref` is a local JSON pointer ("#", "#/a/b") to something inside `root`."""
    try:
        resolve_json_pointer(root, ref)
    except LookupError:
        return False
    return True


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


EMPTY_OBJECT = {"type": "object", "properties": {}}


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (an empty object when it takes none)."""
    return copy.deepcopy(tool["function"].get("parameters") or EMPTY_OBJECT)


def required_calls_schema(tools: list[dict[str, Any]], parallel: bool) -> str:
    """The constraint for tool_choice="required": a JSON array (one item if not `parallel`) of
    `{"name": <one of the tools>, "arguments": <that tool's parameters>}`. Each tool's `$defs` /
    `definitions` move to the root so its local `#/$defs/...` references still resolve; a name
    two tools define differently is a ValueError naming it."""
    roots: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    variants = []
    for tool in tools:
        params = parameters_of(tool)
        for key in ("$defs", "definitions"):
            for name, sub in (params.pop(key, None) or {}).items():
                if roots[key].get(name, sub) != sub:
                    raise ValueError(f"{key}.{name} is defined differently by two tools; rename one")
                roots[key][name] = sub
        variants.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
    }
    if not parallel:
        schema["maxItems"] = 1
    schema.update({k: v for k, v in roots.items() if v})
    return json.dumps(schema)


def named_call_schema(tool: dict[str, Any]) -> str:
    """The constraint for a named function: the output is that function's arguments object."""
    return json.dumps(parameters_of(tool))


# a backend's location in a refused schema, "(at /items/properties/arguments/properties/u)"
_AT = re.compile(r"\(at (/[^\s;,)]*|the schema root)")
_ARGUMENTS = re.compile(r"/items(?:/anyOf/(\d+))?/properties/arguments(?=/|$)")
_DEFS = re.compile(r"/(\$defs|definitions)/([^/]+)")


def locate_in_tools(message: str, tools: list[dict[str, Any]], named: int | None) -> tuple[int | None, str]:
    """The index of the tool a backend's refusal of the tool_choice constraint is about (None: not
    known), and the message with its "(at /path)" locations moved into that tool's parameters. A named
    function's constraint is its parameters themselves; `required_calls_schema` wraps them."""
    found: set[int] = set()

    def move(m: re.Match) -> str:
        path = "" if m.group(1) == "the schema root" else m.group(1)
        index, inner = (named, path) if named is not None else _tool_path(path, tools)
        if index is None:
            return m.group(0)
        found.add(index)
        return f"(at {inner or 'the schema root'}"

    text = _AT.sub(move, message)
    if named is not None:
        return named, text
    if len(found) == 1:
        return found.pop(), text
    return (0 if len(tools) == 1 else None), text


def _tool_path(path: str, tools: list[dict[str, Any]]) -> tuple[int | None, str]:
    """(tool index, path inside its parameters) of a path into required_calls_schema's output."""
    m = _ARGUMENTS.match(path)
    if m and (m.group(1) is not None or len(tools) == 1):
        index = int(m.group(1) or 0)
        return (index, path[m.end():]) if index < len(tools) else (None, path)
    d = _DEFS.match(path)
    if d:  # moved to the root from the first tool that defines it (the same path in that tool)
        for i, tool in enumerate(tools):
            if d.group(2) in ((tool["function"].get("parameters") or {}).get(d.group(1)) or {}):
                return i, path
    return None, path
