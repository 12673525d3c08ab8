"""The hostile-input corpus: requests an attacker would send, each with the status it must get.

Every class the server was once hurt by is here (grammar and regex bombs, backtracking
validation, metaschema checks of huge schemas, echo of unbounded input, malformed bytes, limits
that did not hold), plus their neighbours. Used by tests/hostile/test_corpus.py and by
bench/hostile.py (which also reports the worst health-check latency while the corpus runs).

Models the corpus expects on the server (see SERVER_CONFIG): `tiny` (llama.cpp, in its worker
process, constraints enforced by the engine) and `validated` (answers a fixed text and claims
VALIDATED enforcement of every kind, so the service's own validation is what holds).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from corpus_tools import TOOL_CASES, TOOL_MODELS
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import types_pb2 as t
from google.protobuf import struct_pb2

INVALID = grpc.StatusCode.INVALID_ARGUMENT
OK = grpc.StatusCode.OK
LIMIT = "LIMIT_EXCEEDED"
# The text `validated` answers: 27 a's then "!" (the backtracking probe's worst case).
VALIDATED_TEXT = "a" * 27 + "!"
# What `deep` answers: a JSON object nested 50,000 deep (past any recursive validator).
DEEP_TEXT = '{"a":' * 50_000 + "1" + "}" * 50_000

SERVER_CONFIG: dict[str, Any] = {
    "models": [
        {"name": "tiny", "backend": "llamacpp", "tiny": True},
        {
            "name": "validated",
            "backend": "scripted",
            "text": VALIDATED_TEXT,
            "raw_prompt": True,  # takes Magpie, without the chat continuation a custom template needs
            "constraints": {
                "json_schema": "validated",
                "json_object": "validated",
                "regex": "validated",
                "choice": "validated",
                "grammar": "validated",
            },
        },
        {
            "name": "deep",
            "backend": "scripted",
            "text": DEEP_TEXT,
            "constraints": {"json_object": "engine", "json_schema": "native"},
            "tools_enforcement": None,  # takes no tools
        },
        *TOOL_MODELS,
    ]
}


@dataclass(frozen=True)
class Case:
    """One hostile request: `rpc` is generate, stream, batch, or raw:<method> (bytes as sent)."""

    name: str
    request: Callable[[], Any]
    code: grpc.StatusCode
    reason: str | None = None
    field: str | None = None  # a BadRequest field path that must be named
    rpc: str = "generate"
    # For batch cases: per-item codes expected in the stream (index -> code); the RPC itself is OK.
    items: dict[int, grpc.StatusCode] = dataclasses.field(default_factory=dict)


def _literals(count: int) -> str:
    """A Lark grammar of `count` literals in a row: one forced run of as many lexemes."""
    return "start: " + '"a " ' * count


def _tokens(request: g.GenerateRequest, max_tokens: int) -> g.GenerateRequest:
    request.stopping.max_tokens = max_tokens
    return request


def req(model: str = "tiny", prompt: str = "Answer:", **kw: Any) -> g.GenerateRequest:
    kw.setdefault("stopping", t.StoppingCriteria(max_tokens=8))
    return g.GenerateRequest(model=model, prompt=prompt, **kw)


def regex(pattern: str, model: str = "tiny") -> g.GenerateRequest:
    return req(model, structured_output=t.StructuredOutput(regex=t.Regex(pattern=pattern)))


def lark(definition: str, model: str = "tiny", syntax: int = t.GRAMMAR_SYNTAX_LARK) -> g.GenerateRequest:
    grammar = t.Grammar(syntax=syntax, definition=definition)  # type: ignore[arg-type]
    return req(model, structured_output=t.StructuredOutput(grammar=grammar))


def schema_json(text: str, model: str = "tiny") -> g.GenerateRequest:
    return req(model, structured_output=t.StructuredOutput(json_schema=t.JsonSchema(schema_json=text)))


def schema(value: Any, model: str = "tiny") -> g.GenerateRequest:
    return schema_json(json.dumps(value), model)


def choices(values: list[str], model: str = "tiny") -> g.GenerateRequest:
    return req(model, structured_output=t.StructuredOutput(choice=t.Choice(choices=values)))


def chain_lark(rules: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(rules)) + f'r{rules}: "x"\n'


def chain_gbnf(rules: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(rules)) + f'r{rules} ::= "x"\n'


def nested(depth: int) -> Any:
    value: Any = {"type": "string"}
    for _ in range(depth):
        value = {"type": "array", "items": value}
    return value


def ref_chain(length: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length)}
    defs[f"d{length}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def big_schema(kib: int) -> dict[str, Any]:
    props = {f"p{i:06d}": {"type": "string", "description": "x" * 40} for i in range(kib * 1024 // 64)}
    return {"type": "object", "properties": props}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def deep_struct_bytes(depth: int) -> bytes:
    """A GenerateRequest whose schema Struct nests `depth` levels, past protobuf's recursion limit
    (encoded by hand: the protobuf library itself refuses to build it)."""
    struct = b""
    for _ in range(depth):
        value = _len_field(5, struct)  # Value.struct_value
        struct = _len_field(1, _len_field(1, b"x") + _len_field(2, value))  # Struct.fields entry
    number = g.GenerateRequest.DESCRIPTOR.fields_by_name["structured_output"].number
    so = t.StructuredOutput.DESCRIPTOR.fields_by_name["json_schema"].number
    js = t.JsonSchema.DESCRIPTOR.fields_by_name["schema"].number
    tail = _len_field(number, _len_field(so, _len_field(js, struct)))
    return req().SerializeToString() + tail  # type: ignore[no-any-return]


def with_field(message: g.GenerateRequest, setter: Callable[[g.GenerateRequest], None]) -> g.GenerateRequest:
    setter(message)
    return message


def _options(**kw: Any) -> t.StructuredOutput:
    return t.StructuredOutput(json_object=t.JsonObject(), options=t.StructuredOutputOptions(**kw))


def _invalid_utf8_request() -> bytes:
    good = req(prompt="PLACEHOLDER").SerializeToString()
    return good.replace(b"PLACEHOLDER", b"\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8\xf7\xf6\xf5")


def _stream(inner: g.GenerateRequest) -> g.GenerateStreamRequest:
    return g.GenerateStreamRequest(request=inner)


def _batch(*items: g.GenerateRequest) -> g.BatchGenerateRequest:
    return g.BatchGenerateRequest(requests=list(items))


GRAMMAR_FIELD = "structured_output.grammar.definition"
REGEX_FIELD = "structured_output.regex.pattern"
SCHEMA_FIELD = "structured_output.json_schema.schema"
CHOICES_FIELD = "structured_output.choice.choices"
SCHEMA_JSON_FIELD = "structured_output.json_schema.schema_json"


def _struct(value: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(value)
    return struct


CASES: list[Case] = [
    # ---- grammar bombs: chains of rules overflow the grammar engine's stack ----------------------
    Case("lark chain 1,001 rules", lambda: lark(chain_lark(1001)), INVALID, LIMIT, GRAMMAR_FIELD),
    Case("lark chain 3,000 rules", lambda: lark(chain_lark(3000)), INVALID, LIMIT, GRAMMAR_FIELD),
    Case(
        "lark chain 5,000 rules (was SIGSEGV)", lambda: lark(chain_lark(5000)), INVALID, LIMIT, GRAMMAR_FIELD
    ),
    Case("lark chain 20,000 rules", lambda: lark(chain_lark(20000)), INVALID, LIMIT, GRAMMAR_FIELD),
    # a rule that never ends: the grammar is accepted, then nothing can follow its first "a"
    # (found by the fuzzer: was INTERNAL "constraint matcher error: NoExtensionBias")
    Case(
        "lark rule that never ends",
        lambda: lark('start: r0\nr0: "a" r2\nr2: r2\n'),
        INVALID,
        "CONSTRAINT_UNSATISFIABLE",
    ),
    Case(
        "gbnf chain 5,000 rules",
        lambda: lark(chain_gbnf(5000), syntax=t.GRAMMAR_SYNTAX_GBNF),
        INVALID,
        LIMIT,
        GRAMMAR_FIELD,
    ),
    Case(
        "ebnf chain 5,000 rules",
        lambda: lark(chain_gbnf(5000), syntax=t.GRAMMAR_SYNTAX_EBNF),
        INVALID,
        LIMIT,
        GRAMMAR_FIELD,
    ),
    Case("lark start: start", lambda: lark("start: start\n"), INVALID, None, GRAMMAR_FIELD),
    Case("lark a: a b (left recursion, no base)", lambda: lark('start: a\na: a b\nb: "x"\n'), INVALID),
    Case("lark undefined rule", lambda: lark("start: nowhere\n"), INVALID, None, GRAMMAR_FIELD),
    Case("lark 1,000 nested parens", lambda: lark("start: " + "(" * 1000 + '"x"' + ")" * 1000), INVALID),
    Case("lark unbalanced parens", lambda: lark('start: ("x"'), INVALID, None, GRAMMAR_FIELD),
    Case("lark empty", lambda: lark(""), INVALID, None, GRAMMAR_FIELD),
    Case("lark whitespace only", lambda: lark("   \n\t"), INVALID, None, GRAMMAR_FIELD),
    Case("lark binary junk", lambda: lark("\x00\x01\x02 start ::: ::"), INVALID, None, GRAMMAR_FIELD),
    Case("lark 600 KB", lambda: lark('start: "' + "x" * 600_000 + '"'), INVALID, LIMIT, GRAMMAR_FIELD),
    # A forced literal near the size limit: every mask in a forced state tokenized what remained of
    # it (~80 ms a token at 400 KB); the run is now tokenized once (ConstraintMatcher.plan_forced_run).
    Case("lark 400 KB literal, 300 tokens", lambda: _tokens(lark(f'start: "{"ab " * 133_000}"'), 300), OK),
    Case("json const 400 KB, 300 tokens", lambda: _tokens(schema({"const": "xyz " * 100_000}), 300), OK),
    # Many lexemes in one forced run: llguidance's consume walks what is still ahead (~0.2 ms a
    # token at 30,000). More than max_regex_expansion counts are refused before llguidance, whose
    # compile asserts past ~65,000 symbols (u16 ids).
    Case("lark 30,000 literals in a row, 300 tokens", lambda: _tokens(lark(_literals(30_000)), 300), OK),
    Case("lark 80,000 literals in a row", lambda: lark(_literals(80_000)), INVALID, LIMIT, GRAMMAR_FIELD),
    Case("lark regex terminal bomb", lambda: lark("start: /((a{1000}){1000}){1000}/"), INVALID),
    Case(
        "lark 1,000 alternatives x 1,000 rules",
        lambda: lark(
            "start: "
            + " | ".join(f"r{i}" for i in range(1000))
            + "\n"
            + "".join(f'r{i}: "{i}" r{(i + 1) % 1000}?\n' for i in range(1000))
        ),
        INVALID,
        LIMIT,
        GRAMMAR_FIELD,
    ),
    Case("gbnf garbage", lambda: lark("root ::= ((( [ \\", syntax=t.GRAMMAR_SYNTAX_GBNF), INVALID),
    Case("gbnf undefined rule", lambda: lark("root ::= missing", syntax=t.GRAMMAR_SYNTAX_GBNF), INVALID),
    Case(
        "grammar syntax enum 99",
        lambda: lark('start: "x"', syntax=99),
        INVALID,
        None,
        "structured_output.grammar.syntax",
    ),
    Case(
        "grammar syntax unspecified",
        lambda: lark('start: "x"', syntax=t.GRAMMAR_SYNTAX_UNSPECIFIED),
        INVALID,
        None,
        "structured_output.grammar.syntax",
    ),
    # ---- regex bombs: counted repetitions that expand at compile time ---------------------------
    Case(
        "regex ((a{1000}){1000}){1000}", lambda: regex("((a{1000}){1000}){1000}"), INVALID, LIMIT, REGEX_FIELD
    ),
    Case("regex a{1000000}", lambda: regex("a{1000000}"), INVALID, LIMIT, REGEX_FIELD),
    Case("regex (a{100}){1001}", lambda: regex("(a{100}){1001}"), INVALID, LIMIT, REGEX_FIELD),
    Case("regex [a-z]{5,200000}", lambda: regex("[a-z]{5,200000}"), INVALID, LIMIT, REGEX_FIELD),
    Case("regex (?:x{400}){400}", lambda: regex("(?:x{400}){400}"), INVALID, LIMIT, REGEX_FIELD),
    Case("regex \\d{999999999}", lambda: regex("\\d{999999999}"), INVALID, LIMIT, REGEX_FIELD),
    Case(
        "regex 1,000 nested groups", lambda: regex("(" * 1000 + "a" + ")" * 1000), INVALID, LIMIT, REGEX_FIELD
    ),
    Case("regex 65 nested groups", lambda: regex("(" * 65 + "a" + ")" * 65), INVALID, LIMIT, REGEX_FIELD),
    Case("regex 600 KB", lambda: regex("a" * 600_000), INVALID, LIMIT, REGEX_FIELD),
    Case("regex unclosed group", lambda: regex("a(b"), INVALID, "INVALID_REGEX", REGEX_FIELD),
    Case("regex unclosed class", lambda: regex("[abc"), INVALID, "INVALID_REGEX", REGEX_FIELD),
    Case("regex lookahead", lambda: regex("(?=a)a"), INVALID, "INVALID_REGEX", REGEX_FIELD),
    Case("regex backreference", lambda: regex("(a)\\1"), INVALID, "INVALID_REGEX", REGEX_FIELD),
    Case("regex unknown class", lambda: regex("\\p{NoSuchClass}"), INVALID, "INVALID_REGEX", REGEX_FIELD),
    Case("regex bad range x{2,1}", lambda: regex("x{2,1}"), INVALID, "INVALID_REGEX", REGEX_FIELD),
    Case("regex empty", lambda: regex(""), INVALID, "INVALID_REGEX", REGEX_FIELD),
    Case("regex nothing to repeat", lambda: regex("*a"), INVALID, "INVALID_REGEX", REGEX_FIELD),
    Case("regex stray )", lambda: regex("a)"), INVALID, "INVALID_REGEX", REGEX_FIELD),
    # ---- validation must not backtrack: the `validated` model answers 'a'*27 + '!' ----------
    Case(
        "validated regex ^(a|a)+$ (was a 22 s freeze)",
        lambda: regex("^(a|a)+$", model="validated"),
        grpc.StatusCode.ABORTED,
        "VALIDATION_FAILED",
    ),
    Case("validated regex (a+)+b", lambda: regex("(a+)+b", model="validated"), grpc.StatusCode.ABORTED),
    Case("validated regex (a|aa)+$", lambda: regex("(a|aa)+$", model="validated"), grpc.StatusCode.ABORTED),
    Case("validated regex (.*a){20}", lambda: regex("(.*a){20}", model="validated"), grpc.StatusCode.ABORTED),
    Case(
        "validated schema pattern with not (a|a)+ (was a 15-28 s freeze)",
        lambda: schema(
            {"type": "string", "pattern": "^a{27}!$", "not": {"pattern": "^(a|a)+$"}}, model="validated"
        ),
        grpc.StatusCode.ABORTED,
    ),
    Case(
        "validated schema pattern (a+)+$",
        lambda: schema({"type": "string", "pattern": "^(a+)+$"}, model="validated"),
        grpc.StatusCode.ABORTED,
    ),
    Case(
        "validated patternProperties (a|a)+",
        lambda: schema({"type": "object", "patternProperties": {"^(a|a)+$": {}}}, model="validated"),
        grpc.StatusCode.ABORTED,
    ),
    Case(
        "validated grammar rejects text",
        lambda: lark('start: "b"+', model="validated"),
        grpc.StatusCode.ABORTED,
    ),
    Case(
        "validated choice not matching",
        lambda: choices(["yes", "no"], model="validated"),
        grpc.StatusCode.ABORTED,
        "VALIDATION_FAILED",
    ),
    Case(
        "validated unevaluatedProperties with patternProperties (re backtracking in jsonschema)",
        lambda: schema(
            {"type": "object", "patternProperties": {"^(a+)+$": {}}, "unevaluatedProperties": False},
            model="validated",
        ),
        INVALID,
        "UNSUPPORTED_SCHEMA",
        SCHEMA_FIELD,
    ),
    Case(
        "output nested 50,000 deep under json_object (RecursionError in validation)",
        lambda: req("deep", structured_output=t.StructuredOutput(json_object=t.JsonObject())),
        grpc.StatusCode.ABORTED,
        "VALIDATION_FAILED",
    ),
    Case(
        "output nested 50,000 deep under a native schema",
        lambda: schema({"type": "object"}, model="deep"),
        grpc.StatusCode.ABORTED,
        "VALIDATION_FAILED",
    ),
    # ---- schemas: size, nesting, numbers, references ---------------------------------------------
    Case(
        "schema 575 KB (was a 7 s freeze)", lambda: schema(big_schema(400)), INVALID, LIMIT, SCHEMA_JSON_FIELD
    ),
    Case(
        "schema 5 MB (was a 23 s freeze)", lambda: schema(big_schema(3500)), INVALID, LIMIT, SCHEMA_JSON_FIELD
    ),
    Case(
        "schema 5 MB as a Struct",
        lambda: req(
            structured_output=t.StructuredOutput(json_schema=t.JsonSchema(schema=_struct(big_schema(3500))))
        ),
        INVALID,
        LIMIT,
        SCHEMA_FIELD,
    ),
    Case("schema nested 300 deep", lambda: schema(nested(300)), INVALID, LIMIT, SCHEMA_FIELD),
    Case("schema nested 65 deep", lambda: schema(nested(65)), INVALID, LIMIT, SCHEMA_FIELD),
    Case(
        "schema_json nested 100,000 deep",
        lambda: schema_json("[" * 100_000 + "]" * 100_000),
        INVALID,
        None,
        "structured_output.json_schema.schema_json",
    ),
    Case(
        "schema 5,000-digit integer",
        lambda: schema_json('{"type": "integer", "maximum": ' + "9" * 5000 + "}"),
        INVALID,
        None,
        "structured_output.json_schema.schema_json",
    ),
    Case(
        "schema $ref cycle",
        lambda: schema(
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
        ),
        INVALID,
        None,
        SCHEMA_FIELD,
    ),
    Case("schema $ref #", lambda: schema({"$ref": "#"}), INVALID, None, SCHEMA_FIELD),
    Case(
        "schema $ref chain 5,000 (stack overflow)",
        lambda: schema(ref_chain(5000)),
        INVALID,
        LIMIT,
        SCHEMA_FIELD,
    ),
    Case("schema $ref to nowhere", lambda: schema({"$ref": "#/$defs/missing"}), INVALID, None, SCHEMA_FIELD),
    Case("schema remote $ref", lambda: schema({"$ref": "https://example.invalid/s.json"}), INVALID),
    Case("schema type 5", lambda: schema({"type": 5}), INVALID, "INVALID_SCHEMA", SCHEMA_FIELD),
    Case(
        "schema minLength -1", lambda: schema({"type": "string", "minLength": -1}), INVALID, "INVALID_SCHEMA"
    ),
    Case("schema pattern lookahead", lambda: schema({"type": "string", "pattern": "(?=a)"}), INVALID),
    Case(
        "schema pattern bomb",
        lambda: schema({"type": "string", "pattern": "(a{1000}){1000}"}),
        INVALID,
        LIMIT,
    ),
    Case(
        "schema patternProperties bomb",
        lambda: schema({"type": "object", "patternProperties": {"(a{1000}){1000}": {}}}),
        INVALID,
        LIMIT,
    ),
    Case("schema_json not JSON", lambda: schema_json("{nope"), INVALID, "INVALID_SCHEMA"),
    Case("schema_json an array", lambda: schema_json("[1, 2]"), INVALID, "INVALID_SCHEMA"),
    Case("schema_json a string", lambda: schema_json('"x"'), INVALID, "INVALID_SCHEMA"),
    Case("schema_json NaN", lambda: schema_json('{"maximum": NaN}'), INVALID),
    Case("schema unsatisfiable enum []", lambda: schema({"enum": []}), INVALID),
    Case(
        "schema 10,000 enum values x 60 B",
        lambda: schema({"enum": ["v" * 60 + str(i) for i in range(10_000)]}),
        INVALID,
        LIMIT,
    ),
    Case(
        "schema both struct and json",
        lambda: req(
            structured_output=t.StructuredOutput(
                json_schema=t.JsonSchema(schema_json="{}", schema=struct_pb2.Struct())
            )
        ),
        INVALID,
        None,
        "structured_output.json_schema.schema_json",
    ),
    Case(
        "schema neither struct nor json",
        lambda: req(structured_output=t.StructuredOutput(json_schema=t.JsonSchema())),
        INVALID,
        "INVALID_SCHEMA",
    ),
    Case(
        "json_object with additional_properties false",
        lambda: req(structured_output=_options(additional_properties=False)),
        INVALID,
        None,
        "structured_output.options.additional_properties",
    ),
    Case(
        "whitespace enum 7",
        lambda: req(structured_output=_options(whitespace=7)),  # type: ignore[arg-type]
        INVALID,
        None,
        "structured_output.options.whitespace",
    ),
    Case(
        "structured_output with no kind",
        lambda: req(structured_output=t.StructuredOutput()),
        INVALID,
        None,
        "structured_output.kind",
    ),
    # ---- choices ---------------------------------------------------------------------------------
    Case(
        "choices 200,000 (was compile-pool starvation)",
        lambda: choices([f"c{i}" for i in range(200_000)]),
        INVALID,
        LIMIT,
        CHOICES_FIELD,
    ),
    Case("choices 10,001", lambda: choices([f"c{i}" for i in range(10_001)]), INVALID, LIMIT, CHOICES_FIELD),
    Case("choices 600 KB total", lambda: choices(["x" * 60_000 + str(i) for i in range(10)]), INVALID, LIMIT),
    Case("choices empty list", lambda: choices([]), INVALID, "EMPTY_CHOICES", CHOICES_FIELD),
    Case("choices empty string", lambda: choices(["a", ""]), INVALID, "EMPTY_CHOICES", CHOICES_FIELD),
    # ---- input size, checked before tokenizing ----------------------------------------------------
    Case(
        "prompt 5 MB (was tokenized in full)",
        lambda: req(prompt="word " * 1_000_000),
        INVALID,
        LIMIT,
        "prompt",
    ),
    Case("prompt 45 MB", lambda: req(prompt="x" * 45_000_000), INVALID, LIMIT, "prompt"),
    Case(
        "messages 5,000",
        lambda: g.GenerateRequest(
            model="validated",
            messages=t.ChatMessages(
                messages=[t.ChatMessage(role=t.ROLE_USER, content=[t.ContentPart(text="x")])] * 5000
            ),
        ),
        INVALID,
        LIMIT,
        "messages.messages",
    ),
    Case(
        "messages 5 MB of text",
        lambda: g.GenerateRequest(
            model="validated",
            messages=t.ChatMessages(
                messages=[t.ChatMessage(role=t.ROLE_USER, content=[t.ContentPart(text="y" * 1_000_000)])] * 5
            ),
        ),
        INVALID,
        LIMIT,
        "messages",
    ),
    Case(
        "message role 99",
        lambda: g.GenerateRequest(
            model="validated",
            messages=t.ChatMessages(messages=[t.ChatMessage(role=99, content=[t.ContentPart(text="x")])]),  # type: ignore[arg-type]
        ),
        INVALID,
        None,
        "messages.messages[0].role",
    ),
    Case(
        "message part unset",
        lambda: g.GenerateRequest(
            model="validated",
            messages=t.ChatMessages(messages=[t.ChatMessage(role=t.ROLE_USER, content=[t.ContentPart()])]),
        ),
        INVALID,
        None,
        "messages.messages[0].content[0]",
    ),
    Case(
        "messages empty",
        lambda: g.GenerateRequest(model="validated", messages=t.ChatMessages()),
        INVALID,
        None,
        "messages.messages",
    ),
    Case("no input", lambda: g.GenerateRequest(model="tiny"), INVALID, None, "input"),
    # ---- stopping ---------------------------------------------------------------------------------
    Case(
        "17 stop strings",
        lambda: req(stopping=t.StoppingCriteria(max_tokens=8, stop=["s"] * 17)),
        INVALID,
        LIMIT,
        "stopping.stop",
    ),
    Case(
        "16 stop strings of 1 MB",
        lambda: req(stopping=t.StoppingCriteria(max_tokens=8, stop=["s" * 1_000_000] * 16)),
        INVALID,
        LIMIT,
        "stopping.stop[0]",
    ),
    Case(
        "stop string 1,025 B",
        lambda: req(stopping=t.StoppingCriteria(max_tokens=8, stop=["s" * 1025])),
        INVALID,
        LIMIT,
        "stopping.stop[0]",
    ),
    Case(
        "empty stop string",
        lambda: req(stopping=t.StoppingCriteria(max_tokens=8, stop=[""])),
        INVALID,
        None,
        "stopping.stop[0]",
    ),
    Case(
        "max_tokens 0",
        lambda: req(stopping=t.StoppingCriteria(max_tokens=0)),
        INVALID,
        None,
        "stopping.max_tokens",
    ),
    Case(
        "max_tokens 2^31-1",
        lambda: req(stopping=t.StoppingCriteria(max_tokens=2**31 - 1)),
        INVALID,
        None,
        "stopping.max_tokens",
    ),
    # ---- sampling ---------------------------------------------------------------------------------
    Case(
        "temperature NaN",
        lambda: req(sampling=t.SamplingParams(temperature=float("nan"))),
        INVALID,
        None,
        "sampling.temperature",
    ),
    Case(
        "temperature inf",
        lambda: req(sampling=t.SamplingParams(temperature=float("inf"))),
        INVALID,
        None,
        "sampling.temperature",
    ),
    Case(
        "temperature -1",
        lambda: req(sampling=t.SamplingParams(temperature=-1)),
        INVALID,
        None,
        "sampling.temperature",
    ),
    Case("top_p 0", lambda: req(sampling=t.SamplingParams(top_p=0)), INVALID, None, "sampling.top_p"),
    Case(
        "top_p NaN",
        lambda: req(sampling=t.SamplingParams(top_p=float("nan"))),
        INVALID,
        None,
        "sampling.top_p",
    ),
    Case("min_p 2", lambda: req(sampling=t.SamplingParams(min_p=2)), INVALID, None, "sampling.min_p"),
    Case(
        "frequency_penalty -inf",
        lambda: req(sampling=t.SamplingParams(frequency_penalty=float("-inf"))),
        INVALID,
        None,
        "sampling.frequency_penalty",
    ),
    Case(
        "repetition_penalty 0",
        lambda: req(sampling=t.SamplingParams(repetition_penalty=0)),
        INVALID,
        None,
        "sampling.repetition_penalty",
    ),
    Case("n 0", lambda: req(n=0), INVALID, None, "n"),
    Case("n 2^31-1", lambda: req(n=2**31 - 1), INVALID, None, "n"),
    Case("logprobs 1,000,000", lambda: req(logprobs=1_000_000), INVALID, None, "logprobs"),
    # ---- echoes: errors stay small whatever the input ----------------------------------------------
    Case(
        "model name 4 KB (was trailer overflow)",
        lambda: req(model="m" * 4096),
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
    ),
    Case("model name 1 MB", lambda: req(model="m" * 1_000_000), grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND"),
    Case("model name with newlines and NUL", lambda: req(model="a\nb\x00c" * 100), grpc.StatusCode.NOT_FOUND),
    Case("model empty", lambda: req(model=""), INVALID, None, "model"),
    Case(
        "model name of 4,000 emoji",
        lambda: req(model="🙂" * 4000),
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
    ),
    Case(
        "20 unknown non-ASCII option keys (bytes, not characters, fill trailers)",
        lambda: with_field(
            req(),
            lambda m: [
                m.backend_options["ключ" * 16 + str(i)].CopyFrom(t.BackendOptionValue(int_value=1))
                for i in range(20)
            ],
        ),
        INVALID,
    ),
    Case(
        "backend option key 4 KB",
        lambda: with_field(req(), lambda m: m.backend_options["k" * 4096].string_value.__class__),
        INVALID,
    ),
    Case(
        "backend option 1,000 unknown keys",
        lambda: with_field(
            req(),
            lambda m: [
                m.backend_options[f"key{i}" * 20].CopyFrom(t.BackendOptionValue(int_value=1))
                for i in range(1000)
            ],
        ),
        INVALID,
    ),
    Case(
        "backend option with no value",
        lambda: with_field(req(), lambda m: m.backend_options["min_tokens"].CopyFrom(t.BackendOptionValue())),
        INVALID,
        None,
        "backend_options[min_tokens]",
    ),
    Case(
        "backend option NaN (no JSON for it)",
        lambda: with_field(
            req(),
            lambda m: m.backend_options["min_tokens"].CopyFrom(t.BackendOptionValue(double_value=math.nan)),
        ),
        INVALID,
        None,
        "backend_options[min_tokens]",
    ),
    Case(
        "1,000 bad sampling fields' worth of errors in one request",
        lambda: req(
            n=0,
            sampling=t.SamplingParams(temperature=-1, top_p=0, min_p=2, repetition_penalty=0),
            stopping=t.StoppingCriteria(max_tokens=0, stop=[""] * 16),
        ),
        INVALID,
    ),
    # ---- malformed bytes: INVALID_ARGUMENT with ErrorInfo, never UNKNOWN --------------------------
    Case(
        "raw garbage to Generate",
        lambda: b"\xff\xff\xff\xff\xff",
        INVALID,
        "MALFORMED_REQUEST",
        rpc="raw:Generate",
    ),
    Case("raw truncated varint", lambda: b"\x08", INVALID, "MALFORMED_REQUEST", rpc="raw:Generate"),
    Case(
        "raw invalid UTF-8 in prompt", _invalid_utf8_request, INVALID, "MALFORMED_REQUEST", rpc="raw:Generate"
    ),
    Case(
        "raw Struct nested 200 deep",
        lambda: deep_struct_bytes(200),
        INVALID,
        "MALFORMED_REQUEST",
        rpc="raw:Generate",
    ),
    Case(
        "raw garbage to GenerateStream",
        lambda: b"\x0a\xff\xff\xff\x0f",
        INVALID,
        "MALFORMED_REQUEST",
        rpc="raw:GenerateStream",
    ),
    Case(
        "raw garbage to BatchGenerate",
        lambda: b"\x0a\x05\xff\xff",
        INVALID,
        "MALFORMED_REQUEST",
        rpc="raw:BatchGenerate",
    ),
    Case(
        "raw invalid UTF-8 to ListModels",
        lambda: b"\x0a\x02\xff\xfe",
        grpc.StatusCode.OK,
        rpc="raw:ListModels",
    ),
    Case(
        "raw wrong message type to Generate",
        lambda: g.ListModelsResponse(models=[t.ModelInfo(name="x" * 100)]).SerializeToString(),
        grpc.StatusCode.NOT_FOUND,
        rpc="raw:Generate",
    ),
    # ---- streams: the same checks, field paths under `request.` -----------------------------------
    Case(
        "stream lark chain 5,000",
        lambda: _stream(lark(chain_lark(5000))),
        INVALID,
        LIMIT,
        "request." + GRAMMAR_FIELD,
        rpc="stream",
    ),
    Case(
        "stream regex bomb",
        lambda: _stream(regex("((a{1000}){1000}){1000}")),
        INVALID,
        LIMIT,
        "request." + REGEX_FIELD,
        rpc="stream",
    ),
    Case("stream schema 5 MB", lambda: _stream(schema(big_schema(5 * 1024))), INVALID, LIMIT, rpc="stream"),
    Case(
        "stream validated (a|a)+$",
        lambda: _stream(regex("^(a|a)+$", model="validated")),
        grpc.StatusCode.ABORTED,
        rpc="stream",
    ),
    Case(
        "stream model name 4 KB",
        lambda: _stream(req(model="m" * 4096)),
        grpc.StatusCode.NOT_FOUND,
        rpc="stream",
    ),
    Case(
        "stream prompt 5 MB",
        lambda: _stream(req(prompt="p" * 5_000_000)),
        INVALID,
        LIMIT,
        "request.prompt",
        rpc="stream",
    ),
    Case("stream $ref cycle", lambda: _stream(schema({"$ref": "#"})), INVALID, rpc="stream"),
    # ---- batches: counted before conversion; bad items answer per item ----------------------------
    Case("batch 4,097 items", lambda: _batch(*[req()] * 4097), INVALID, LIMIT, "requests", rpc="batch"),
    Case(
        "batch 100,000 bad items (was 100k error frames)",
        lambda: _batch(*[req(model="")] * 100_000),
        INVALID,
        LIMIT,
        "requests",
        rpc="batch",
    ),
    Case("batch empty", lambda: _batch(), INVALID, None, "requests", rpc="batch"),
    Case(
        "batch hostile items beside good ones",
        lambda: _batch(
            req(model="validated"),
            lark(chain_lark(5000)),
            regex("((a{1000}){1000}){1000}"),
            req(model="m" * 4096),
            schema({"$ref": "#"}),
            regex("^(a|a)+$", model="validated"),
            req(model="validated"),
        ),
        grpc.StatusCode.OK,
        rpc="batch",
        items={
            0: grpc.StatusCode.OK,
            1: INVALID,
            2: INVALID,
            3: grpc.StatusCode.NOT_FOUND,
            4: INVALID,
            5: grpc.StatusCode.ABORTED,
            6: grpc.StatusCode.OK,
        },
    ),
    Case(
        "batch item with malformed enum",
        lambda: _batch(req(model="validated"), lark('start: "x"', syntax=42)),
        grpc.StatusCode.OK,
        rpc="batch",
        items={0: grpc.StatusCode.OK, 1: INVALID},
    ),
]
# Tool calling (corpus_tools.py): tool schemas, tool inputs and returned calls.
CASES += [
    Case(name, build, code, why, field, rpc, items)
    for name, build, code, why, field, rpc, items in TOOL_CASES
]
