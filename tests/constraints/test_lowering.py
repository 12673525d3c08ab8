"""Lowering each constraint kind to an llguidance grammar; relaxations; refusals."""

from __future__ import annotations

import json
from typing import Any

import pytest
from gengate import errors
from gengate.constraints import lower
from gengate.domain import (
    ChoiceConstraint,
    ConstraintKind,
    Enforcement,
    GrammarConstraint,
    GrammarSyntax,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuredOutput,
    Whitespace,
)
from llguidance import LLMatcher


def so(constraint: Any, **options: Any) -> StructuredOutput:
    return StructuredOutput(constraint, **options)


def refused(structured: StructuredOutput) -> errors.InvalidArgument:
    with pytest.raises(errors.InvalidArgument) as info:
        lower(structured)
    return info.value


def test_json_schema_is_enforced_by_the_engine_with_options() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 3}}, "required": ["a"]}
    lowered = lower(so(JsonSchemaConstraint(schema), whitespace=Whitespace.FLEXIBLE))
    assert lowered.kind is ConstraintKind.JSON_SCHEMA
    assert lowered.enforcement is Enforcement.ENGINE
    assert lowered.relaxations == ()
    grammar = json.loads(lowered.grammar)["grammars"][0]["json_schema"]
    assert grammar["x-guidance"]["whitespace_flexible"] is True
    assert LLMatcher.validate_grammar(lowered.grammar) == ""
    compact = json.loads(lower(so(JsonSchemaConstraint(schema))).grammar)
    assert compact["grammars"][0]["json_schema"]["x-guidance"]["whitespace_flexible"] is False


def test_additional_properties_option_closes_objects_that_do_not_say() -> None:
    schema = {
        "type": "object",
        "properties": {"inner": {"type": "object", "properties": {"x": {"type": "string"}}}},
        "additionalProperties": True,
    }
    lowered = lower(so(JsonSchemaConstraint(schema), additional_properties=False))
    assert lowered.schema is not None
    assert lowered.schema["additionalProperties"] is True  # the caller's own word wins
    assert lowered.schema["properties"]["inner"]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["inner"]  # caller's dict untouched


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (
            {"type": "object", "properties": {"x": {"oneOf": [{"type": "number"}, {"type": "integer"}]}}},
            "oneOf served as anyOf at /properties/x",
        ),
        ({"type": "string", "format": "path"}, "unknown format 'path' served as a plain string at /"),
        (
            {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
            "keyword uniqueItems not enforced at /",
        ),
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "dependencies": {"a": ["b"]}},
            "keyword dependencies not enforced at /",
        ),
        (
            {"type": "object", "dependentRequired": {"a": ["b"]}},
            "keyword dependentRequired not enforced at /",
        ),
    ],
)
def test_unsupported_keywords_are_relaxed_and_marked_validated(schema: dict[str, Any], expected: str) -> None:
    lowered = lower(so(JsonSchemaConstraint(schema)))
    assert lowered.enforcement is Enforcement.VALIDATED
    assert expected in lowered.relaxations
    assert lowered.schema == schema  # validation uses the original
    assert LLMatcher.validate_grammar(lowered.grammar) == ""


def test_relaxations_combine_and_property_names_are_not_keywords() -> None:
    schema = {
        "type": "object",
        "properties": {
            "format": {"type": "string", "format": "byte"},
            "tags": {"type": "array", "uniqueItems": True, "items": {"type": "string"}},
        },
    }
    lowered = lower(so(JsonSchemaConstraint(schema)))
    assert set(lowered.relaxations) == {
        "unknown format 'byte' served as a plain string at /properties/format",
        "keyword uniqueItems not enforced at /properties/tags",
    }


def test_strict_refuses_instead_of_relaxing() -> None:
    error = refused(so(JsonSchemaConstraint({"type": "array", "uniqueItems": True}, strict=True)))
    assert error.reason == "UNSUPPORTED_SCHEMA"
    assert error.violations[0].field == "structured_output.json_schema.schema"
    assert "uniqueItems" in error.violations[0].description
    assert "strict" in error.violations[0].description


def test_invalid_schema_is_refused_by_the_metaschema() -> None:
    error = refused(so(JsonSchemaConstraint({"type": "objekt"})))
    assert error.reason == "INVALID_SCHEMA"
    assert error.violations[0].field == "structured_output.json_schema.schema"
    assert "objekt" in error.violations[0].description


def test_draft4_schemas_are_checked_against_their_own_metaschema() -> None:
    schema = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
    }
    assert lower(so(JsonSchemaConstraint(schema))).kind is ConstraintKind.JSON_SCHEMA


def test_unrelaxable_schema_is_refused_with_llguidance_text() -> None:
    error = refused(so(JsonSchemaConstraint({"type": "string", "pattern": "(?=a)b"})))
    assert error.reason == "UNSUPPORTED_SCHEMA"
    assert error.violations[0].field == "structured_output.json_schema.schema"
    assert "unsupported by the grammar engine" in error.violations[0].description


def test_regex_lowers_and_bad_regex_is_refused() -> None:
    lowered = lower(so(RegexConstraint(r"\d{3}-[a-z]+")))
    assert lowered.kind is ConstraintKind.REGEX and lowered.enforcement is Enforcement.ENGINE
    error = refused(so(RegexConstraint("a(b")))
    assert error.reason == "INVALID_REGEX"
    assert error.violations[0].field == "structured_output.regex.pattern"
    assert "unclosed group" in error.violations[0].description


def test_choices_are_escaped_literals() -> None:
    choices = ('he said "hi"', "back\\slash", "new\nline", "ünï 🎉", "/x/", "a|b")
    lowered = lower(so(ChoiceConstraint(choices)))
    assert lowered.kind is ConstraintKind.CHOICE
    assert LLMatcher.validate_grammar(lowered.grammar) == ""


def test_empty_choice_list_is_refused() -> None:
    error = refused(so(ChoiceConstraint(())))
    assert error.reason == "EMPTY_CHOICES"
    assert error.violations[0].field == "structured_output.choice.choices"


GBNF = 'root ::= "yes" | "no" | num\nnum ::= [0-9]+ ("." [0-9]+)?\n'


@pytest.mark.parametrize(
    ("syntax", "definition"),
    [
        (GrammarSyntax.LARK, 'start: "yes" | "no" | NUM\nNUM: /[0-9]+/\n'),
        (GrammarSyntax.GBNF, GBNF),
        (GrammarSyntax.EBNF, GBNF),
    ],
)
def test_grammars_lower(syntax: GrammarSyntax, definition: str) -> None:
    lowered = lower(so(GrammarConstraint(syntax, definition)))
    assert lowered.kind is ConstraintKind.GRAMMAR
    assert LLMatcher.validate_grammar(lowered.grammar) == ""


@pytest.mark.parametrize(
    ("syntax", "definition", "needle"),
    [
        (GrammarSyntax.LARK, "start: foo\n", "foo"),
        (GrammarSyntax.GBNF, "root ::= ( \n", "GBNF"),
        (GrammarSyntax.LARK, "   ", "empty"),
    ],
)
def test_bad_grammars_are_refused(syntax: GrammarSyntax, definition: str, needle: str) -> None:
    error = refused(so(GrammarConstraint(syntax, definition)))
    assert error.reason == "INVALID_GRAMMAR"
    assert error.violations[0].field == "structured_output.grammar.definition"
    assert needle in error.violations[0].description


def test_json_object_is_any_object() -> None:
    lowered = lower(so(JsonObjectConstraint()))
    assert lowered.kind is ConstraintKind.JSON_OBJECT
    assert lowered.schema == {"type": "object"}


def test_relaxation_reaches_subschemas_only_referenced_by_ref() -> None:
    schema = {
        "definitions": {
            "wrap": {"full": {"type": "array", "items": {"oneOf": [{"type": "number"}, {"type": "integer"}]}}}
        },
        "type": "object",
        "properties": {"xs": {"$ref": "#/definitions/wrap/full"}, "p": {"$ref": "#/definitions/wrap/full"}},
    }
    lowered = lower(so(JsonSchemaConstraint(schema)))
    assert lowered.enforcement is Enforcement.VALIDATED
    assert lowered.relaxations == ("oneOf served as anyOf at /definitions/wrap/full/items",)


def test_not_and_property_names_are_relaxed() -> None:
    schema = {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "not": {"required": ["x"]}}
    lowered = lower(so(JsonSchemaConstraint(schema)))
    assert set(lowered.relaxations) == {
        "keyword not not enforced at /",
        "keyword propertyNames not enforced at /",
    }


def test_calendar_formats_are_served_as_validated_even_when_strict() -> None:
    schema = {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}}
    lowered = lower(so(JsonSchemaConstraint(schema, strict=True)))
    assert lowered.enforcement is Enforcement.VALIDATED
    assert lowered.relaxations == (
        "format date calendar validity checked after generation at /properties/day",
    )
    grammar = json.loads(lowered.grammar)["grammars"][0]["json_schema"]
    assert grammar["properties"]["day"]["format"] == "date"  # the shape is still enforced


def test_unset_additional_properties_generates_listed_keys_but_validates_the_original() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    lowered = lower(so(JsonSchemaConstraint(schema)))
    generated = json.loads(lowered.grammar)["grammars"][0]["json_schema"]
    assert generated["additionalProperties"] is False  # the engine only writes listed keys
    assert lowered.schema == schema  # results are still judged by the caller's schema
    assert lowered.enforcement is Enforcement.ENGINE


def test_closing_objects_falls_back_when_it_would_be_unsatisfiable() -> None:
    # `y` is required but only allowed through patternProperties of a sibling branch: closing
    # the object would make it unsatisfiable, so the open form is enforced instead.
    schema = {"type": "object", "required": ["y"], "properties": {"x": {"type": "integer"}}}
    lowered = lower(so(JsonSchemaConstraint(schema)))
    generated = json.loads(lowered.grammar)["grammars"][0]["json_schema"]
    assert "additionalProperties" not in generated
    assert LLMatcher.validate_grammar(lowered.grammar) == ""
