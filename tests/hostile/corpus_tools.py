"""The hostile-input corpus's tool-calling cases (corpus.py adds them to CASES): tool schemas
are constraints and get the same bombs, tool inputs the same size limits, and hostile tool
calls the same linear, bounded validation. Plain tuples, so this module needs nothing of
corpus.py: (name, request builder, code, reason, field, rpc, batch item codes).

Models (in corpus.SERVER_CONFIG): `tooly` answers a call whose argument is the backtracking
probe's worst case; `tooly-deep` answers arguments nested 50,000 deep, claiming ENGINE
enforcement (too deep to validate is ABORTED, not a server fault).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import types_pb2 as t

INVALID = grpc.StatusCode.INVALID_ARGUMENT
LIMIT = "LIMIT_EXCEEDED"
PARAMETERS = "tools[0].parameters_json"
PROBE = "a" * 27 + "!"
DEEP_ARGUMENTS = '{"a":' * 50_000 + "1" + "}" * 50_000

TOOL_MODELS: list[dict[str, Any]] = [
    {"name": "tooly", "backend": "scripted", "tool_calls": [{"name": "f", "arguments": {"a": PROBE}}]},
    {
        "name": "tooly-deep",
        "backend": "scripted",
        "tool_calls": [{"name": "f", "arguments": DEEP_ARGUMENTS}],
        "tools_enforcement": "engine",
    },
]

ToolCase = tuple[
    str, Callable[[], Any], grpc.StatusCode, str | None, str | None, str, dict[int, grpc.StatusCode]
]


def ask(model: str = "tooly", *tools: t.Tool, **fields: Any) -> g.GenerateRequest:
    if "messages" not in fields:
        fields.setdefault("prompt", "Answer:")
    fields.setdefault("stopping", t.StoppingCriteria(max_tokens=8))
    return g.GenerateRequest(model=model, tools=list(tools), **fields)


def with_schema(schema: Any, model: str = "tooly") -> g.GenerateRequest:
    return ask(model, t.Tool(name="f", parameters_json=json.dumps(schema)))


def with_arguments_pattern(pattern: str, model: str = "tooly") -> g.GenerateRequest:
    return with_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}, model)


def object_with(value: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": value}}


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = object_with(schema)
    return schema


def ref_chain(length: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length)}
    defs[f"d{length}"] = {"type": "string"}
    return {**object_with({"$ref": "#/$defs/d0"}), "$defs": defs}


def conversation(*messages: t.ChatMessage) -> t.ChatMessages:
    return t.ChatMessages(
        messages=[t.ChatMessage(role=t.ROLE_USER, content=[t.ContentPart(text="q")]), *messages]
    )


def calls(count: int, arguments: str = "{}") -> t.ChatMessage:
    made = [t.ToolCall(id=f"c{i}", name="f", arguments_json=arguments) for i in range(count)]
    return t.ChatMessage(role=t.ROLE_ASSISTANT, tool_calls=made)


def result(text: str, call_id: str = "c0") -> t.ChatMessage:
    return t.ChatMessage(role=t.ROLE_TOOL, tool_call_id=call_id, content=[t.ContentPart(text=text)])


F = t.Tool(name="f")


def _case(
    name: str,
    request: Callable[[], Any],
    code: grpc.StatusCode,
    reason: str | None = None,
    field: str | None = None,
    rpc: str = "generate",
    items: dict[int, grpc.StatusCode] | None = None,
) -> ToolCase:
    return (name, request, code, reason, field, rpc, items or {})


TOOL_CASES: list[ToolCase] = [
    # ---- counts and sizes, before anything reads a schema ---------------------------------------
    _case(
        "tools 129",
        lambda: ask("tooly", *[t.Tool(name=f"f{i}") for i in range(129)]),
        INVALID,
        LIMIT,
        "tools",
    ),
    _case("tools 20,000", lambda: ask("tooly", *[F] * 20_000), INVALID, LIMIT, "tools"),
    _case(
        "tool parameters_json 600 KB",
        lambda: ask("tooly", t.Tool(name="f", parameters_json='{"x": "' + "x" * 600_000 + '"}')),
        INVALID,
        LIMIT,
        PARAMETERS,
    ),
    _case(
        "tool parameters_json 200,000 nested brackets",
        lambda: ask("tooly", t.Tool(name="f", parameters_json="[" * 200_000 + "]" * 200_000)),
        INVALID,
        LIMIT,
        PARAMETERS,
    ),
    _case(
        "tool parameters_json not JSON",
        lambda: ask("tooly", t.Tool(name="f", parameters_json="{nope")),
        INVALID,
        "INVALID_SCHEMA",
        PARAMETERS,
    ),
    _case(
        "tool parameters_json a 5,000-digit integer",
        lambda: ask("tooly", t.Tool(name="f", parameters_json='{"maximum": 1' + "0" * 5000 + "}")),
        INVALID,
        "INVALID_SCHEMA",
        PARAMETERS,
    ),
    _case("tool name 10 KB", lambda: ask("tooly", t.Tool(name="n" * 10_000)), INVALID, None, "tools[0].name"),
    _case(
        "tool description 600 KB",
        lambda: ask("tooly", t.Tool(name="f", description="d" * 600_000)),
        INVALID,
        LIMIT,
        "tools[0].description",
    ),
    _case(
        "tool_choice naming a 100 KB tool",
        lambda: ask("tooly", F, tool_choice=t.ToolChoice(name="x" * 100_000)),
        INVALID,
        None,
        "tool_choice.name",
    ),
    _case(
        "tool result 5 MB",
        lambda: ask("tooly", F, messages=conversation(calls(1), result("r" * 5_000_000))),
        INVALID,
        LIMIT,
        "messages",
    ),
    _case(
        "assistant turn with 10,000 calls",
        lambda: ask("tooly", F, messages=conversation(calls(10_000))),
        INVALID,
        LIMIT,
        "messages.messages[1].tool_calls",
    ),
    _case(
        "tool call arguments 5 MB sent back",
        lambda: ask("tooly", F, messages=conversation(calls(1, "x" * 5_000_000))),
        INVALID,
        LIMIT,
        "messages",
    ),
    _case(
        "chat_template_kwargs 100 KB",
        lambda: ask("tooly", chat_template_kwargs_json='{"k": "' + "x" * 100_000 + '"}'),
        INVALID,
        LIMIT,
        "chat_template_kwargs_json",
    ),
    _case(
        "chat_template_kwargs 30,000 nested",
        lambda: ask("tooly", chat_template_kwargs_json='{"k": ' + "[" * 30_000 + "]" * 30_000 + "}"),
        INVALID,
        LIMIT,
        "chat_template_kwargs_json",
    ),
    # ---- tool schemas are constraints: the same bombs, the same sandbox ----------------------------
    _case("tool schema nested 300 deep", lambda: with_schema(nested(300)), INVALID, LIMIT, PARAMETERS),
    _case("tool schema $ref chain 5,000", lambda: with_schema(ref_chain(5000)), INVALID, LIMIT, PARAMETERS),
    _case(  # a recursive schema is a fine schema: the call is checked against it all the same
        "tool schema recursive through $ref #",
        lambda: with_schema(object_with({"$ref": "#"})),
        grpc.StatusCode.ABORTED,
        "VALIDATION_FAILED",
    ),
    _case(
        "tool schema $ref to nowhere",
        lambda: with_schema(object_with({"$ref": "#/$defs/missing"})),
        INVALID,
        None,
        PARAMETERS,
    ),
    _case(
        "tool schema pattern bomb",
        lambda: with_arguments_pattern("((a{1000}){1000}){1000}"),
        INVALID,
        LIMIT,
        PARAMETERS + "/properties/a/pattern",
    ),
    _case(
        "tool schema type 5",
        lambda: with_schema(object_with({"type": 5})),
        INVALID,
        "INVALID_SCHEMA",
        PARAMETERS,
    ),
    _case(
        "tool schema a string, not an object",
        lambda: with_schema({"type": "string"}),
        INVALID,
        "INVALID_REQUEST",
        PARAMETERS,
    ),
    _case(
        "tool schema on a model that takes no tools",
        lambda: with_schema(nested(2), model="deep"),
        grpc.StatusCode.UNIMPLEMENTED,
        "TOOLS_UNSUPPORTED",
        "tools",
    ),
    # ---- hostile returned calls: validated in linear time, never a success -----------------------
    _case(
        "tool call vs pattern (a|aa)+$", lambda: with_arguments_pattern("^(a|aa)+$"), grpc.StatusCode.ABORTED
    ),
    _case("tool call vs pattern (a+)+b", lambda: with_arguments_pattern("(a+)+b"), grpc.StatusCode.ABORTED),
    _case(
        "tool call arguments nested 50,000 deep",
        lambda: with_schema({"type": "object"}, model="tooly-deep"),
        grpc.StatusCode.ABORTED,
        "VALIDATION_FAILED",
    ),
    # ---- streams and batches -----------------------------------------------------------------------
    _case(
        "stream tools 129",
        lambda: g.GenerateStreamRequest(request=ask("tooly", *[t.Tool(name=f"f{i}") for i in range(129)])),
        INVALID,
        LIMIT,
        "request.tools",
        rpc="stream",
    ),
    _case(
        "stream tool call vs pattern (a|a)+$",
        lambda: g.GenerateStreamRequest(request=with_arguments_pattern("^(a|a)+$")),
        grpc.StatusCode.ABORTED,
        rpc="stream",
    ),
    _case(
        "batch hostile tool items beside good ones",
        lambda: g.BatchGenerateRequest(
            requests=[
                ask("tooly", F),
                with_schema(ref_chain(5000)),
                with_arguments_pattern("^(a|aa)+$"),
                ask("tooly", *[F] * 20_000),
                with_schema({"type": "object"}, model="tooly-deep"),
                ask("tooly"),
            ]
        ),
        grpc.StatusCode.OK,
        rpc="batch",
        items={
            0: grpc.StatusCode.ABORTED,  # `f` takes no arguments: {"a": ...} is refused
            1: INVALID,
            2: grpc.StatusCode.ABORTED,
            3: INVALID,
            4: grpc.StatusCode.ABORTED,
            5: grpc.StatusCode.OK,  # no tools: tooly answers text
        },
    ),
]
