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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jsonschema
from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from gengate import errors
from gengate.constraints.regex_dialect import ascii_shorthands
from gengate.constraints.schemas import all_subschemas, keyword_sites
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
    for _, node in all_subschemas(relaxed):
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
        sites = [path for path, _ in keyword_sites(schema, "oneOf")]
        return [f"oneOf served as anyOf at {path}" for path in sites] or ["oneOf served as anyOf"]
    if m := _UNKNOWN_FORMAT.search(error):
        fmt = m.group(1).strip("\"'")
        found = [(path, node) for path, node in keyword_sites(schema, "format") if node["format"] == fmt]
        for _, node in found:
            del node["format"]
        return [f"unknown format {fmt!r} served as a plain string at {path}" for path, _ in found]
    if m := _UNIMPLEMENTED.search(error):
        keys = {k.strip().strip("\"'") for k in m.group(1).split(",")}
        if not keys or not keys <= _DROPPABLE_KEYWORDS:
            return []
        done: list[str] = []
        for key in sorted(keys):
            for path, node in list(keyword_sites(schema, key)):
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
        for path, node in keyword_sites(schema, "format")
        if node["format"] in _CALENDAR_FORMATS
    ]


def _apply_additional_properties(schema: dict[str, Any], allowed: bool) -> None:
    """Sets additionalProperties on object subschemas that do not say.

    allOf members and schemas combining allOf/$ref are left alone: closing them would make the
    conjunction unsatisfiable.
    """
    for path, node in list(all_subschemas(schema)):
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
