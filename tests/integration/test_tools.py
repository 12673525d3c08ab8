"""Tool calling held at the gRPC level: a returned call always names an offered tool, its
arguments validate against the tool's schema, and together the calls honour tool_choice and
parallel_tool_calls, or the request fails (never a success). Scripted models misbehave on
purpose; what holds is the service's validation. Requests that cannot be served are refused
before any work with the field named."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from gengate.api.server import RunningServer
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from gengate_proto.v1 import types_pb2 as t
from observe import ServerFactory, error_info, field_violations, reason

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = t.Tool(
    name="get_weather", description="Weather in a city", parameters_json=json.dumps(WEATHER_SCHEMA)
)
CLOCK = t.Tool(name="get_time")  # no parameters: an empty object
PARIS = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "id": "call_w"}


def scripted(name: str, **options: Any) -> dict[str, Any]:
    return {"name": name, "backend": "scripted", **options}


MODELS = [
    scripted("caller", tool_calls=[PARIS]),
    scripted("caller-noid", tool_calls=[{"name": "get_weather", "arguments": {"city": "Oslo"}}]),
    scripted("caller-two", tool_calls=[PARIS, {"name": "get_time", "arguments": "{}", "id": "call_t"}]),
    scripted("stranger", tool_calls=[{"name": "launch_rockets", "arguments": {}}]),
    scripted("sloppy", tool_calls=[{"name": "get_weather", "arguments": {"city": 5}}]),
    scripted("extra", tool_calls=[{"name": "get_weather", "arguments": {"city": "Rome", "mood": "sunny"}}]),
    scripted("broken-json", tool_calls=[{"name": "get_weather", "arguments": '{"city": "Par'}]),
    scripted("same-id", tool_calls=[PARIS, PARIS]),
    scripted("pushy", tool_calls=[PARIS], tool_calls_when="always"),
    scripted("pushy-stop", tool_calls=[PARIS], tool_calls_when="always", finish_reason="stop"),
    scripted("engine-liar", tool_calls=[{"name": "launch_rockets"}], tools_enforcement="engine"),
    scripted("native-liar", tool_calls=[{"name": "launch_rockets"}], tools_enforcement="native"),
    scripted("says-stop", tool_calls=[PARIS], finish_reason="stop"),
    scripted("says-tools", text="no call here", finish_reason="tool_calls"),
    scripted("talker", text="just text"),
    scripted("echo"),
    scripted("no-tools", tools_enforcement=None),
]


@pytest.fixture
async def server(make_server: ServerFactory) -> RunningServer:
    return await make_server({"models": MODELS})


@pytest.fixture
async def stub(server: RunningServer) -> AsyncIterator[generation_pb2_grpc.GenerationServiceStub]:
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


def ask(model: str, tools: tuple[t.Tool, ...] = (WEATHER, CLOCK), **fields: Any) -> g.GenerateRequest:
    if "messages" not in fields:
        fields.setdefault("prompt", "weather in Paris?")
    return g.GenerateRequest(model=model, tools=list(tools), **fields)


async def stream_frames(
    stub: generation_pb2_grpc.GenerationServiceStub, request: g.GenerateRequest
) -> list[g.GenerateStreamResponse]:
    return [f async for f in stub.GenerateStream(g.GenerateStreamRequest(request=request))]


async def refusal(
    stub: generation_pb2_grpc.GenerationServiceStub, request: g.GenerateRequest
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(request)
    return caught.value


# ---- valid calls -------------------------------------------------------------------------------


async def test_a_valid_call_is_returned_with_its_id_name_arguments_and_finish_reason(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    reply = await stub.Generate(ask("caller"))
    [generation] = reply.generations
    assert generation.finish_reason == t.FINISH_REASON_TOOL_CALLS
    assert [(c.id, c.name) for c in generation.tool_calls] == [("call_w", "get_weather")]
    assert json.loads(generation.tool_calls[0].arguments_json) == {"city": "Paris", "days": 2}
    assert reply.enforcement == t.ENFORCEMENT_VALIDATED


async def test_calls_without_ids_get_unique_ones_from_the_server(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    reply = await stub.Generate(ask("caller-noid", n=3))
    ids = [gen.tool_calls[0].id for gen in reply.generations]
    assert all(i.startswith("call_") and len(i) > len("call_") for i in ids)
    assert len(set(ids)) == 3


async def test_a_stream_carries_call_fragments_then_the_complete_calls_in_the_end_frame(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    frames = await stream_frames(stub, ask("caller-two"))
    assert frames[0].start.enforcement == t.ENFORCEMENT_VALIDATED
    fragments = [c for f in frames if f.HasField("delta") for c in f.delta.tool_calls]
    assert len([c for c in fragments if c.index == 0]) >= 2  # split, not sent whole
    assembled: dict[int, str] = {}
    for fragment in fragments:
        assembled[fragment.index] = assembled.get(fragment.index, "") + fragment.arguments_fragment
    heads = {c.index: (c.id, c.name) for c in fragments if c.name}
    assert heads == {0: ("call_w", "get_weather"), 1: ("call_t", "get_time")}
    [end] = [f.end for f in frames if f.HasField("end")]
    assert end.finish_reason == t.FINISH_REASON_TOOL_CALLS
    assert [(c.id, c.name, c.arguments_json) for c in end.tool_calls] == [
        ("call_w", "get_weather", assembled[0]),
        ("call_t", "get_time", assembled[1]),
    ]


async def test_a_batch_item_returns_its_calls_and_a_bad_item_fails_alone(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    items = [ask("caller"), ask("sloppy"), ask("engine-liar"), ask("talker")]
    answers = {a.index: a async for a in stub.BatchGenerate(g.BatchGenerateRequest(requests=items))}
    assert answers[0].response.generations[0].tool_calls[0].name == "get_weather"
    assert answers[1].error.code == grpc.StatusCode.ABORTED.value[0]
    assert reason(answers[1].error) == "VALIDATION_FAILED"
    assert answers[2].error.code == grpc.StatusCode.INTERNAL.value[0]
    assert answers[3].response.generations[0].text == "just text"
    assert answers[3].response.generations[0].finish_reason == t.FINISH_REASON_STOP


async def test_a_model_that_says_stop_with_calls_is_reported_as_tool_calls(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    reply = await stub.Generate(ask("says-stop"))
    assert reply.generations[0].finish_reason == t.FINISH_REASON_TOOL_CALLS
    [end] = [f.end for f in await stream_frames(stub, ask("says-stop")) if f.HasField("end")]
    assert end.finish_reason == t.FINISH_REASON_TOOL_CALLS and len(end.tool_calls) == 1


async def test_parallel_calls_pass_unless_parallel_is_off_and_a_named_choice_is_honoured(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    reply = await stub.Generate(ask("caller-two", parallel_tool_calls=True))
    assert len(reply.generations[0].tool_calls) == 2
    named = await stub.Generate(ask("caller", tool_choice=t.ToolChoice(name="get_weather")))
    assert named.generations[0].tool_calls[0].name == "get_weather"
    required = await stub.Generate(ask("caller", tool_choice=t.ToolChoice(mode=t.TOOL_CHOICE_MODE_REQUIRED)))
    assert len(required.generations[0].tool_calls) == 1


async def test_tool_choice_none_gets_text_from_a_well_behaved_model(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    reply = await stub.Generate(ask("caller", tool_choice=t.ToolChoice(mode=t.TOOL_CHOICE_MODE_NONE)))
    assert not reply.generations[0].tool_calls
    assert reply.generations[0].finish_reason == t.FINISH_REASON_STOP


# ---- misbehaving models: never a success -----------------------------------------------------

MISBEHAVIOURS = {
    "a call to a tool not offered": ask("stranger"),
    "arguments of the wrong type": ask("sloppy"),
    "an argument the schema forbids": ask("extra"),
    "arguments that are not JSON": ask("broken-json"),
    "two calls when parallel is off": ask("caller-two", parallel_tool_calls=False),
    "two calls with one id": ask("same-id"),
    "a call under tool_choice none": ask("pushy", tool_choice=t.ToolChoice(mode=t.TOOL_CHOICE_MODE_NONE)),
    "a call when no tools are offered": ask("pushy", tools=()),
    "a call when no tools are offered, said to stop": ask("pushy-stop", tools=()),
    "a tool_calls finish without calls or tools": ask("says-tools", tools=()),
    "a call to another tool than the one named": ask("caller", tool_choice=t.ToolChoice(name="get_time")),
    "no call when one is required": ask("talker", tool_choice=t.ToolChoice(mode=t.TOOL_CHOICE_MODE_REQUIRED)),
    "no call when a named one is required": ask("talker", tool_choice=t.ToolChoice(name="get_weather")),
    "a tool_calls finish without calls": ask("says-tools"),
    "a call claimed natively enforced": ask("native-liar"),
}


@pytest.mark.parametrize("case", sorted(MISBEHAVIOURS))
async def test_an_invalid_call_is_never_a_unary_success(
    stub: generation_pb2_grpc.GenerationServiceStub, case: str
) -> None:
    error = await refusal(stub, MISBEHAVIOURS[case])
    assert (error.code(), reason(error)) == (grpc.StatusCode.ABORTED, "VALIDATION_FAILED"), error.details()
    assert "tool calls are not what the request allows" in (error.details() or "")


@pytest.mark.parametrize("case", sorted(MISBEHAVIOURS))
async def test_a_stream_with_an_invalid_call_ends_with_the_error_not_ok(
    stub: generation_pb2_grpc.GenerationServiceStub, case: str
) -> None:
    frames = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for frame in stub.GenerateStream(g.GenerateStreamRequest(request=MISBEHAVIOURS[case])):
            frames.append(frame)
    assert (caught.value.code(), reason(caught.value)) == (grpc.StatusCode.ABORTED, "VALIDATION_FAILED")
    assert frames[0].HasField("start") and not any(f.HasField("end") for f in frames)


async def test_an_engine_that_breaks_its_own_enforcement_is_an_internal_error(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    error = await refusal(stub, ask("engine-liar"))
    assert (error.code(), reason(error)) == (grpc.StatusCode.INTERNAL, "CONSTRAINT_VIOLATED")
    assert "launch_rockets" in (error.details() or "")


async def test_calls_cut_short_by_max_tokens_are_never_returned(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    cut = ask("caller", stopping=t.StoppingCriteria(max_tokens=1))
    error = await refusal(stub, cut)
    assert (error.code(), reason(error)) == (grpc.StatusCode.ABORTED, "TOOL_CALLS_INCOMPLETE")
    assert dict(error_info(error).metadata) == {"enforcement": "validated", "finish_reason": "length"}
    assert "raise stopping.max_tokens" in (error.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as streamed:
        await stream_frames(stub, cut)
    assert reason(streamed.value) == "TOOL_CALLS_INCOMPLETE"
    text = await stub.Generate(ask("talker", stopping=t.StoppingCriteria(max_tokens=1)))
    assert text.generations[0].finish_reason == t.FINISH_REASON_LENGTH  # no calls: returned as cut
    required = t.ToolChoice(mode=t.TOOL_CHOICE_MODE_REQUIRED)  # even where a call was required
    cut_text = await stub.Generate(
        ask("talker", tool_choice=required, stopping=t.StoppingCriteria(max_tokens=1))
    )
    assert cut_text.generations[0].finish_reason == t.FINISH_REASON_LENGTH


async def test_a_tool_calls_finish_without_a_call_says_so(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    error = await refusal(stub, ask("says-tools"))
    assert (error.details() or "").endswith(
        "not what the request allows: the finish reason is tool_calls but the model made no call"
    )


# ---- a conversation round trip -----------------------------------------------------------------


async def test_a_tool_result_conversation_reaches_the_model(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    """The caller's assistant turn (with its call) and the tool's result go back to the model,
    which answers text: the scripted model echoes each result with the call's id and tool name."""
    first = await stub.Generate(ask("caller"))
    call = first.generations[0].tool_calls[0]
    messages = t.ChatMessages()
    messages.messages.add(role=t.ROLE_USER).content.add(text="weather in Paris?")
    messages.messages.add(role=t.ROLE_ASSISTANT, tool_calls=[call])
    messages.messages.add(role=t.ROLE_TOOL, tool_call_id=call.id).content.add(text="18 C, sunny")
    reply = await stub.Generate(ask("caller", messages=messages))
    assert reply.generations[0].text == "call_w get_weather: 18 C, sunny"
    assert reply.generations[0].finish_reason == t.FINISH_REASON_STOP and not reply.generations[0].tool_calls


# ---- requests refused before any work ----------------------------------------------------------


def nested_schema(depth: int) -> str:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return json.dumps(schema)


def conversation(*messages: t.ChatMessage) -> t.ChatMessages:
    return t.ChatMessages(messages=list(messages))


USER = t.ChatMessage(role=t.ROLE_USER, content=[t.ContentPart(text="q")])
CALLED = t.ChatMessage(
    role=t.ROLE_ASSISTANT, tool_calls=[t.ToolCall(id="c1", name="get_weather", arguments_json="{}")]
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
BAD_REF = '{"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}'


def with_tool(**fields: Any) -> g.GenerateRequest:
    return ask("caller", tools=(t.Tool(**{"name": "f", **fields}),))


def tool_message(call_id: str = "") -> t.ChatMessage:
    return t.ChatMessage(role=t.ROLE_TOOL, tool_call_id=call_id, content=[t.ContentPart(text="r")])


def huge_call() -> t.ChatMessage:
    call = t.ToolCall(id="c1", name="f", arguments_json="x" * 5_000_000)
    return t.ChatMessage(role=t.ROLE_ASSISTANT, tool_calls=[call])


USER_CALLING = t.ChatMessage(
    role=t.ROLE_USER, content=[t.ContentPart(text="q")], tool_calls=[t.ToolCall(id="c1", name="f")]
)
REQUIRED = t.ToolChoice(mode=t.TOOL_CHOICE_MODE_REQUIRED)

# case: (request, code, reason ("": any), the field that must be named)
REFUSALS: dict[str, tuple[g.GenerateRequest, grpc.StatusCode, str, str]] = {
    "bad name": (with_tool(name="no spaces"), INVALID, "INVALID_REQUEST", "tools[0].name"),
    "empty name": (ask("caller", tools=(WEATHER, t.Tool())), INVALID, "INVALID_REQUEST", "tools[1].name"),
    "duplicate": (
        ask("caller", tools=(WEATHER, CLOCK, WEATHER)),
        INVALID,
        "INVALID_REQUEST",
        "tools[2].name",
    ),
    "129 tools": (
        ask("caller", tools=tuple(t.Tool(name=f"t{i}") for i in range(129))),
        INVALID,
        "LIMIT_EXCEEDED",
        "tools",
    ),
    "parameters not JSON": (
        with_tool(parameters_json="{nope"),
        INVALID,
        "INVALID_SCHEMA",
        "tools[0].parameters_json",
    ),
    "parameters an array": (
        ask("caller", tools=(CLOCK, t.Tool(name="f", parameters_json="[]"))),
        INVALID,
        "INVALID_SCHEMA",
        "tools[1].parameters_json",
    ),
    "parameters not an object schema": (
        with_tool(parameters_json='{"type": "string"}'),
        INVALID,
        "INVALID_REQUEST",
        "tools[0].parameters_json",
    ),
    "parameters too big": (
        with_tool(parameters_json='{"description": "' + "x" * 600_000 + '"}'),
        INVALID,
        "LIMIT_EXCEEDED",
        "tools[0].parameters_json",
    ),
    "parameters too deep": (
        with_tool(parameters_json=nested_schema(70)),
        INVALID,
        "LIMIT_EXCEEDED",
        "tools[0].parameters_json",
    ),
    "parameters with a broken $ref": (
        with_tool(parameters_json=BAD_REF),
        INVALID,
        "",
        "tools[0].parameters_json",
    ),
    "description too big": (
        with_tool(description="d" * 600_000),
        INVALID,
        "LIMIT_EXCEEDED",
        "tools[0].description",
    ),
    "tool_choice names an unknown tool": (
        ask("caller", tool_choice=t.ToolChoice(name="nope")),
        INVALID,
        "INVALID_REQUEST",
        "tool_choice.name",
    ),
    "tool_choice without tools": (
        ask("caller", tools=(), tool_choice=REQUIRED),
        INVALID,
        "INVALID_REQUEST",
        "tool_choice",
    ),
    "parallel_tool_calls without tools": (
        ask("caller", tools=(), parallel_tool_calls=False),
        INVALID,
        "INVALID_REQUEST",
        "parallel_tool_calls",
    ),
    "tools and structured_output": (
        ask("caller", structured_output=t.StructuredOutput(json_object=t.JsonObject())),
        INVALID,
        "INVALID_REQUEST",
        "structured_output",
    ),
    "tool message without tool_call_id": (
        ask("caller", messages=conversation(USER, CALLED, tool_message())),
        INVALID,
        "INVALID_REQUEST",
        "messages.messages[2].tool_call_id",
    ),
    "tool message with unknown tool_call_id": (
        ask("caller", messages=conversation(USER, CALLED, tool_message("c9"))),
        INVALID,
        "INVALID_REQUEST",
        "messages.messages[2].tool_call_id",
    ),
    "tool calls on a user message": (
        ask("caller", messages=conversation(USER_CALLING)),
        INVALID,
        "INVALID_REQUEST",
        "messages.messages[0].tool_calls",
    ),
    "tool call arguments over max_prompt_bytes": (
        ask("caller", messages=conversation(USER, huge_call())),
        INVALID,
        "LIMIT_EXCEEDED",
        "messages",
    ),
    "tools to a model without tools": (ask("no-tools"), UNIMPLEMENTED, "TOOLS_UNSUPPORTED", "tools"),
    "a tool conversation to a model without tools": (
        ask("no-tools", tools=(), messages=conversation(USER, CALLED)),
        UNIMPLEMENTED,
        "TOOLS_UNSUPPORTED",
        "messages.messages[1].tool_calls",
    ),
    "reasoning to a model without it": (
        ask("caller", tools=(), reasoning=t.ReasoningControl(effort=t.REASONING_EFFORT_HIGH)),
        UNIMPLEMENTED,
        "REASONING_UNSUPPORTED",
        "reasoning",
    ),
    "chat template variables to a model that renders no template": (
        ask("caller", tools=(), chat_template_kwargs_json='{"enable_thinking": false}'),
        UNIMPLEMENTED,
        "CHAT_TEMPLATE_KWARGS_UNSUPPORTED",
        "chat_template_kwargs_json",
    ),
    "chat template variables not an object": (
        ask("caller", tools=(), chat_template_kwargs_json="[1]"),
        INVALID,
        "INVALID_JSON",
        "chat_template_kwargs_json",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
async def test_a_request_that_cannot_be_served_is_refused_with_the_field_named(
    stub: generation_pb2_grpc.GenerationServiceStub, case: str
) -> None:
    request, code, why, field = REFUSALS[case]
    error = await refusal(stub, request)
    assert error.code() == code, error.details()
    if why:
        assert reason(error) == why, error.details()
    assert field in field_violations(error), (field_violations(error), error.details())
    assert len((error.details() or "").encode()) <= 1024  # a 600 KB input is not echoed back
    with pytest.raises(grpc.aio.AioRpcError) as streamed:
        await stream_frames(stub, request)
    assert streamed.value.code() == code
    assert "request." + field in field_violations(streamed.value)
    answers = [a async for a in stub.BatchGenerate(g.BatchGenerateRequest(requests=[ask("caller"), request]))]
    by_index = {a.index: a for a in answers}
    assert by_index[0].response.generations[0].tool_calls
    assert by_index[1].error.code == code.value[0]
    assert "requests[1]." + field in field_violations(by_index[1].error)


async def test_the_tiny_local_model_calls_tools_its_engine_enforces(make_server: ServerFactory) -> None:
    """llama.cpp on the tiny model through the real server: its random weights write nonsense, so
    well-formed calls of the named tool (and one call where parallel calls are off) are the
    grammar's doing, and the server's re-validation lets them through."""
    pytest.importorskip("llama_cpp")
    server = await make_server({"models": [{"name": "tiny", "backend": "llamacpp", "tiny": True}]})
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        models = await stub.ListModels(g.ListModelsRequest())
        assert models.models[0].capabilities.tools == t.ENFORCEMENT_ENGINE
        room = t.StoppingCriteria(max_tokens=96)
        for seed in range(3):
            named = ask(
                "tiny",
                tool_choice=t.ToolChoice(name="get_time"),
                sampling=t.SamplingParams(seed=seed),
                stopping=room,
            )
            reply = await stub.Generate(named)
            assert reply.enforcement == t.ENFORCEMENT_ENGINE
            [generation] = reply.generations
            assert generation.finish_reason == t.FINISH_REASON_TOOL_CALLS
            assert generation.tool_calls and {c.name for c in generation.tool_calls} == {"get_time"}
            assert all(json.loads(c.arguments_json) == {} for c in generation.tool_calls)
        one = ask(
            "tiny",
            tool_choice=t.ToolChoice(mode=t.TOOL_CHOICE_MODE_REQUIRED),
            parallel_tool_calls=False,
            sampling=t.SamplingParams(seed=1),
            stopping=room,
        )
        frames = await stream_frames(stub, one)
        [end] = [f.end for f in frames if f.HasField("end")]
        assert end.finish_reason == t.FINISH_REASON_TOOL_CALLS and len(end.tool_calls) == 1
        assert end.tool_calls[0].name in ("get_weather", "get_time")
        heads = [(c.id, c.name) for f in frames if f.HasField("delta") for c in f.delta.tool_calls if c.name]
        assert heads == [(end.tool_calls[0].id, end.tool_calls[0].name)]


async def test_list_models_says_how_each_model_enforces_tools(
    stub: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    models = {m.name: m.capabilities for m in (await stub.ListModels(g.ListModelsRequest())).models}
    assert models["caller"].tools == t.ENFORCEMENT_VALIDATED
    assert models["engine-liar"].tools == t.ENFORCEMENT_ENGINE
    assert models["no-tools"].tools == t.ENFORCEMENT_UNSPECIFIED
    assert not models["caller"].reasoning_control
