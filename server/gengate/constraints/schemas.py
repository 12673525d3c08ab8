"""Walking a JSON Schema's subschemas: the one walker every schema reader and rewrite uses (the
grammar lowering's relaxations and closed objects, providers' strict-mode transforms).

Subschemas are found by keyword (`properties`, `items`, `anyOf`, ...), never by reading data
keywords (`enum`, `const`, `default`) as schemas; pointers are RFC 6901 JSON Pointers. The walk
is iterative, so no schema depth can overflow the stack.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

# Keywords whose value is one subschema, a list of subschemas, or a map name -> subschema.
SCHEMA_VALUED = (
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "additionalItems",
)
LIST_VALUED = ("allOf", "anyOf", "oneOf", "prefixItems")
MAP_VALUED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


# Annotation keywords (JSON Schema 2020-12 meta-data, plus $comment): they describe, they never
# change what validates, so two schemas differing only in them enforce the same language.
ANNOTATIONS = frozenset(
    {"title", "description", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
)


def without_annotations(schema: Any) -> Any:
    """The schema with annotation keywords removed from every subschema (property *names* such as
    `description` under `properties` stay: they are data, not keywords). The schema itself when it
    has none, or when a `$ref` points into one (then the annotation holds a schema that is used)."""
    sites = [node for _, node in subschemas(schema) if not ANNOTATIONS.isdisjoint(node)]
    if not sites or _refers_into_annotations(schema):
        return schema

    def strip(node: dict[str, Any]) -> dict[str, Any]:
        if ANNOTATIONS.isdisjoint(node):
            return node
        return {key: value for key, value in node.items() if key not in ANNOTATIONS}

    return rewrite(schema, strip)


def _refers_into_annotations(schema: Any) -> bool:
    """Whether some `$ref` anywhere in the schema passes through an annotation keyword."""
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and any(
                token.replace("~1", "/").replace("~0", "~") in ANNOTATIONS for token in ref.split("/")
            ):
                return True
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return False


def escape(token: str) -> str:
    """A key as a JSON Pointer reference token."""
    return token.replace("~", "~0").replace("/", "~1")


def children(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, str, Any, Any]]:
    """(keyword, pointer, subschema, where) for each subschema `node`'s keywords hold, in order;
    `where` is the list index or map key inside the keyword (None for a single subschema)."""
    for key in SCHEMA_VALUED:
        if key in node:
            yield key, f"{path}/{escape(key)}", node[key], None
    for key in LIST_VALUED:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield key, f"{path}/{key}/{i}", sub, i
    for key in MAP_VALUED:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield key, f"{path}/{key}/{escape(name)}", sub, name
    items = node.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            yield "items", f"{path}/items/{i}", sub, i
    elif items is not None:
        yield "items", f"{path}/items", items, None
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for name, sub in deps.items():
            if isinstance(sub, dict):  # a list there is dependentRequired's older spelling
                yield "dependencies", f"{path}/dependencies/{escape(name)}", sub, name


def subschemas(schema: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(pointer, subschema) for `schema` and every subschema its keywords hold, parents first."""
    pending: list[tuple[str, Any]] = [(path, schema)]
    while pending:
        at, node = pending.pop()
        if not isinstance(node, dict):
            continue
        yield at, node
        pending.extend(reversed([(pointer, sub) for _, pointer, sub, _ in children(node, at)]))


def all_subschemas(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every subschema once: those reached by keywords, plus local `$ref` targets anywhere."""
    seen: set[int] = set()
    pending: list[tuple[str, Any]] = [("", schema)]
    while pending:
        start_path, start = pending.pop()
        for path, node in subschemas(start, start_path):
            if id(node) in seen:
                continue
            seen.add(id(node))
            yield path, node
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                try:
                    pending.append((ref[1:], node_at(schema, ref[1:])))
                except (KeyError, IndexError, ValueError, TypeError):
                    continue


def keyword_sites(schema: Any, keyword: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(pointer, subschema) for every subschema that uses `keyword` as a keyword."""
    for path, node in all_subschemas(schema):
        if keyword in node:
            yield (path or "/", node)


def node_at(schema: dict[str, Any], pointer: str) -> dict[str, Any]:
    """The value at a JSON Pointer (KeyError/IndexError/ValueError when there is none)."""
    node: Any = schema
    for raw in pointer.strip("/").split("/") if pointer.strip("/") else []:
        token = raw.replace("~1", "/").replace("~0", "~")
        node = node[int(token)] if isinstance(node, list) else node[token]
    result: dict[str, Any] = node
    return result


def rewrite(
    schema: Any,
    node_fn: Callable[[dict[str, Any]], dict[str, Any]],
    *,
    descend: Callable[[str], bool] = lambda keyword: True,
) -> Any:
    """A new schema: every subschema (under keywords `descend` accepts) rebuilt bottom-up, then
    passed to `node_fn`, which returns the node to put in its place. Values that are not
    subschemas are kept as they are (shared, not copied: `node_fn` must not mutate them)."""
    if not isinstance(schema, dict):
        return schema
    # Iterative post-order: children are rebuilt before their parent.
    done: dict[int, dict[str, Any]] = {}
    stack: list[tuple[dict[str, Any], bool]] = [(schema, False)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in done:
            continue
        subs = [sub for keyword, _, sub, _ in children(node) if descend(keyword) and isinstance(sub, dict)]
        if not expanded:
            stack.append((node, True))
            stack.extend((sub, False) for sub in subs if id(sub) not in done)
            continue
        rebuilt = dict(node)
        for keyword, _, sub, where in children(node):
            if not descend(keyword) or not isinstance(sub, dict):
                continue
            new = done[id(sub)]
            if where is None:
                rebuilt[keyword] = new
            elif isinstance(where, int):
                if rebuilt[keyword] is node[keyword]:
                    rebuilt[keyword] = list(node[keyword])
                rebuilt[keyword][where] = new
            else:
                if rebuilt[keyword] is node[keyword]:
                    rebuilt[keyword] = dict(node[keyword])
                rebuilt[keyword][where] = new
        done[id(node)] = node_fn(rebuilt)
    return done[id(schema)]
