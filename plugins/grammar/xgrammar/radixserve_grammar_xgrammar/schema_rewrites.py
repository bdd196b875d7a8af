"""Rewrite a JSON schema, before xgrammar 0.1.27 converts it, into an equivalent (or stricter)
one whose every assertion its converter enforces. Each rewrite fixes an invalid output SmolLM2
wrote for a real corpus schema (benchmarks/results/cpu-structured-output.md):

- `anyOf`/`oneOf` next to other assertions (`{"type": "string", "anyOf": [{"pattern": ...},
  {"format": ...}]}`, or an object's `properties`/`required` next to branches): xgrammar converts
  only the branches and drops the siblings, so `{}` passed for that string. The siblings are
  copied into every branch (A and (B1 or B2) == (A and B1) or (A and B2)).
- `additionalProperties` true or a schema on an object that declares `properties`: xgrammar lets
  the extra keys repeat a declared name with any value (`"status": 200` for a string enum). Our
  backend generates only declared properties (strict mode), so the extra keys are dropped:
  every output is still valid for the original schema.
- `oneOf` whose branches only list `required` properties next to the object's `properties`
  (`{"properties": {...}, "oneOf": [{"required": ["radius"]}, {"required": ["width", "height"]}]}`):
  xgrammar treats `oneOf` as `anyOf`, and SmolLM2 wrote every property, which matches several
  branches. Each merged branch drops the properties that only the other branches require, so it
  cannot match them (undeclared properties are never generated); branches whose required sets
  contain one another cannot be told apart that way and are refused.

- `allOf` with several branches: xgrammar 0.1.27 (and 0.1.34) converts none of them and the value is
  left free (corpus audit 32: `{"allOf": [{... "required": ["a"]}, {... "required": ["b"]}]}` gave
  objects with neither). The branches (a `{"$ref": "#/..."}` branch replaced by what it points to)
  and the node's own keywords are merged into one schema, as for union siblings; an object branch
  that closes its properties (`additionalProperties` false or a schema) while another branch
  declares others is refused, since the merged object would allow what that branch forbids.

- `discriminator` (OpenAPI's hint beside a `oneOf`, which pydantic writes for a discriminated union):
  no assertion of its own (the branches' `const` values tell them apart), dropped; it made the union
  look like one with sibling keywords, which is refused (frameworks audit 32).
- `exclusiveMinimum` / `exclusiveMaximum` on an `integer` (pydantic's `gt` / `lt`): the same set of
  integers as `minimum` n + 1 / `maximum` n - 1, which xgrammar enforces (it does not enforce the
  exclusive forms, refused elsewhere).

`prepare_schema` raises ValueError naming the place when a union cannot be merged that way."""

from __future__ import annotations

import copy
import math
from typing import Any

from radixserve.interfaces.grammar import resolve_json_pointer

# keywords that carry no assertion: they stay on the parent of a union
_ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "$schema", "$id", "id", "$defs",
                "definitions", "deprecated", "readOnly", "writeOnly"}
_UNIONS = ("anyOf", "oneOf")


def prepare_schema(schema: Any) -> Any:
    """A rewritten copy of `schema` (see the module docstring); `schema` itself is not changed."""
    schema = copy.deepcopy(schema)
    _walk(schema, "", schema)
    return schema


def _walk(node: Any, path: str, root: Any) -> None:
    if isinstance(node, list):
        for i, sub in enumerate(node):
            _walk(sub, f"{path}/{i}", root)
        return
    if not isinstance(node, dict):
        return
    if isinstance(node.get("discriminator"), dict):
        del node["discriminator"]
    _exclusive_integer_bounds(node)
    _fold_all_of(node, path, root)
    _distribute_union(node, path)
    if isinstance(node.get("properties"), dict) and node["properties"] and node.get("additionalProperties", False) is not False:
        node["additionalProperties"] = False
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples", "required"):
            continue
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, f"{path}/{key}/{name}", root)
        else:
            _walk(value, f"{path}/{key}", root)


_MAX_REF_HOPS = 16


def _exclusive_integer_bounds(node: dict) -> None:
    """An integer's exclusive bounds as the inclusive ones of the same integers (see the module docstring)."""
    if node.get("type") != "integer":
        return
    low, high = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
    if _is_number(low):
        lowest = math.floor(low) + 1
        node["minimum"] = max(lowest, node["minimum"]) if _is_number(node.get("minimum")) else lowest
        del node["exclusiveMinimum"]
    if _is_number(high):
        highest = math.ceil(high) - 1
        node["maximum"] = min(highest, node["maximum"]) if _is_number(node.get("maximum")) else highest
        del node["exclusiveMaximum"]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _fold_all_of(node: dict, path: str, root: Any) -> None:
    """`node`'s `allOf` merged into `node` itself (see the module docstring); its branches' own
    `allOf` first. Raises ValueError naming the place when the branches cannot be merged."""
    branches = node.get("allOf")
    if not isinstance(branches, list):
        return
    resolved = []
    for i, branch in enumerate(branches):
        where = f"{path}/allOf/{i}"
        for _ in range(_MAX_REF_HOPS):  # a branch that is a reference: what it points to (a copy)
            if not (isinstance(branch, dict) and set(branch) - _ANNOTATIONS == {"$ref"}):
                break
            branch = copy.deepcopy(local_target(root, branch["$ref"], where))
        if isinstance(branch, dict):
            _fold_all_of(branch, where, root)
        resolved.append(branch)
    _check_closed_objects(resolved, path)
    merged: Any = {k: v for k, v in node.items() if k != "allOf"}
    for i, branch in enumerate(resolved):
        if branch is False:
            raise ValueError(f"allOf branch {i} (at {location(path)}) is false: no value could match it")
        merged = _merge(merged, branch, f"{path}/allOf/{i}")
    node.clear()
    node.update(merged)


def local_target(root: Any, ref: Any, where: str) -> Any:
    """The subschema the `allOf` branch at `where` refers to (`ref`, a `#/...` pointer into `root`)."""
    try:
        return resolve_json_pointer(root, ref)
    except LookupError as e:
        raise ValueError(f"the allOf branch at {where} is a $ref that cannot be followed: {e}") from None


def _check_closed_objects(branches: list[Any], path: str) -> None:
    """Refuse branches where one closes its object (`additionalProperties` false or a schema) and
    another declares properties outside it: the merged object would allow what the first forbids."""
    declared = [set(b["properties"]) if isinstance(b, dict) and isinstance(b.get("properties"), dict) else set()
                for b in branches]
    for i, branch in enumerate(branches):
        if isinstance(branch, dict) and branch.get("additionalProperties", True) is not True:
            extra = set().union(*(d for j, d in enumerate(declared) if j != i)) - declared[i]
            if extra:
                raise ValueError(f"allOf branch {i} (at {location(path)}) allows no properties besides its own, and "
                                 f"another branch declares {sorted(extra)[0]!r}: no merged schema the xgrammar backend "
                                 "enforces keeps both")


def location(path: str) -> str:
    """A JSON pointer for a message: the root's is empty, which reads as a missing location."""
    return path or "the schema root"


def _distribute_union(node: dict, path: str) -> None:
    unions = [k for k in _UNIONS if isinstance(node.get(k), list)]
    siblings = {k: v for k, v in node.items() if k not in _ANNOTATIONS and k not in _UNIONS}
    if not unions or not siblings:
        return
    if len(unions) > 1 or "$ref" in siblings or "allOf" in siblings:
        raise ValueError(f"{unions[0]} together with {', '.join(unions[1:] + sorted(siblings))} "
                         f"(at {location(path)}) cannot be enforced by the xgrammar backend")
    key = unions[0]
    required_only = key == "oneOf" and all(_only_required(b) for b in node[key])
    node[key] = [_merge(siblings, branch, f"{path}/{key}/{i}") for i, branch in enumerate(node[key])]
    for k in siblings:
        del node[k]
    if required_only:
        _exclusive_required_branches(node[key], f"{path}/{key}")


def _only_required(branch: Any) -> bool:
    return isinstance(branch, dict) and "required" in branch and set(branch) <= _ANNOTATIONS | {"required"}


def _exclusive_required_branches(branches: list[dict], path: str) -> None:
    """Make `oneOf` branches that differ only by their required sets match one branch at most: each
    branch loses the properties that only other branches require (see the module docstring)."""
    required = [set(b.get("required", ())) for b in branches]
    for i, branch in enumerate(branches):
        for j, other in enumerate(required):
            if j != i and other <= required[i]:
                raise ValueError(f"oneOf branches {j} and {i} (at {path}) whose required properties contain one "
                                 "another cannot be told apart by the xgrammar backend")
        others = set().union(*(r for j, r in enumerate(required) if j != i)) - required[i]
        if others and isinstance(branch.get("properties"), dict):
            branch["properties"] = {k: v for k, v in branch["properties"].items() if k not in others}


def _merge(parent: dict, branch: Any, path: str) -> Any:
    if branch is True or branch == {}:
        return dict(parent)
    if parent is True or parent == {}:
        return branch
    if not isinstance(parent, dict) or not isinstance(branch, dict) or "$ref" in branch or any(k in branch for k in _UNIONS + ("allOf",)):
        raise ValueError(f"a union branch (at {path}) that is a reference or a union itself, next to sibling "
                         "keywords, cannot be enforced by the xgrammar backend")
    merged = dict(branch)
    for k, v in parent.items():
        if k in _ANNOTATIONS and k in merged:
            continue
        if k not in merged or merged[k] == v:
            merged[k] = v
        elif k == "required":
            merged[k] = list(dict.fromkeys(list(v) + list(merged[k])))
        elif k == "properties" and isinstance(v, dict) and isinstance(merged[k], dict):
            props = dict(v)
            for name, sub in merged[k].items():
                props[name] = _merge(props[name], sub, f"{path}/properties/{name}") if name in props else sub
            merged[k] = props
        elif k == "type":
            types = _types(v) & _types(merged[k])
            if not types:
                raise ValueError(f"a union branch (at {path}) whose type excludes its parent's")
            merged[k] = sorted(types) if len(types) > 1 else types.pop()
        else:
            raise ValueError(f"{k} given both by a union branch (at {path}) and its parent: the xgrammar backend "
                             "cannot enforce both")
    if "const" in merged and "enum" in merged:  # xgrammar follows one of the two: keep the narrower
        if merged["const"] not in merged["enum"]:
            raise ValueError(f"a union branch (at {path}) whose const is not in its parent's enum")
        del merged["enum"]
    return merged


def _types(t: Any) -> set[str]:
    types = {t} if isinstance(t, str) else set(t)
    if "number" in types:
        types.add("integer")
    return types


def _only_annotations(sub: Any) -> bool:
    return isinstance(sub, dict) and set(sub) <= _ANNOTATIONS
