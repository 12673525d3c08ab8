"""validate_output: each constraint kind, against the original constraint."""

from __future__ import annotations

from typing import Any

import pytest
from gengate.constraints import validate_output
from gengate.domain import (
    ChoiceConstraint,
    GrammarConstraint,
    GrammarSyntax,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuredOutput,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "uniqueItems": True},
    },
    "required": ["name", "age"],
}
GBNF = 'root ::= "yes" | "no" | num\nnum ::= [0-9]+ ("." [0-9]+)?\n'
LARK = 'start: "(" item ("," item)* ")"\nitem: NUM | start\nNUM: /[0-9]+/\n'
LARK_LLG = 'start: "x" %json {"type": "integer"}\n'


def check(constraint: Any, text: str, **options: Any) -> str | None:
    return validate_output(StructuredOutput(constraint, **options), text)


@pytest.mark.parametrize(
    ("constraint", "good", "bad", "why"),
    [
        (JsonSchemaConstraint(PERSON), '{"name":"a","age":3}', '{"name":"a","age":501}', "/age"),
        (
            JsonSchemaConstraint(PERSON),
            '{"name":"a","age":3,"tags":[1,2]}',
            '{"name":"a","age":3,"tags":[1,1]}',
            "/tags",
        ),
        (
            JsonSchemaConstraint(PERSON),
            '{"name":"a","age":3,"email":"a@b.c"}',
            '{"name":"a","age":3,"email":"nope"}',
            "email",
        ),
        (JsonSchemaConstraint(PERSON), '{"name":"a","age":3}', '{"name":"a","age":3', "not valid JSON"),
        (
            JsonSchemaConstraint({"oneOf": [{"type": "number"}, {"type": "integer"}]}),
            "1.5",
            "1",
            "valid under each",
        ),
        (JsonObjectConstraint(), '{"x": [1]}', "[1]", "object"),
        (RegexConstraint(r"\d{3}-[a-z]+"), "123-abc", "123-abc\n", "fully match"),
        (RegexConstraint(r"\p{Lu}[[:alpha:]]*"), "Ünicode", "Ünïcode", "fully match"),  # ASCII [[:alpha:]]
        (ChoiceConstraint(("yes", "no")), "no", "maybe", "not one of"),
        (GrammarConstraint(GrammarSyntax.LARK, LARK), "(1,(2,3))", "(1,(2,3)", "grammar"),
        (GrammarConstraint(GrammarSyntax.LARK, LARK_LLG), "x12", "x1.5", "grammar"),
        (GrammarConstraint(GrammarSyntax.GBNF, GBNF), "3.14", "3.", "grammar"),
        (GrammarConstraint(GrammarSyntax.EBNF, GBNF), "yes", "yess", "grammar"),
    ],
)
def test_good_passes_and_bad_is_explained(constraint: Any, good: str, bad: str, why: str) -> None:
    assert check(constraint, good) is None
    reason = check(constraint, bad)
    assert reason is not None and why in reason


def test_additional_properties_option_is_part_of_the_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert check(JsonSchemaConstraint(schema), '{"a":1,"b":2}') is None
    assert check(JsonSchemaConstraint(schema), '{"a":1,"b":2}', additional_properties=False) is not None


def test_rust_only_regex_falls_back_to_llguidance() -> None:
    # A class intersection is Rust regex syntax (llguidance's); RE2 reads the text otherwise.
    constraint = RegexConstraint(r"[a-c&&[^b]]+")
    assert check(constraint, "aca") is None
    assert check(constraint, "abc") is not None


def test_impossible_dates_are_caught_after_generation() -> None:
    constraint = JsonSchemaConstraint({"type": "string", "format": "date"})
    assert check(constraint, '"2024-02-29"') is None
    assert check(constraint, '"2023-02-29"') is not None
