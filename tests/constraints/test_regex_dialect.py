"""`\\d` and `\\w` mean ASCII everywhere, so every client language agrees with the server."""

from __future__ import annotations

import pytest
from gengate.constraints import validate_output
from gengate.constraints.regex_dialect import ascii_shorthands
from gengate.domain import RegexConstraint, StructuredOutput


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
        (r"[\d.]+", "[0-9.]+"),
        (r"\\d", r"\\d"),
        (r"[^\]\w]", r"[^\]0-9A-Za-z_]"),
        (r"\p{L}+\W", r"\p{L}+[^0-9A-Za-z_]"),
        (r"\[\d\]", r"\[[0-9]\]"),
        (r"[]\d]", "[]0-9]"),
    ],
)
def test_rewrite(pattern: str, expected: str) -> None:
    assert ascii_shorthands(pattern) == expected


def test_validation_rejects_non_ascii_digits() -> None:
    structured = StructuredOutput(RegexConstraint(r"\d{4}"))
    assert validate_output(structured, "2024") is None
    assert validate_output(structured, "202９") is not None
