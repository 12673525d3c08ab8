"""Fuzzing the server as a caller: hypothesis over GenerateRequest fields and over constraints
(schemas from hypothesis-jsonschema and as arbitrary JSON, generated regexes and grammars).

Against `gengate serve` in its own process (as in production): every answer is a status a caller
can act on — never UNKNOWN or INTERNAL for caller input —, a success is never an invalid result,
health keeps answering, and the engine worker never dies. Bounded (~1 min) in the default run;
`scripts/test --fuzz` runs the same properties with many more examples (GENGATE_FUZZ_EXAMPLES).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import grpc
import jsonschema
import lark as lark_module
import pytest
import regex as regex_module
from corpus import SERVER_CONFIG, VALIDATED_TEXT
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from gengate_proto.v1 import types_pb2 as t
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from serve_process import ServerProcess

EXAMPLES = int(os.environ.get("GENGATE_FUZZ_EXAMPLES", "1000"))
# What a caller may get back for any input; INTERNAL and UNKNOWN would be our bugs.
CALLER_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("GENGATE_FUZZ_RANDOM") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    running = ServerProcess(SERVER_CONFIG)
    yield running
    running.stop()
    worker_starts = [line for line in running.log if "worker pid" in line and "ready" in line]
    assert len(worker_starts) == 1, "the engine worker restarted:\n" + "".join(running.log[-40:])
    assert not [line for line in running.log if "restarting its worker" in line]


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[generation_pb2_grpc.GenerationServiceStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def health(server: ServerProcess) -> Iterator[health_pb2_grpc.HealthStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield health_pb2_grpc.HealthStub(channel)


# ---- strategies -------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


def _unrolled_metaschema(depth: int) -> dict[str, Any]:
    """Draft 7's metaschema with its recursion unrolled `depth` times (hypothesis-jsonschema cannot
    follow recursive references), so it generates structurally valid schemas of bounded depth."""
    meta = json.loads(json.dumps(jsonschema.Draft7Validator.META_SCHEMA))
    for key in ("$schema", "$id"):
        meta.pop(key, None)
    defs = meta.pop("definitions")
    for name in (
        "readOnly",
        "contentMediaType",
        "contentEncoding",
        "$comment",
        "examples",
        "default",
        "$ref",
        "$id",
        "$schema",
        "definitions",
        "dependencies",
        "format",
        "if",
        "then",
        "else",
    ):
        meta["properties"].pop(name, None)

    def resolve(node: Any, level: int) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref == "#":
                return {"type": "boolean"} if level == 0 else resolve(meta, level - 1)
            if isinstance(ref, str) and ref.startswith("#/definitions/"):
                return resolve(defs[ref.rsplit("/", 1)[1]], level)
            return {k: resolve(v, level) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v, level) for v in node]
        return node

    schema = resolve(meta, depth)
    schema["maxProperties"] = 4
    return schema  # type: ignore[no-any-return]


metaschema_schemas = from_schema(_unrolled_metaschema(1))

regex_atoms = st.sampled_from(
    [
        "a",
        "b",
        ".",
        "\\d",
        "\\w",
        "[a-z]",
        "[^x]",
        "\\p{L}",
        "[[:alpha:]]",
        "x",
        "\\.",
        "(",
        ")",
        "|",
        "{",
        "}",
        "\\",
        "[",
        "]",
        "^",
        "$",
        "(?:",
        "(?=",
        "\\1",
        "é",
        "🙂",
    ]
)
regex_quantifiers = st.sampled_from(
    ["", "", "*", "+", "?", "{2}", "{1,3}", "{0,}", "{1000}", "{5,2}", "{99999}"]
)
regexes = st.one_of(
    st.lists(st.tuples(regex_atoms, regex_quantifiers), max_size=8).map(
        lambda p: "".join(a + q for a, q in p)
    ),
    st.lists(st.sampled_from(["a", "b", "(a|b)", "[0-9]"]), min_size=1, max_size=4).map(
        lambda parts: "".join(f"({p}){{{i + 1}}}" for i, p in enumerate(parts))
    ),
    st.text(max_size=12),
)

grammar_pieces = st.sampled_from(
    [
        '"a"',
        '"b"',
        "/[a-z]+/",
        "/[0-9]{2}/",
        "r0",
        "r1",
        "r2",
        "start",
        "(",
        ")",
        "|",
        "*",
        "+",
        "?",
        '"',
        ":",
        "::=",
        "\n",
        "~ 2",
        "%import common.WORD",
        "[",
        "]",
        "x{3}",
    ]
)
grammars = st.one_of(
    st.lists(st.lists(grammar_pieces, min_size=1, max_size=5), min_size=1, max_size=4).map(
        lambda rules: "start: r0\n" + "".join(f"r{i}: {' '.join(body)}\n" for i, body in enumerate(rules))
    ),
    st.text(max_size=40),
)


@st.composite
def constraints(draw: st.DrawFn) -> t.StructuredOutput:
    kind = draw(
        st.sampled_from(["schema", "schema_json", "any_json", "regex", "choice", "grammar", "object"])
    )
    whitespace = draw(st.sampled_from([0, 0, 0, 1, 2, 3, 77]))
    options = t.StructuredOutputOptions(whitespace=whitespace)  # type: ignore[arg-type]
    if draw(rarely):
        options.additional_properties = draw(st.booleans())
    if kind == "schema":
        value = draw(metaschema_schemas)
        schema_text = json.dumps(value) if isinstance(value, dict) else "{}"
        return t.StructuredOutput(json_schema=t.JsonSchema(schema_json=schema_text), options=options)
    if kind == "schema_json":
        return t.StructuredOutput(
            json_schema=t.JsonSchema(schema_json=draw(st.text(max_size=40))), options=options
        )
    if kind == "any_json":
        value = draw(json_values)
        return t.StructuredOutput(json_schema=t.JsonSchema(schema_json=json.dumps(value)), options=options)
    if kind == "regex":
        return t.StructuredOutput(regex=t.Regex(pattern=draw(regexes)), options=options)
    if kind == "choice":
        return t.StructuredOutput(choice=t.Choice(choices=draw(st.lists(st.text(max_size=8), max_size=5))))
    if kind == "grammar":
        syntax = draw(st.sampled_from([1, 1, 1, 2, 3, 0, 9]))
        return t.StructuredOutput(grammar=t.Grammar(syntax=syntax, definition=draw(grammars)))  # type: ignore[arg-type]
    return t.StructuredOutput(json_object=t.JsonObject(), options=options)


# Hypothesis leans towards the first element (and towards 0 for integers): the usual case first.
rarely = st.sampled_from([False, False, False, True])
mostly = st.sampled_from([True, True, True, False])
optional_floats = st.none() | st.floats(allow_nan=True, allow_infinity=True, width=32) | st.floats(0, 2)


@st.composite
def requests(draw: st.DrawFn) -> g.GenerateRequest:
    msg = g.GenerateRequest(
        model=draw(st.sampled_from(["tiny", "validated", "tiny", "tooly", ""]) | st.text(max_size=12))
    )
    if draw(st.booleans()):
        msg.prompt = draw(st.text(max_size=60))
    elif draw(st.booleans()):
        for _ in range(draw(st.integers(1, 3))):
            role = draw(st.sampled_from([2, 1, 3, 2, 0, 9]))
            message = msg.messages.messages.add(role=role)  # type: ignore[arg-type]
            if draw(mostly):
                message.content.add(text=draw(st.text(max_size=30)))
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    ):
        value = draw(optional_floats) if draw(rarely) else None
        if value is not None:
            setattr(msg.sampling, name, value)
    if draw(st.booleans()):
        msg.sampling.seed = draw(st.integers(0, 2**64 - 1))
    small = st.sampled_from([1, 4, 12, 16])
    msg.stopping.max_tokens = draw(st.integers(0, 2**32 - 1) if draw(rarely) else small)
    if draw(rarely):
        msg.stopping.stop.extend(draw(st.lists(st.text(max_size=6), max_size=3)))
    if draw(rarely):
        msg.n = draw(st.integers(0, 4) | st.integers(0, 2**32 - 1))
    if draw(rarely):
        msg.logprobs = draw(st.integers(0, 30) | st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        msg.structured_output.CopyFrom(draw(constraints()))
    if msg.model == "tooly" or draw(rarely):
        add_tools(draw, msg)
    for key in draw(
        st.lists(st.sampled_from(["min_tokens", "ignore_eos", "nope"]) | st.text(max_size=6), max_size=2)
    ):
        option = msg.backend_options[key]
        choice = draw(st.integers(0, 3))
        if choice == 0:
            option.int_value = draw(st.integers(-5, 100))
        elif choice == 1:
            option.bool_value = draw(st.booleans())
        elif choice == 2:
            option.string_value = draw(st.text(max_size=5))
    return msg


def add_magpie(draw: st.DrawFn, msg: g.GenerateRequest) -> None:
    """A Magpie input in place of the prompt, mostly sound (a known preset or a custom template,
    a few turns), sometimes not (unknown presets, empty templates, system turns, huge counts)."""
    magpie = msg.magpie
    if draw(st.booleans()):
        presets = [1, 2, 2, 3, 4] if draw(mostly) else [0, 99]
        magpie.preset = draw(st.sampled_from(presets))  # type: ignore[assignment]
    else:
        magpie.template = draw(st.text(min_size=1, max_size=12) if draw(mostly) else st.just(""))
    if draw(rarely):
        magpie.system_prompt = draw(st.text(max_size=12))
    if draw(st.booleans()):
        counts = (
            st.sampled_from([1, 2, 3])
            if draw(mostly)
            else st.sampled_from([0, 17]) | st.integers(0, 2**32 - 1)
        )
        magpie.n_turns = draw(counts)
    magpie.only_instruction = draw(rarely)
    magpie.end_with_user = draw(rarely)
    if draw(rarely):
        for i in range(draw(st.integers(1, 3))):
            role = (
                (t.ROLE_USER, t.ROLE_ASSISTANT)[i % 2] if draw(mostly) else draw(st.sampled_from([0, 1, 4]))
            )
            magpie.conversation.add(role=role).content.add(text=draw(st.text(max_size=10)))  # type: ignore[arg-type]


def add_tools(draw: st.DrawFn, msg: g.GenerateRequest) -> None:
    """Tools (the scripted `tooly` calls `f`), a tool choice and the parallel flag, mostly sound."""
    for _ in range(draw(st.integers(0, 3))):
        tool = msg.tools.add(name=draw(st.sampled_from(["f", "g", "f", ""]) | st.text(max_size=8)))
        kind = draw(st.sampled_from(["schema", "none", "any_json", "text"]))
        if kind == "schema":
            value = draw(metaschema_schemas)
            if isinstance(value, dict):
                tool.parameters_json = json.dumps({**value, "type": "object"})
        elif kind == "any_json":
            tool.parameters_json = json.dumps(draw(json_values))
        elif kind == "text":
            tool.parameters_json = draw(st.text(max_size=30))
    if draw(rarely):
        if draw(st.booleans()):
            msg.tool_choice.mode = draw(st.sampled_from([0, 1, 2, 3, 9]))  # type: ignore[assignment]
        else:
            msg.tool_choice.name = draw(st.sampled_from(["f", "g", ""]) | st.text(max_size=6))
    if draw(rarely):
        msg.parallel_tool_calls = draw(st.booleans())


# ---- the independent check of a successful answer ---------------------------------------------


def independent_call_violation(request: g.GenerateRequest, call: t.ToolCall) -> str | None:
    """Re-checks a returned tool call: an offered tool's name, arguments valid for its schema."""
    offered = {tool.name: tool for tool in request.tools}
    if call.name not in offered:
        return f"{call.name!r} was not offered"
    if request.tool_choice.WhichOneof("choice") == "name" and call.name != request.tool_choice.name:
        return f"{call.name!r} is not the tool named by tool_choice"
    if request.tool_choice.mode == t.TOOL_CHOICE_MODE_NONE and request.tool_choice.WhichOneof("choice"):
        return "tool_choice is none"
    arguments = json.loads(call.arguments_json)
    if not isinstance(arguments, dict):
        return "the arguments are not an object"
    text = offered[call.name].parameters_json
    schema = json.loads(text) if text else {"type": "object", "additionalProperties": False}
    error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(schema).iter_errors(arguments))
    return None if error is None else error.message


def independent_violation(structured: t.StructuredOutput, text: str) -> str | None:
    """Re-checks a returned structured result with libraries the server does not use for it."""
    kind = structured.WhichOneof("kind")
    if kind == "json_schema":
        value = json.loads(text)
        schema = json.loads(structured.json_schema.schema_json)
        error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(schema).iter_errors(value))
        return None if error is None else error.message
    if kind == "json_object":
        return None if isinstance(json.loads(text), dict) else "not an object"
    if kind == "choice":
        return None if text in structured.choice.choices else "not a choice"
    if kind == "regex":
        pattern = structured.regex.pattern.replace("\\d", "[0-9]").replace("\\w", "[0-9A-Za-z_]")
        try:
            matched = regex_module.fullmatch(pattern, text, timeout=2)
        except (regex_module.error, TimeoutError):
            return None  # a dialect difference, not a server fault
        return None if matched else f"{text!r} does not match"
    if kind == "grammar" and structured.grammar.syntax == t.GRAMMAR_SYNTAX_LARK:
        try:
            parser = lark_module.Lark(structured.grammar.definition, parser="earley")
        except Exception:
            return None  # llguidance extensions lark cannot read
        try:
            parser.parse(text)
        except lark_module.exceptions.LarkError as exc:
            return str(exc)[:200]
    return None


def _assert_healthy(health: health_pb2_grpc.HealthStub) -> None:
    for service in ("", "gengate.v1.GenerationService/tiny"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, service


def _settle(error: grpc.RpcError) -> grpc.StatusCode:
    code = error.code()  # type: ignore[attr-defined]
    assert code in CALLER_CODES, f"{code.name}: {error.details()}"  # type: ignore[attr-defined]
    return code  # type: ignore[no-any-return]


@FUZZ_SETTINGS
@given(request=requests(), streaming=st.booleans())
def test_any_request_gets_a_caller_status_and_never_an_invalid_success(
    stub: generation_pb2_grpc.GenerationServiceStub,
    health: health_pb2_grpc.HealthStub,
    request: g.GenerateRequest,
    streaming: bool,
) -> None:
    started = time.monotonic()
    texts: dict[int, str] = {}
    finishes: dict[int, int] = {}
    calls: list[t.ToolCall] = []
    try:
        if streaming:
            for frame in stub.GenerateStream(g.GenerateStreamRequest(request=request), timeout=120):
                if frame.HasField("delta"):
                    texts[frame.delta.index] = texts.get(frame.delta.index, "") + frame.delta.text
                elif frame.HasField("end"):
                    finishes[frame.end.index] = frame.end.finish_reason
                    texts.setdefault(frame.end.index, "")
                    calls += frame.end.tool_calls
        else:
            response = stub.Generate(request, timeout=120)
            for generation in response.generations:
                texts[generation.index] = generation.text
                finishes[generation.index] = generation.finish_reason
                calls += generation.tool_calls
    except grpc.RpcError as error:
        _settle(error)
    else:
        for call in calls:
            problem = independent_call_violation(request, call)
            assert problem is None, f"tool call {call.name!r} returned as a success: {problem}"
        assert (t.FINISH_REASON_TOOL_CALLS in finishes.values()) == bool(calls)
        if request.HasField("structured_output"):
            for index, text in texts.items():
                if finishes[index] == t.FINISH_REASON_STOP:
                    problem = independent_violation(request.structured_output, text)
                    assert problem is None, f"generation {index} returned as a success: {problem}"
    if time.monotonic() - started > 5:  # a slow answer: is everyone else still served?
        _assert_healthy(health)


def asked_roles(magpie: t.Magpie) -> list[int]:
    """The roles of the turns a Magpie input asks to be written, worked out apart from the server."""
    if magpie.only_instruction:
        return [t.ROLE_USER]
    turns = magpie.n_turns if magpie.HasField("n_turns") else 1
    roles = [t.ROLE_USER, t.ROLE_ASSISTANT] * turns
    return roles[:-1] if magpie.end_with_user else roles


@settings(FUZZ_SETTINGS, max_examples=max(EXAMPLES // 10, 50))
@given(data=st.data())
def test_any_magpie_request_gets_a_caller_status_and_the_turns_it_asked_for(
    stub: generation_pb2_grpc.GenerationServiceStub, data: st.DataObject
) -> None:
    """On the engine (its chat template continues the conversation) and on a raw-prompt model
    without one (a custom template there can write only a first turn): a caller status, or the
    conversation asked for, earlier turns included."""
    for model in ("validated", "tiny"):
        request = g.GenerateRequest(model=model)
        add_magpie(data.draw, request)
        request.stopping.max_tokens = 4
        try:
            response = stub.Generate(request, timeout=120)
        except grpc.RpcError as error:
            _settle(error)
            continue
        given_turns = [m.role for m in request.magpie.conversation]
        for generation in response.generations:
            roles = [turn.role for turn in generation.conversation]
            assert roles == given_turns + asked_roles(request.magpie), roles


@FUZZ_SETTINGS
@given(structured=constraints())
def test_any_constraint_is_enforced_or_refused_on_the_engine_and_on_validation(
    stub: generation_pb2_grpc.GenerationServiceStub,
    health: health_pb2_grpc.HealthStub,
    structured: t.StructuredOutput,
) -> None:
    for model in ("tiny", "validated"):
        request = g.GenerateRequest(model=model, prompt="Answer:", structured_output=structured)
        request.stopping.max_tokens = 24
        try:
            response = stub.Generate(request, timeout=120)
        except grpc.RpcError as error:
            _settle(error)
            continue
        for generation in response.generations:
            if generation.finish_reason == t.FINISH_REASON_STOP:
                problem = independent_violation(structured, generation.text)
                assert problem is None, f"{model} returned an invalid result as a success: {problem}"
        if model == "validated":
            assert response.generations[0].text == VALIDATED_TEXT


@FUZZ_SETTINGS
@given(data=st.data(), streaming=st.booleans())
def test_any_tool_set_gets_a_caller_status_and_never_an_invalid_call(
    stub: generation_pb2_grpc.GenerationServiceStub, data: st.DataObject, streaming: bool
) -> None:
    """`tooly` calls `f` with one string argument: offered fuzzed tools, its call comes back only
    where the independent check agrees it is valid."""
    request = g.GenerateRequest(model="tooly", prompt="Answer:")
    request.stopping.max_tokens = 16
    add_tools(data.draw, request)
    calls: list[t.ToolCall] = []
    try:
        if streaming:
            frames = list(stub.GenerateStream(g.GenerateStreamRequest(request=request), timeout=120))
            calls = [c for f in frames if f.HasField("end") for c in f.end.tool_calls]
        else:
            calls = list(stub.Generate(request, timeout=120).generations[0].tool_calls)
    except grpc.RpcError as error:
        _settle(error)
        return
    for call in calls:
        problem = independent_call_violation(request, call)
        assert problem is None, f"tool call {call.name!r} returned as a success: {problem}"


def test_the_server_is_healthy_after_fuzzing(health: health_pb2_grpc.HealthStub) -> None:
    _assert_healthy(health)
