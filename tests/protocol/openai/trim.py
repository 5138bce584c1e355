"""Writes openapi-subset.json: the request bodies of the OpenAI operations Ballast answers
for, cut out of OpenAI's published OpenAPI description with every schema they reach.

    python tests/protocol/openai/trim.py PATH [--fetched YYYY-MM-DD]

PATH is a clone of https://github.com/openai/openai-openapi (its HEAD's openapi.yaml is
read, and the commit recorded), or an openapi.yaml / openapi.json file (then --commit
says which commit it came from). The schemas are copied verbatim: what the tests read is
what OpenAI publishes, and any reading of it (nullable, allOf, closed objects) is the
test's, stated there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPOSITORY = "https://github.com/openai/openai-openapi"
OUT = Path(__file__).with_name("openapi-subset.json")
# operationId -> the path it is served at, as the spec names both.
OPERATIONS = ("createChatCompletion", "createCompletion", "createEmbedding", "createBatch")
REF = "#/components/schemas/"


def load(source: Path, commit: str | None) -> tuple[dict[str, Any], str, str]:
    """The spec, the commit it is from, and the file read."""
    if source.is_dir():
        names = subprocess.run(["git", "-C", str(source), "ls-tree", "--name-only", "HEAD"], check=True,
                               capture_output=True, text=True).stdout.split()
        name = "openapi.yaml" if "openapi.yaml" in names else "openapi.json"
        text = subprocess.run(["git", "-C", str(source), "show", f"HEAD:{name}"], check=True,
                              capture_output=True, text=True).stdout
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
    else:
        if commit is None:
            sys.exit("--commit is needed with a file: the subset records where it came from")
        name, text = source.name, source.read_text()
    if name.endswith((".yaml", ".yml")):
        import yaml  # type: ignore[import-untyped]

        # The C loader reads the 3 MB spec in about a second, the pure-Python one in ten.
        spec = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    else:
        spec = json.loads(text)
    return spec, commit, name


def refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(refs(v) for k, v in node.items() if k != "$ref"))
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    return set()


def trim(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The operations (path and body schema) and every component schema they reach."""
    schemas = spec["components"]["schemas"]
    operations: dict[str, Any] = {}
    for path, item in spec["paths"].items():
        for method, op in item.items():
            if isinstance(op, dict) and op.get("operationId") in OPERATIONS:
                body = op["requestBody"]["content"]["application/json"]["schema"]
                operations[op["operationId"]] = {"method": method.upper(), "path": path, "schema": body}
    missing = set(OPERATIONS) - set(operations)
    if missing:
        sys.exit(f"not in the spec: {', '.join(sorted(missing))}")
    kept: dict[str, Any] = {}
    todo = refs(operations)
    while todo:
        ref = todo.pop()
        if not ref.startswith(REF):
            sys.exit(f"a reference outside the component schemas: {ref}")
        name = ref[len(REF):]
        if name not in kept:
            kept[name] = schemas[name]
            todo |= refs(kept[name])
    return {k: operations[k] for k in OPERATIONS}, {k: kept[k] for k in sorted(kept)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, help="a clone of openai/openai-openapi, or its openapi.yaml/json")
    ap.add_argument("--commit", help="the commit a file given as SOURCE is from")
    ap.add_argument("--fetched", default=datetime.datetime.now(datetime.UTC).date().isoformat(),
                    help="when the spec was fetched (default: today, UTC)")
    args = ap.parse_args()
    spec, commit, name = load(args.source, args.commit)
    operations, schemas = trim(spec)
    subset = {
        "source": {"repository": REPOSITORY, "commit": commit, "file": name, "openapi": spec["openapi"],
                   "info.version": spec["info"]["version"], "fetched": args.fetched},
        "operations": operations,
        "components": {"schemas": schemas},
    }
    OUT.write_text(json.dumps(subset, indent=1, ensure_ascii=False) + "\n")
    print(f"{OUT}: {len(operations)} operations, {len(schemas)} schemas, {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main()
