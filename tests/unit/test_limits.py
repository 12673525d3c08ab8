"""Request limits (gengate.limits): regex and grammar shapes, JSON shapes, UTF-8 sizes, violations."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from gengate.checks import prepare, request_violations
from gengate.domain import (
    ChatMessage,
    ChoiceConstraint,
    ConstraintKind,
    Enforcement,
    GenerationRequest,
    GrammarConstraint,
    GrammarSyntax,
    JsonSchemaConstraint,
    ModelCapabilities,
    RegexConstraint,
    Role,
    StoppingCriteria,
    StructuredOutput,
    TextPart,
)
from gengate.errors import InvalidArgument, Unimplemented
from gengate.limits import (
    LIMIT_REASON,
    RequestLimits,
    grammar_parts,
    grammar_rule_count,
    json_depth,
    json_shape,
    regex_shape,
    text_bytes,
)
from hypothesis import given, settings
from hypothesis import strategies as st

CAP = 100_001
DEFAULTS = RequestLimits()
_OVER = re.compile(r" is (?:at least )?(\d+), over the limit of (\d+) \(server\.limits\.(\w+)\)$")


def _shape(pattern: str) -> tuple[int, int]:
    shape = regex_shape(pattern, cap=CAP)
    return shape.depth, shape.expansion


def _constrained(constraint: Any, **fields: Any) -> GenerationRequest:
    return GenerationRequest(model="m", structured_output=StructuredOutput(constraint), **fields)


def _schema(schema: dict[str, Any]) -> GenerationRequest:
    return _constrained(JsonSchemaConstraint(schema))


def _messages(*texts: str) -> tuple[ChatMessage, ...]:
    return tuple(ChatMessage(Role.USER, (TextPart(t),)) for t in texts)


# fmt: off
REGEX_SHAPES: list[tuple[str, int, int]] = [
    ("a{1000}", 0, 1000), ("(a{100}){100}", 1, 10_000), ("((a{1000}){1000}){1000}", 2, CAP),
    ("(?:x{400}){400}", 1, CAP), ("a{2,5}", 0, 5), ("a{3,}", 0, 3), ("a{0}", 0, 0), ("ab{0}c", 0, 2),
    ("a|bb", 0, 3), ("[a-z]{10}", 0, 10), (r"[[:alpha:]\]]{10}", 0, 10), ("[]a]{10}", 0, 10),
    ("[^]]{10}", 0, 10), ("[a[bc]]{7}", 0, 8), (r"\d{3}", 0, 3), (r"\p{L}{10}", 0, 10), (r"\x{41}{2}", 0, 2),
    ("(?P<n>ab){10}", 1, 20), ("(?i)ab", 0, 2), ("(?i)(?s)", 0, 0), ("a{b", 0, 3), ("a{,5}", 0, 5),
    ("ab*c+d?", 0, 4), ("ab|{5}", 0, 2), ("(" * 65 + ")" * 65, 65, 1), ("(((a", 3, 1), (")))a{4}", 0, 4),
]
# fmt: on


@pytest.mark.parametrize(("pattern", "depth", "expansion"), REGEX_SHAPES)
def test_regex_shape(pattern: str, depth: int, expansion: int) -> None:
    assert _shape(pattern) == (depth, expansion)


@pytest.mark.parametrize(
    "pattern",
    # a `[` inside a class, a lookbehind before a later `>`: once read as a nested class or a group
    # name running to the `>`, they hid the bomb after them from the measure
    ["[a[]((a{1000}){1000}){1000}", "(?<=x)((a{1000}){1000}){1000}>"],
)
def test_nothing_before_a_bomb_hides_it_from_the_measure(pattern: str) -> None:
    assert regex_shape(pattern, cap=10**7).expansion == 10**7


def test_regex_shape_saturates_at_the_cap() -> None:
    assert regex_shape("(a{1000}){1000}", cap=50).expansion == 50
    assert regex_shape("a" * 10_000, cap=50).expansion == 50


@given(st.integers(1, 500), st.integers(1, 500), st.integers(1, 500))
@settings(max_examples=100, deadline=None)
def test_regex_shape_multiplies_nested_counts(inner: int, outer: int, low: int) -> None:
    assert _shape(f"(a{{{inner}}}){{{outer}}}") == (1, min(inner * outer, CAP))
    assert _shape(f"(?:[0-9]{{{low},{inner}}}){{{outer}}}") == (1, min(max(low, inner) * outer, CAP))


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_regex_shape_never_raises(pattern: str) -> None:
    shape = regex_shape(pattern, cap=1000)
    assert 0 <= shape.expansion <= 1000
    assert 0 <= shape.depth <= pattern.count("(")


def test_grammar_parts_replaces_terminals_and_drops_comments() -> None:
    body, regexes = grammar_parts('start: "ab{9}c" /[0-9]{4}/ item // x{1000}\nitem: \'q\' "x"~3..2000\n')
    assert body == "start: x x item \nitem: x x{3,2000}\n"
    assert regexes == ["[0-9]{4}"]
    assert grammar_parts('a: "x" ~ 5')[0] == "a: x {5}"
    assert grammar_parts(r'a: /a\/b/ "q\"{9}"') == ("a: x x", [r"a\/b"])


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_grammar_parts_never_raises(definition: str) -> None:
    body, regexes = grammar_parts(definition)
    assert isinstance(body, str) and all(isinstance(r, str) for r in regexes)


def test_grammar_rule_count() -> None:
    lark = 'start: a b\n?a: "x"\n!b: c\n  | "y"\nNAME.2: "n"\nlist{x}: x ("," x)*\n%import common.WS\n'
    assert grammar_rule_count(lark) == 5
    assert grammar_rule_count('root ::= item+\nitem ::= [a-z] | "x"\n# comment: no\n') == 2
    assert grammar_rule_count("") == 0


REALISTIC_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 64},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "$defs": {"node": {"type": "object", "properties": {"kids": {"items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node",
    },
    {"type": "string", "enum": ["red", "green", "blue", "cyan", "magenta"], "description": "A colour." * 20},
    {"anyOf": [{"type": "null"}, {"type": "boolean", "default": True}, {"type": "number", "minimum": 0.5}]},
]


@pytest.mark.parametrize("schema", REALISTIC_SCHEMAS)
def test_json_shape_size_is_close_to_compact_json(schema: dict[str, Any]) -> None:
    compact = len(json.dumps(schema, separators=(",", ":")))
    assert 0.5 * compact <= json_shape(schema).size <= 2 * compact


def test_json_shape_depth_and_refs() -> None:
    assert json_shape(REALISTIC_SCHEMAS[0]).depth == 4
    assert (json_shape(REALISTIC_SCHEMAS[1]).depth, json_shape(REALISTIC_SCHEMAS[1]).refs) == (6, 2)
    assert json_depth("scalar") == 0 and json_depth([]) == 1 and json_depth({"a": [{}]}) == 3
    assert json_shape({"$ref": "#", "x": [{"$ref": "#"}, "$ref"]}).refs == 2


def test_json_shape_stops_early() -> None:
    value = {"items": [{"type": "string", "pattern": "x" * 50} for _ in range(10_000)]}
    assert json_shape(value).size > 800_000
    assert 20_000 < json_shape(value, stop_at_bytes=20_000).size < 20_200  # one node past the bound


def test_json_shape_flags_what_is_not_json() -> None:
    assert json_shape({"const": 10**5000}).unreadable
    assert json_shape({"const": {1, 2}}).unreadable
    assert not json_shape({"const": 10**300, "x": [1.5, None, True]}).unreadable
    over = request_violations(_schema({"const": 10**5000}), DEFAULTS)
    assert [v.field for v in over] == ["structured_output.json_schema.schema"]
    assert "not JSON" in over[0].description


def test_json_shape_of_a_very_deep_value_has_no_recursion() -> None:
    value: list[Any] = []
    for _ in range(100_000):
        value = [value]
    assert json_shape(value).depth == 100_001
    over = request_violations(_schema({"items": value}), DEFAULTS)
    assert len(over) == 1 and "server.limits.max_schema_depth" in over[0].description


# ASCII; é is 2 bytes and 😀 4: measured exactly where the length alone cannot tell
TEXT_SIZES: list[tuple[str, int, int]] = [
    ("abc", 3, 3), ("abcd", 3, 4), ("é" * 3, 5, 6), ("é" * 2, 5, 4), ("😀" * 2, 7, 8), ("😀" * 3, 11, 12),
    ("a😀", 5, 5),
]  # fmt: skip


@pytest.mark.parametrize(("text", "limit", "expected"), TEXT_SIZES)
def test_text_bytes_at_the_limit(text: str, limit: int, expected: int) -> None:
    assert text_bytes(text, limit) == expected


@given(st.text(), st.integers(1, 64))
@settings(max_examples=200, deadline=None)
def test_text_bytes_tells_over_from_under(text: str, limit: int) -> None:
    assert (text_bytes(text, limit) > limit) == (len(text.encode("utf-8")) > limit)


_SCHEMA_REFS = {"$defs": {"a": {}}, "allOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/a"}]}
_LARK = GrammarSyntax.LARK
_GRAMMAR = "structured_output.grammar.definition"
_SCHEMA = "structured_output.json_schema.schema"
_REGEX = "structured_output.regex.pattern"
_CHOICES = "structured_output.choice.choices"


def _req(**fields: Any) -> GenerationRequest:
    return GenerationRequest(model="m", **fields)


def _lark(definition: str) -> GenerationRequest:
    return _constrained(GrammarConstraint(_LARK, definition))


VIOLATIONS: list[tuple[dict[str, int], GenerationRequest, str, int | None]] = [
    ({"max_prompt_bytes": 10}, _req(prompt="x" * 11), "prompt", 11),
    ({"max_prompt_bytes": 10}, _req(messages=_messages("é" * 3, "x" * 5)), "messages", 11),
    ({"max_messages": 2}, _req(messages=_messages("a", "b", "c")), "messages.messages", 3),
    ({"max_stop_sequences": 2}, _req(stopping=StoppingCriteria(stop=("a", "b", "c"))), "stopping.stop", 3),
    ({"max_stop_bytes": 4}, _req(stopping=StoppingCriteria(stop=("ok", "é" * 3))), "stopping.stop[1]", 6),
    ({"max_constraint_bytes": 5}, _constrained(RegexConstraint("abcdef")), _REGEX, 6),
    # 6 characters: over 5 by length alone, so reported as "at least 6" (7 bytes encoded)
    ({"max_constraint_bytes": 5}, _constrained(ChoiceConstraint(("abc", "déf"))), _CHOICES, 6),
    ({"max_constraint_bytes": 10}, _lark('start: "abcdefgh"'), _GRAMMAR, 17),
    ({"max_constraint_bytes": 20}, _schema({"description": "x" * 50}), _SCHEMA, None),
    ({"max_schema_depth": 3}, _schema({"a": {"b": {"c": {}}}}), _SCHEMA, 4),
    ({"max_schema_refs": 1}, _schema(_SCHEMA_REFS), _SCHEMA, 2),
    ({"max_grammar_rules": 2}, _lark('start: a\na: b\nb: "x"\n'), _GRAMMAR, 3),
    ({"max_choices": 2}, _constrained(ChoiceConstraint(("a", "b", "c"))), _CHOICES, 3),
    ({"max_regex_depth": 2}, _constrained(RegexConstraint("((()))")), _REGEX, 3),
    ({"max_regex_expansion": 50}, _constrained(RegexConstraint("a{51}")), _REGEX, 51),
    ({"max_regex_expansion": 50}, _lark('start: "a"~51'), _GRAMMAR, 51),
    ({"max_regex_expansion": 50}, _lark("start: /b{60}/"), _GRAMMAR, 60),
]


@pytest.mark.parametrize(("limits", "request_", "field", "value"), VIOLATIONS)
def test_each_limit_names_itself_and_the_value(
    limits: dict[str, int], request_: GenerationRequest, field: str, value: int | None
) -> None:
    ((name, limit),) = limits.items()
    over = request_violations(request_, RequestLimits(**limits))
    assert [v.field for v in over] == [field]
    found = _OVER.search(over[0].description)
    assert found is not None, over[0].description
    assert (int(found[2]), found[3]) == (limit, name)
    assert int(found[1]) > limit and (value is None or int(found[1]) == value)
    assert request_violations(request_, DEFAULTS) == []  # the same request is fine under the defaults
    prefixed = request_violations(request_, RequestLimits(**limits), "requests[3].")
    assert [(v.field, v.description) for v in prefixed] == [("requests[3]." + field, over[0].description)]


def test_a_request_within_every_limit_has_no_violations() -> None:
    schema = {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[a-z]{2,8}$"}},
        "patternProperties": {"^x-[a-z]+$": {"type": "string"}},
    }
    stopping = StoppingCriteria(max_tokens=64, stop=("\n\n", "END"))
    for structured in (
        JsonSchemaConstraint(schema),
        RegexConstraint(r"\d{3}-\d{4}"),
        ChoiceConstraint(("yes", "no")),
        GrammarConstraint(_LARK, 'start: item+\nitem: /[a-z]{1,20}/ | "x"~1..9\n'),
        GrammarConstraint(GrammarSyntax.GBNF, 'root ::= [a-z]{1,20} "!"\n'),
    ):
        request = _constrained(structured, messages=_messages("Hi", "😀 there"), stopping=stopping)
        assert request_violations(request, DEFAULTS) == []
    assert request_violations(_req(prompt="p" * 1000), DEFAULTS, "request.") == []


def test_schema_regexes_are_held_to_the_regex_limits_with_their_paths() -> None:
    where = _SCHEMA
    schema = {"properties": {"a": {"items": [{"pattern": "(a{1000}){1000}"}]}}}
    over = request_violations(_schema(schema), DEFAULTS)
    assert [v.field for v in over] == [f"{where}/properties/a/items/0/pattern"]
    assert "max_regex_expansion" in over[0].description and "is 100001" in over[0].description
    deep: dict[str, Any] = {"patternProperties": {"(" * 70 + ")" * 70: {}}}
    over = request_violations(_schema(deep), DEFAULTS)
    assert [v.field for v in over] == [f"{where}/patternProperties"]
    assert "is 70, over the limit of 64 (server.limits.max_regex_depth)" in over[0].description


def test_a_regex_terminal_bomb_in_a_grammar_is_over_the_expansion_limit() -> None:
    grammar = GrammarConstraint(_LARK, "start: /((a{1000}){1000}){1000}/\n")
    over = request_violations(_constrained(grammar), DEFAULTS)
    assert [v.field for v in over] == ["structured_output.grammar.definition"]
    assert "is 100001, over the limit of 100000 (server.limits.max_regex_expansion)" in over[0].description
    rules = GrammarConstraint(_LARK, "".join(f"r{i}: r{i + 1}\n" for i in range(1001)))
    assert "max_grammar_rules" in request_violations(_constrained(rules), DEFAULTS)[0].description


def test_prepare_refuses_a_request_over_a_limit_before_capabilities() -> None:
    request = _constrained(RegexConstraint("a+"), prompt="x" * 9)
    caps = ModelCapabilities()  # declares no constraint kind at all
    with pytest.raises(InvalidArgument) as raised:
        prepare(request, caps, limits=RequestLimits(max_prompt_bytes=8))
    assert raised.value.reason == LIMIT_REASON
    assert [v.field for v in raised.value.violations] == ["prompt"]
    assert "server.limits.max_prompt_bytes" in raised.value.message
    with pytest.raises(Unimplemented):  # within the limits, the capability check answers
        prepare(request, caps, limits=RequestLimits(max_prompt_bytes=9))
    ok = ModelCapabilities(constraints={ConstraintKind.REGEX: Enforcement.ENGINE})
    assert prepare(request, ok, limits=RequestLimits(max_prompt_bytes=9)).stopping.max_tokens == 256


# ---- bugs found in limits.py by review, and fixed -------------------------------------------


def test_summed_text_is_measured_in_utf8_bytes() -> None:
    limits = RequestLimits(max_prompt_bytes=100, max_constraint_bytes=100)
    emoji = "😀" * 25  # 100 bytes each
    assert request_violations(_req(messages=_messages(*[emoji] * 4)), limits)
    assert request_violations(_constrained(ChoiceConstraint((emoji,) * 4)), limits)


def test_the_reported_size_is_in_bytes() -> None:
    over = request_violations(_req(prompt="é" * 101), RequestLimits(max_prompt_bytes=100))
    assert "size in bytes is at least 101," in over[0].description  # not encoded: length is a lower bound
    exact = request_violations(_req(prompt="é" * 60), RequestLimits(max_prompt_bytes=100))
    assert "size in bytes is 120," in exact[0].description


def test_a_bomb_inside_a_lark_optional_is_over_the_limit() -> None:
    grammar = GrammarConstraint(_LARK, 'start: [("a"~1000)~1000]\n')
    assert request_violations(_constrained(grammar), DEFAULTS)


def test_a_bomb_after_a_gbnf_class_holding_a_quote_is_over_the_limit() -> None:
    grammar = GrammarConstraint(GrammarSyntax.GBNF, 'root ::= [^"] ("a"{1000} "b"){1000}\n')
    assert request_violations(_constrained(grammar), DEFAULTS)


def test_schema_regex_paths_are_escaped_json_pointers() -> None:
    schema = {"properties": {"a/b~c": {"pattern": "(a{1000}){1000}"}}}
    over = request_violations(_schema(schema), DEFAULTS)
    assert [v.field for v in over] == ["structured_output.json_schema.schema/properties/a~1b~0c/pattern"]


def test_data_named_pattern_is_not_a_regex() -> None:
    schema = {"const": {"pattern": "(a{1000}){1000}"}, "examples": [{"pattern": "(" * 70}]}
    assert request_violations(_schema(schema), DEFAULTS) == []


def test_constraint_weight_grows_with_what_the_grammar_engine_builds() -> None:
    from gengate.constraints.kinds import constraint_weight

    assert constraint_weight(RegexConstraint("a{99999}")) == 99_999
    assert constraint_weight(RegexConstraint("[0-9]{3}")) == 3
    assert constraint_weight(ChoiceConstraint(("yes", "no"))) == 1
    lark = GrammarConstraint(_LARK, 'start: /x{5000}/ "y"{10}')
    assert constraint_weight(lark) >= 5000
    assert constraint_weight(JsonSchemaConstraint({"type": "string", "pattern": "z{2000}"})) >= 2000


def test_a_weighted_lru_evicts_by_weight_and_keeps_the_newest() -> None:
    from gengate.lru import LruCache

    cache: LruCache[str, int] = LruCache(100, max_weight=10)
    cache.put("a", 1, weight=6)
    cache.put("b", 2, weight=3)
    cache.put("c", 3, weight=4)  # 13 > 10: "a" goes
    assert cache.get("a") is None and cache.get("b") == 2 and cache.weight == 7
    cache.put("huge", 4, weight=50)  # alone over the bound: kept, everything older goes
    assert len(cache) == 1 and cache.get("huge") == 4
