"""The validators behind "validated before return", keyword by keyword, with the exact reasons a
caller sees: additionalProperties (false, a schema, beside patternProperties), pattern and
patternProperties matched by RE2 (search, not match), the regex syntax check, grammar and regex
fallbacks to llguidance, and the length cuts of reasons. Written against the mutants that
survived tests/constraints/test_validation.py (tests/mutation/SURVIVORS.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from gengate.constraints import validate_output
from gengate.constraints.validation import (
    choice_grammar,
    linear_regex_error,
    schema_validator,
    short,
    validate_json,
    validate_regex,
)
from gengate.domain import (
    GrammarConstraint,
    GrammarSyntax,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuredOutput,
)


def check(schema: dict[str, Any], value: Any, **options: Any) -> str | None:
    return validate_output(StructuredOutput(JsonSchemaConstraint(schema), **options), json.dumps(value))


CLOSED = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}


def test_listed_properties_pass_a_closed_object_and_each_extra_is_named() -> None:
    assert check(CLOSED, {"a": 1}) is None
    assert check(CLOSED, {}) is None
    assert check(CLOSED, {"a": 1, "b": 2}) == (
        "does not match the schema at /: Additional properties are not allowed ('b' was unexpected)"
    )
    assert check(CLOSED, {"b": 2, "c": 3}) == (
        "does not match the schema at /: Additional properties are not allowed ('b', 'c' were unexpected)"
    )


def test_more_than_five_extras_are_cut_and_long_names_shortened() -> None:
    six = {k: 0 for k in "ghijkl"}
    assert check(CLOSED, six) == (
        "does not match the schema at /: Additional properties are not allowed "
        "('g', 'h', 'i', 'j', 'k', ... were unexpected)"
    )
    five = {k: 0 for k in "ghijk"}
    assert check(CLOSED, five) == (
        "does not match the schema at /: Additional properties are not allowed "
        "('g', 'h', 'i', 'j', 'k' were unexpected)"
    )
    long_key = "x" * 41
    reason = check(CLOSED, {long_key: 0})
    assert reason is not None and f"{'x' * 40!r}..." in reason and long_key not in reason


def test_pattern_properties_count_as_listed_and_are_named_when_nothing_matches() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "patternProperties": {"^x_": {"type": "string"}, "^y_": {"type": "string"}},
        "additionalProperties": False,
    }
    assert check(schema, {"a": 1, "x_1": "s", "y_2": "t"}) is None
    assert check(schema, {"x_1": 5}) is not None  # the pattern's schema applies to its values
    assert check(schema, {"z": 1}) == (
        "does not match the schema at /: 'z' does not match any of the regexes: '^x_', '^y_'"
    )
    assert check(schema, {"z": 1, "w": 2}) == (
        "does not match the schema at /: 'w', 'z' do not match any of the regexes: '^x_', '^y_'"
    )


def test_an_additional_properties_schema_validates_each_extra_value() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "additionalProperties": {"type": "integer"},
    }
    assert check(schema, {"a": "s", "n": 3, "m": 4}) is None
    assert (
        check(schema, {"a": "s", "n": "three"})
        == "does not match the schema at /n: 'three' is not of type 'integer'"
    )
    assert check(schema, {"a": 5}) is not None  # a listed property keeps its own schema


def test_the_reason_names_the_path_of_the_failing_value() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object",
              "properties": {"b": {"type": "integer"}}}}}}  # fmt: skip
    assert check(schema, {"a": [{"b": 1}, {"b": "s"}]}) == (
        "does not match the schema at /a/1/b: 's' is not of type 'integer'"
    )


def test_additional_properties_apply_to_objects_only() -> None:
    schema = {"additionalProperties": False}
    for value in ([1, 2], "text", 3, None):
        assert check(schema, value) is None, value
    assert check(schema, {"k": 1}) is not None


def test_the_additional_properties_option_closes_every_object_of_the_schema() -> None:
    schema = {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {}}}}}
    assert check(schema, {"inner": {"x": 1, "y": 2}}) is None
    reason = check(schema, {"inner": {"x": 1, "y": 2}}, additional_properties=False)
    assert (
        reason is not None and reason.startswith("does not match the schema at /inner:") and "'y'" in reason
    )
    assert check(schema, {"inner": {"x": 1}}, additional_properties=False) is None


def test_pattern_is_a_search_and_uses_ascii_shorthands() -> None:
    schema = {"type": "string", "pattern": r"\d{3}"}
    assert check(schema, "ab123cd") is None  # JSON Schema `pattern` is unanchored
    assert check(schema, "ab12cd") == r"does not match the schema at /: 'ab12cd' does not match '\\d{3}'"
    assert check(schema, "٣٣٣") is not None  # Arabic-Indic digits are not \d here (ASCII, as in the grammar)
    assert check({"pattern": r"\d{3}"}, 123) is None  # pattern applies to strings only


def test_pattern_properties_match_keys_by_search() -> None:
    schema = {"type": "object", "patternProperties": {"id": {"type": "integer"}}}
    assert check(schema, {"user_id_x": 3, "other": "s"}) is None
    assert check(schema, {"user_id_x": "3"}) == (
        "does not match the schema at /user_id_x: '3' is not of type 'integer'"
    )
    assert check({"patternProperties": {"id": {"type": "integer"}}}, ["id"]) is None  # objects only


def test_schema_validators_are_cached_by_schema_and_option() -> None:
    constraint = JsonSchemaConstraint({"type": "object", "properties": {"q": {}}})
    open_one = schema_validator(constraint, StructuredOutput(constraint))
    assert schema_validator(constraint, StructuredOutput(constraint)) is open_one
    closed = schema_validator(constraint, StructuredOutput(constraint, additional_properties=False))
    assert closed is not open_one
    assert validate_json('{"q": 1, "r": 2}', open_one) is None
    assert validate_json('{"q": 1, "r": 2}', closed) is not None
    assert validate_json("{nope", open_one).startswith("not valid JSON: ")  # type: ignore[union-attr]


def test_a_schema_draft_is_honoured() -> None:
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "items": [{"type": "integer"}]}
    assert check(draft7, [1, "anything"]) is None  # draft 7: items as a list is positional
    assert check(draft7, ["x"]) is not None
    draft2020 = {"prefixItems": [{"type": "integer"}], "items": False}
    assert check(draft2020, [1]) is None and check(draft2020, [1, 2]) is not None


def test_a_regex_constraint_with_set_operations_is_accepted_and_a_schema_pattern_refused() -> None:
    from gengate import errors
    from gengate.constraints import kinds
    from gengate.constraints.syntax import regex_syntax_error

    assert regex_syntax_error("[a-z&&[^aeiou]]+") is None  # the grammar engine reads and enforces it
    schema = {"type": "object", "properties": {"w": {"type": "string", "pattern": "^[a-z&&[^aeiou]]+$"}}}
    with pytest.raises(errors.InvalidArgument) as refused:
        kinds.check_constraint_syntax(StructuredOutput(JsonSchemaConstraint(schema)))
    (violation,) = refused.value.violations
    assert violation.field == "structured_output.json_schema.schema/properties/w/pattern"
    assert "set operations" in violation.description


def test_the_regex_syntax_check_reports_re2s_reason_in_one_short_line() -> None:
    assert linear_regex_error(r"[a-z]+\d") is None
    problem = linear_regex_error("(unclosed")
    assert problem is not None and "missing )" in problem and "\n" not in problem
    lookahead = linear_regex_error("a(?=b)")
    assert lookahead is not None and len(lookahead) <= 200
    huge = linear_regex_error("(" * 5000 + "a" + ")" * 5000)
    assert huge is None or len(huge) <= 200


def test_regex_validation_is_a_full_match_with_an_llguidance_fallback() -> None:
    assert validate_regex("[0-9]+", "123") is None
    assert validate_regex("[0-9]+", "123x") == "'123x' does not fully match the pattern"
    assert validate_regex(r"\w+", "é") is not None  # ASCII \w
    # A class set operation is Rust-regex syntax (the grammar engine's): RE2 would read it as literal
    # characters, so llguidance's own walk validates it and agrees with what it enforced.
    consonants = "[a-z&&[^aeiou]]+"
    assert validate_regex(consonants, "bcd") is None
    assert validate_regex(consonants, "bad") == "'bad' does not fully match the pattern"
    assert (
        validate_regex("[a-z--[b-y]]+", "aza") is None and validate_regex("[a-z--[b-y]]+", "abc") is not None
    )
    assert validate_regex("(?<=a)b", "b") is not None  # neither reads it: nothing validates


def test_grammars_validate_through_lark_or_llguidance() -> None:
    lark_grammar = GrammarConstraint(GrammarSyntax.LARK, 'start: "(" NUM ")"\nNUM: /[0-9]+/\n')
    assert validate_output(StructuredOutput(lark_grammar), "(12)") is None
    reason = validate_output(StructuredOutput(lark_grammar), "(x)")
    assert reason is not None and reason.startswith("does not match the grammar: ")
    gbnf = GrammarConstraint(GrammarSyntax.GBNF, 'root ::= "yes" | "no"\n')
    assert validate_output(StructuredOutput(gbnf), "yes") is None
    assert validate_output(StructuredOutput(gbnf), "maybe") == "does not match the grammar"
    extension = GrammarConstraint(GrammarSyntax.LARK, 'start: "n=" %json {"type": "integer"}\n')
    assert validate_output(StructuredOutput(extension), "n=42") is None  # lark cannot read it: llguidance
    assert validate_output(StructuredOutput(extension), "n=x") == "does not match the grammar"


def test_long_reasons_are_cut() -> None:
    reason = validate_output(StructuredOutput(RegexConstraint("a")), "b" * 500)
    assert reason == f"{short('b' * 500)} does not fully match the pattern"
    assert short("x" * 81) == repr("x" * 80) + "..." and short("x" * 80) == repr("x" * 80)
    names = [f"TERMINAL_WITH_A_LONG_NAME_{i}" for i in range(40)]
    definition = "start: " + " | ".join(names) + "\n" + "".join(f'{n}: "t{i}"\n' for i, n in enumerate(names))
    many = GrammarConstraint(GrammarSyntax.LARK, definition)
    cut = validate_output(StructuredOutput(many), "b")
    assert cut is not None and len(cut) == 300 and cut.endswith("...")


def test_choice_grammar_accepts_exactly_the_choices() -> None:
    from gengate.constraints.validation import _llguidance_accepts

    grammar = choice_grammar(("red", "green"))
    assert _llguidance_accepts(grammar, "red") and _llguidance_accepts(grammar, "green")
    assert not _llguidance_accepts(grammar, "re") and not _llguidance_accepts(grammar, "redd")


@pytest.mark.parametrize("text", ["", "a", "ab"])
def test_an_erroring_grammar_accepts_nothing(text: str) -> None:
    from gengate.constraints.validation import _llguidance_accepts

    assert not _llguidance_accepts("not a grammar at all {", text)
