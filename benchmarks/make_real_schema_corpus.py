"""Writes benchmarks/data/real_json_schemas.jsonl: a stratified sample of real-world JSON schemas
from JSONSchemaBench (github.com/guidance-ai/jsonschemabench, data/<collection>/<id>.json), the
structured-output validity corpus (see benchmarks/data/README.md for sources and licence).

The sample is deterministic (fixed seed, sorted inputs) and balanced twice: a quota per collection
(GitHub at four difficulty levels, Kubernetes, Snowplow, Washington Post, JSON Schema Store,
GlaiveAI function calls), and within a collection round-robin over the schemas' features (nesting,
enum, anyOf/oneOf/allOf, pattern, min/max items, required, $ref, numeric bounds, format), so rare
features are not crowded out. Kept only: object schemas of moderate size (so SmolLM2 can write a
document within a token budget), without remote $refs, that jsonschema itself accepts.

    fetch github:guidance-ai/jsonschemabench          # or git clone it
    python benchmarks/make_real_schema_corpus.py --repo /path/to/jsonschemabench [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
from pathlib import Path

import jsonschema

OUT = Path(__file__).parent / "data" / "real_json_schemas.jsonl"
# collection -> schemas taken (sum 264); small collections are not padded from big ones
QUOTAS = {
    "Github_trivial": 24, "Github_easy": 40, "Github_medium": 40, "Github_hard": 30,
    "Glaiveai2K": 30, "Kubernetes": 24, "Snowplow": 30, "WashingtonPost": 20, "JsonSchemaStore": 26,
}
MAX_CHARS = 4000  # compact schema text
MAX_REQUIRED = 14  # required properties over the whole schema: bounds the document's length


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", repo, *args], check=True, capture_output=True, text=True).stdout


def git_dir(path: str) -> str:
    p = Path(path)
    return str(p / ".git") if (p / ".git").is_dir() else str(p)


def walk(node, depth: int = 0):
    """(depth, subschema) of every dict reachable through the schema's keywords."""
    if isinstance(node, dict):
        yield depth, node
        for key, value in node.items():
            if key in ("properties", "patternProperties", "definitions", "$defs"):
                if isinstance(value, dict):
                    for sub in value.values():
                        yield from walk(sub, depth + (key == "properties"))
            elif key in ("items", "additionalProperties", "not", "contains", "additionalItems"):
                yield from walk(value, depth + (key == "items"))
            elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
                for sub in value:
                    yield from walk(sub, depth)
    elif isinstance(node, list):
        for sub in node:
            yield from walk(sub, depth)


def features(schema: dict) -> tuple[list[str], int, bool]:
    """(feature names, total required properties, has a remote $ref) of a schema."""
    found: set[str] = set()
    required = 0
    remote = False
    for depth, node in walk(schema):
        if depth >= 2:
            found.add("nesting")
        if "enum" in node or "const" in node:
            found.add("enum")
        if any(k in node for k in ("anyOf", "oneOf", "allOf")):
            found.add("anyOf")
        if "pattern" in node or "patternProperties" in node:
            found.add("pattern")
        if "minItems" in node or "maxItems" in node:
            found.add("min_max_items")
        if isinstance(node.get("required"), list) and node["required"]:
            found.add("required")
            required += len(node["required"])
        if any(k in node for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            found.add("numeric_bounds")
        if "minLength" in node or "maxLength" in node:
            found.add("string_length")
        if "format" in node:
            found.add("format")
        if "$ref" in node:
            found.add("ref")
            if not str(node["$ref"]).startswith("#"):
                remote = True
        if node.get("additionalProperties") is False:
            found.add("closed_object")
    return sorted(found), required, remote


def usable(schema) -> tuple[list[str], int] | None:
    if not isinstance(schema, dict) or schema.get("type", "object") != "object" or "properties" not in schema:
        return None
    if len(json.dumps(schema, separators=(",", ":"))) > MAX_CHARS:
        return None
    feats, required, remote = features(schema)
    if remote or required > MAX_REQUIRED:
        return None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError:
        return None
    return feats, required


def prompt_for(schema: dict) -> str:
    what = schema.get("title") or schema.get("description") or ""
    what = " ".join(str(what).split())[:160]
    keys = ", ".join(list(schema["properties"])[:8])
    return (f"Write one realistic JSON document{' for: ' + what if what else ''}. "
            f"Top-level fields: {keys}. Keep strings short and arrays to a few items.")


def stratified(candidates: list[dict], quota: int, rng: random.Random) -> list[dict]:
    """Round-robin over features (rarest first): each turn takes one unpicked schema having it."""
    rng.shuffle(candidates)
    by_feature: dict[str, list[dict]] = {}
    for c in candidates:
        for f in c["features"] or ["plain"]:
            by_feature.setdefault(f, []).append(c)
    order = sorted(by_feature, key=lambda f: len(by_feature[f]))
    picked: list[dict] = []
    seen: set[str] = set()
    while len(picked) < min(quota, len(candidates)):
        progressed = False
        for f in order:
            pool = by_feature[f]
            while pool and pool[-1]["id"] in seen:
                pool.pop()
            if pool and len(picked) < quota:
                c = pool.pop()
                seen.add(c["id"])
                picked.append(c)
                progressed = True
        if not progressed:
            break
    return picked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", required=True, help="a clone (or bare mirror) of guidance-ai/jsonschemabench")
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    repo = git_dir(args.repo)
    commit = git(repo, "rev-parse", args.commit).strip()
    rng = random.Random(args.seed)
    rows: list[dict] = []
    for collection, quota in QUOTAS.items():
        names = sorted(git(repo, "ls-tree", "--name-only", f"{commit}:data/{collection}").split())
        candidates = []
        for name in names:
            try:
                schema = json.loads(git(repo, "show", f"{commit}:data/{collection}/{name}"))
            except (ValueError, subprocess.CalledProcessError):
                continue
            info = usable(schema)
            if info is not None:
                sid = f"{collection}/{name.removesuffix('.json')}"
                candidates.append({"id": sid, "source": collection, "features": info[0], "schema": schema})
        picked = stratified(candidates, quota, rng)
        print(f"{collection}: {len(candidates)} usable of {len(names)}, took {len(picked)}")
        rows += sorted(picked, key=lambda c: c["id"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for r in rows:
            r["prompt"] = prompt_for(r["schema"])
            f.write(json.dumps({"id": r["id"], "source": r["source"], "features": r["features"], "prompt": r["prompt"],
                                "schema": r["schema"]}, separators=(",", ":")) + "\n")
    counts: dict[str, int] = {}
    for r in rows:
        for feat in r["features"]:
            counts[feat] = counts.get(feat, 0) + 1
    print(f"wrote {len(rows)} schemas from {commit} to {args.out} ({args.out.stat().st_size} bytes)")
    print("schemas per feature:", json.dumps(dict(sorted(counts.items()))))


if __name__ == "__main__":
    main()
