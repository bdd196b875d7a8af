"""Writes benchmarks/data/json_schemas.jsonl: the structured-output validity corpus.

Source: written for this project (no pip-installable package ships a corpus of this kind). Each
schema models an API payload of a common domain (users, orders, invoices, events, sensors, ...)
and combines the features real schemas use: nested objects (up to 3 levels), enums and consts,
anyOf, string patterns and length bounds, numeric bounds, arrays with minItems/maxItems, nullable
fields, required lists, additionalProperties false, and in a few schemas `uniqueItems` (which a
grammar cannot enforce: the xgrammar backend refuses those schemas with a 400). Deterministic (seeded): re-running it gives the
same file. One JSON object per line: {"id", "title", "prompt", "schema", "features"}.

    python benchmarks/make_schema_corpus.py [--count 240]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).parent / "data" / "json_schemas.jsonl"

DOMAINS = [
    "user profile", "shipping address", "product listing", "customer order", "invoice", "calendar event",
    "support ticket", "blog post", "movie review", "weather report", "sensor reading", "bank transaction",
    "flight booking", "hotel reservation", "recipe", "job posting", "employee record", "library book",
    "music track", "restaurant menu item", "medical appointment", "vehicle listing", "course enrollment",
    "software release", "git commit summary", "server health check", "sports match result", "real estate listing",
    "survey answer", "shopping cart", "payment method", "chat message", "news article", "podcast episode",
    "inventory item", "delivery status", "game character", "conference talk", "pet adoption profile", "tax form line",
]

# leaf fields a payload of any domain may have: (name, schema, feature tags)
LEAVES = [
    ("id", {"type": "integer", "minimum": 1, "maximum": 99999}, ["integer", "bounds"]),
    ("name", {"type": "string", "minLength": 1, "maxLength": 30}, ["string", "length"]),
    ("title", {"type": "string", "maxLength": 40}, ["string", "length"]),
    ("email", {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,10}\\.(com|org|net)$"}, ["pattern"]),
    ("phone", {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}, ["pattern"]),
    ("zip_code", {"type": "string", "pattern": "^[0-9]{5}$"}, ["pattern"]),
    ("date", {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"}, ["pattern"]),
    ("status", {"enum": ["pending", "active", "done", "cancelled"]}, ["enum"]),
    ("priority", {"enum": ["low", "medium", "high"]}, ["enum"]),
    ("currency", {"enum": ["USD", "EUR", "GBP", "JPY"]}, ["enum"]),
    ("rating", {"type": "integer", "enum": [1, 2, 3, 4, 5]}, ["enum", "integer"]),
    ("price", {"type": "number", "minimum": 0, "maximum": 10000}, ["number", "bounds"]),
    ("quantity", {"type": "integer", "minimum": 0, "maximum": 1000}, ["integer", "bounds"]),
    ("score", {"type": "number", "minimum": 0, "maximum": 1}, ["number", "bounds"]),
    ("active", {"type": "boolean"}, ["boolean"]),
    ("verified", {"type": "boolean"}, ["boolean"]),
    ("notes", {"type": ["string", "null"], "maxLength": 60}, ["nullable"]),
    ("version", {"type": "string", "pattern": "^[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,3}$"}, ["pattern"]),
    ("country", {"type": "string", "pattern": "^[A-Z]{2}$"}, ["pattern"]),
    ("kind", {"const": "record"}, ["const"]),
    ("tags", {"type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 1, "maxItems": 4},
     ["array", "min_max_items"]),
    ("scores", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 5},
     ["array", "min_max_items"]),
    ("labels", {"type": "array", "items": {"enum": ["new", "sale", "popular", "limited"]}, "minItems": 1,
                "maxItems": 3}, ["array", "enum", "min_max_items"]),
    ("contact", {"anyOf": [
        {"type": "object", "properties": {"email": {"type": "string", "maxLength": 30}}, "required": ["email"],
         "additionalProperties": False},
        {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{7,10}$"}},
         "required": ["phone"], "additionalProperties": False},
    ]}, ["anyOf", "nested"]),
    ("amount", {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]}, ["anyOf", "nullable"]),
    ("identifier", {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"}]},
     ["anyOf", "pattern"]),
]
CHILD_NAMES = ["address", "owner", "details", "metadata", "location", "author", "summary", "settings", "dimensions"]
LIST_NAMES = ["items", "entries", "line_items", "participants", "steps", "attachments"]


def _object(rng: random.Random, depth: int, features: set[str]) -> dict:
    n = rng.randint(2, 6 if depth == 0 else 4)
    picks = rng.sample(LEAVES, n)
    props: dict = {}
    for name, schema, tags in picks:
        props[name] = json.loads(json.dumps(schema))
        features.update(tags)
        if name == "labels" and rng.random() < 0.1:  # a keyword grammars cannot enforce: refused by some backends
            props[name]["uniqueItems"] = True
            features.add("uniqueItems")
    if depth < 2 and rng.random() < 0.55:
        props[rng.choice(CHILD_NAMES)] = _object(rng, depth + 1, features)
        features.add("nested")
    if depth < 2 and rng.random() < 0.35:
        item = _object(rng, depth + 1, features)
        lo = rng.randint(0, 2)
        props[rng.choice(LIST_NAMES)] = {"type": "array", "items": item, "minItems": lo, "maxItems": lo + rng.randint(1, 3)}
        features.update({"array", "min_max_items", "nested"})
    names = list(props)
    required = names if rng.random() < 0.4 else sorted(rng.sample(names, rng.randint(1, len(names))), key=names.index)
    obj = {"type": "object", "properties": props, "required": required}
    features.add("required")
    if rng.random() < 0.6:
        obj["additionalProperties"] = False
        features.add("additionalProperties")
    return obj


def make_corpus(count: int, seed: int = 2026) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        domain = DOMAINS[i % len(DOMAINS)]
        features: set[str] = set()
        schema = _object(rng, 0, features)
        schema = {"title": domain.title().replace(" ", ""), **schema}
        if rng.random() < 0.08:  # a top-level anyOf of two payload shapes
            other = _object(rng, 1, features)
            schema = {"title": schema["title"], "anyOf": [{k: v for k, v in schema.items() if k != "title"}, other]}
            features.add("anyOf")
        out.append({
            "id": f"s{i:03d}",
            "title": domain,
            "prompt": f"Produce a realistic {domain} as JSON.",
            "schema": schema,
            "features": sorted(features),
        })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=240)
    args = p.parse_args()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w") as f:
        for entry in make_corpus(args.count):
            f.write(json.dumps(entry) + "\n")
    print(f"wrote {args.count} schemas to {OUT}")


if __name__ == "__main__":
    main()
