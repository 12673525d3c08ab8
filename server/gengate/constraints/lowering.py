"""Lowering helpers: what turning a constraint into one llguidance grammar string takes.

Each kind's `lower` is its spec's (gengate.constraints.kinds); what is here is shared or large:
the lowered result, grammar checks, Lark text for grammars and choices, and JSON Schema lowering.
Pure and tokenizer-free: a result is checked with `LLMatcher.validate_grammar` (no tokenizer),
so a bad constraint is refused with a field violation; the compiler checks it again against a
real tokenizer. JSON Schemas llguidance cannot enforce exactly are relaxed (oneOf as anyOf,
unknown formats, uniqueItems, dependencies dropped) and marked VALIDATED: the result is then
checked against the original schema after generation. Field paths are the caller's (the spec's).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jsonschema
from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from gengate import errors
from gengate.constraints.regex_dialect import ascii_shorthands
from gengate.domain import (
    ConstraintKind,
    Enforcement,
    GrammarSyntax,
    JsonSchemaConstraint,
    StructuredOutput,
    Whitespace,
)

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions


# Keywords whose value is one subschema, a list of subschemas, or a map name -> subschema.
_SCHEMA_VALUED = (
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
_LIST_VALUED = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP_VALUED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

# Keywords llguidance reports as unimplemented that can be dropped and checked afterwards.
_DROPPABLE_KEYWORDS = frozenset(
    {"uniqueItems", "dependencies", "dependentRequired", "dependentSchemas", "propertyNames", "not"}
)
_MAX_RELAXATION_ROUNDS = 8
# llguidance's regexes for these accept impossible dates (Feb 29 of any year, year 0000).
_CALENDAR_FORMATS = frozenset({"date", "date-time"})


@dataclass(frozen=True)
class LoweredConstraint:
    """A constraint as llguidance grammar text, plus how it will be enforced.

    `schema` is the JSON Schema results must satisfy (the original, with compile options
    applied) when the constraint is a JSON Schema or JSON object; validation uses it.
    `generate_schema` is the schema the engine is asked to generate: closed objects by default,
    relaxed where the grammar engine cannot enforce a keyword (engines that take a JSON Schema
    rather than a grammar, such as vLLM, are given this one).
    """

    kind: ConstraintKind
    grammar: str
    enforcement: Enforcement = Enforcement.ENGINE
    relaxations: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None
    generate_schema: dict[str, Any] | None = None

    @property
    def key(self) -> str:
        """Canonical text identifying the grammar; equal keys compile to equal matchers."""
        return self.grammar


def choice_lark(choices: tuple[str, ...] | list[str]) -> str:
    """A Lark grammar matching exactly one of `choices` (JSON string escaping is valid Lark)."""
    return "start: " + " | ".join(json.dumps(choice) for choice in choices)


def grammar_to_lark(syntax: GrammarSyntax, definition: str, *, field: str) -> str:
    """Lark text for a grammar constraint; GBNF and EBNF (`::=` rules) go through llguidance's
    converter (a definition it cannot read is refused naming `field`)."""
    if syntax is GrammarSyntax.LARK:
        return definition
    try:
        return any_to_lark(definition)
    except Exception as exc:  # the converter raises plain exceptions of several types
        raise errors.InvalidArgument.field(
            field,
            f"invalid {syntax.value.upper()} grammar: {errors.brief(str(exc))}",
            reason="INVALID_GRAMMAR",
        ) from exc


def check_grammar(grammar: str, field: str, reason: str, *, what: str = "not supported") -> None:
    """Refuses an llguidance grammar its engine would not take, naming `field`."""
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise errors.InvalidArgument.field(field, f"{what}: {errors.brief(error)}", reason=reason)


def json_options(structured: StructuredOutput) -> JsonCompileOptions:
    """llguidance JSON compile options; whitespace defaults to compact (fewer wasted tokens)."""
    return {"whitespace_flexible": structured.whitespace is Whitespace.FLEXIBLE}


def effective_schema(c: JsonSchemaConstraint, structured: StructuredOutput) -> dict[str, Any]:
    """The schema results must satisfy: the caller's, with `additional_properties` applied."""
    schema = copy.deepcopy(c.schema)
    if structured.additional_properties is not None:
        _apply_additional_properties(schema, structured.additional_properties)
    return schema


def lower_json_schema(
    c: JsonSchemaConstraint, structured: StructuredOutput, *, field: str, metaschema: bool = True
) -> LoweredConstraint:
    """The grammar for a JSON Schema constraint; `metaschema` False when check_schema has
    already passed on it (the sandbox checks it before lowering: once per path is enough)."""
    if not isinstance(c.schema, dict):
        raise errors.InvalidArgument.field(field, "the schema must be a JSON object", reason="INVALID_SCHEMA")
    schema = effective_schema(c, structured)
    if metaschema:
        check_schema(schema, field)
    if structured.additional_properties is None:
        # Generate only the listed properties unless asked otherwise: every such output is still
        # valid against the caller's schema, and models do not wander off into invented keys.
        # Where closing objects makes the schema unsatisfiable, fall back to the open form.
        closed = copy.deepcopy(schema)
        _apply_additional_properties(closed, False)
        try:
            return _enforce_json_schema(c, closed, structured, field=field, validate_against=schema)
        except errors.InvalidArgument:
            pass
    return _enforce_json_schema(c, schema, structured, field=field, validate_against=schema)


def _enforce_json_schema(
    c: JsonSchemaConstraint,
    generate: dict[str, Any],
    structured: StructuredOutput,
    *,
    field: str,
    validate_against: dict[str, Any],
) -> LoweredConstraint:
    """Grammar for `generate`, relaxed round by round where the engine refuses a keyword."""
    options = json_options(structured)
    relaxed = copy.deepcopy(generate)
    relaxed.pop("x-guidance", None)
    for _, node in _all_subschemas(relaxed):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = ascii_shorthands(node["pattern"])
    relaxations: list[str] = []
    for _ in range(_MAX_RELAXATION_ROUNDS):
        grammar = LLMatcher.grammar_from_json_schema(relaxed, overrides=options)
        error = LLMatcher.validate_grammar(grammar)
        if not error:
            relaxations.extend(_partially_enforced_formats(relaxed))
            enforcement = Enforcement.VALIDATED if relaxations else Enforcement.ENGINE
            return LoweredConstraint(
                ConstraintKind.JSON_SCHEMA,
                grammar,
                enforcement,
                tuple(relaxations),
                schema=validate_against,
                generate_schema=relaxed,
            )
        found = _relax(relaxed, error, options)
        if not found:
            break
        if c.strict:
            raise errors.InvalidArgument.field(
                field,
                f"unsupported by the grammar engine and strict is set: {errors.brief(error)}",
                reason="UNSUPPORTED_SCHEMA",
            )
        relaxations.extend(found)
    raise errors.InvalidArgument.field(
        field,
        f"unsupported by the grammar engine: {errors.brief(error)}",
        reason="UNSUPPORTED_SCHEMA",
    )


def check_schema(schema: Any, field: str) -> None:
    """Checks a schema against its metaschema ($schema, else Draft 2020-12), refusing it naming
    `field`: the one metaschema check, for the sandbox's syntax check and for lowering alike."""
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(
            schema
        )
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path) or "<root>"
        raise errors.InvalidArgument.field(
            field,
            f"not a valid JSON Schema at {path}: {errors.brief(exc.message)}",
            reason="INVALID_SCHEMA",
        ) from None


_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def _relax(schema: dict[str, Any], error: str, options: JsonCompileOptions) -> list[str]:
    """Relaxes `schema`/`options` in place for llguidance's `error`; returns what was relaxed, or []."""
    if "oneOf" in error and "coerce_one_of" in error and not options.get("coerce_one_of"):
        options["coerce_one_of"] = True
        sites = [path for path, _ in _keyword_sites(schema, "oneOf")]
        return [f"oneOf served as anyOf at {path}" for path in sites] or ["oneOf served as anyOf"]
    if m := _UNKNOWN_FORMAT.search(error):
        fmt = m.group(1).strip("\"'")
        found = [(path, node) for path, node in _keyword_sites(schema, "format") if node["format"] == fmt]
        for _, node in found:
            del node["format"]
        return [f"unknown format {fmt!r} served as a plain string at {path}" for path, _ in found]
    if m := _UNIMPLEMENTED.search(error):
        keys = {k.strip().strip("\"'") for k in m.group(1).split(",")}
        if not keys or not keys <= _DROPPABLE_KEYWORDS:
            return []
        done: list[str] = []
        for key in sorted(keys):
            for path, node in list(_keyword_sites(schema, key)):
                node.pop(key, None)
                done.append(f"keyword {key} not enforced at {path}")
        return done
    return []


def _partially_enforced_formats(schema: dict[str, Any]) -> list[str]:
    """Formats whose llguidance grammar is looser than the format (e.g. 2023-02-29 passes as a date).

    The shape is still enforced; calendar validity is only checked after generation, so these
    make the result VALIDATED rather than ENGINE (strict does not refuse them).
    """
    return [
        f"format {node['format']} calendar validity checked after generation at {path}"
        for path, node in _keyword_sites(schema, "format")
        if node["format"] in _CALENDAR_FORMATS
    ]


def _keyword_sites(schema: Any, keyword: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yields (JSON pointer, subschema) for every subschema that uses `keyword` as a keyword."""
    for path, node in _all_subschemas(schema):
        if keyword in node:
            yield (path or "/", node)


def _all_subschemas(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every subschema once: those reached by keywords, plus local `$ref` targets anywhere."""
    seen: set[int] = set()
    pending: list[tuple[str, Any]] = [("", schema)]
    while pending:
        start_path, start = pending.pop()
        for path, node in _subschemas(start, start_path):
            if id(node) in seen:
                continue
            seen.add(id(node))
            yield path, node
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                try:
                    pending.append((ref[1:], _node_at(schema, ref[1:])))
                except (KeyError, IndexError, ValueError, TypeError):
                    continue


def _subschemas(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yields `node` and the subschemas its keywords hold, with their JSON pointers."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _SCHEMA_VALUED:
        if key in node:
            yield from _subschemas(node[key], f"{path}/{_escape(key)}")
    for key in _LIST_VALUED:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from _subschemas(sub, f"{path}/{key}/{i}")
    for key in _MAP_VALUED:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from _subschemas(sub, f"{path}/{key}/{_escape(name)}")
    items = node.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            yield from _subschemas(sub, f"{path}/items/{i}")
    elif items is not None:
        yield from _subschemas(items, f"{path}/items")
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for name, sub in deps.items():
            yield from _subschemas(sub, f"{path}/dependencies/{_escape(name)}")


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _node_at(schema: dict[str, Any], pointer: str) -> dict[str, Any]:
    node: Any = schema
    for raw in pointer.strip("/").split("/") if pointer.strip("/") else []:
        token = raw.replace("~1", "/").replace("~0", "~")
        node = node[int(token)] if isinstance(node, list) else node[token]
    result: dict[str, Any] = node
    return result


def _apply_additional_properties(schema: dict[str, Any], allowed: bool) -> None:
    """Sets additionalProperties on object subschemas that do not say.

    allOf members and schemas combining allOf/$ref are left alone: closing them would make the
    conjunction unsatisfiable.
    """
    for path, node in list(_all_subschemas(schema)):
        is_object = node.get("type") == "object" or "properties" in node
        says = any(k in node for k in ("additionalProperties", "unevaluatedProperties", "patternProperties"))
        in_all_of = re.search(r"/allOf/\d+$", path) is not None
        listed = node.get("properties", {})
        closable = allowed or (
            all(k in listed for k in node.get("required", []))
            and node.get("minProperties", 0) <= len(listed)
            and not any(k in node for k in ("anyOf", "oneOf", "if", "dependentRequired", "dependencies"))
        )
        if (
            is_object
            and not says
            and not in_all_of
            and "allOf" not in node
            and "$ref" not in node
            and closable
        ):
            node["additionalProperties"] = allowed
