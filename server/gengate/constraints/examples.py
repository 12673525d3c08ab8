"""One example of each constraint kind, for checking an engine end to end.

Every example but the JSON object is a bounded language, so a generation of 60 tokens always
finishes inside it. Used by the transformers tests and by the GPU check script
(bench/gpu/check_transformers.py), which runs where the tests are not installed.
"""

from __future__ import annotations

from gengate.domain import (
    ChoiceConstraint,
    Constraint,
    GrammarConstraint,
    GrammarSyntax,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)

EXAMPLE_CONSTRAINTS: dict[str, Constraint] = {
    "json_schema": JsonSchemaConstraint(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        }
    ),
    "regex": RegexConstraint(r"[a-z]{2,6}@example\.(com|org)"),
    "choice": ChoiceConstraint(("red", "green", "blue")),
    "lark": GrammarConstraint(GrammarSyntax.LARK, 'start: ("yes" | "no") " " NUM\nNUM: /[0-9]{1,3}/'),
    "gbnf": GrammarConstraint(GrammarSyntax.GBNF, 'root ::= ("cat" | "dog") " " [0-9] [0-9]?'),
    "json_object": JsonObjectConstraint(),
}
