"""Tool calling in the Python client: schemas derived from models and functions, the request proto
for each option, tool and tool-calling messages, calls parsed into types, streams, batches and the
conversation helpers; against the fake server (sync and asyncio)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import pytest
from fake_gengate import RunningFake, default_responder
from gengate_client import (
    AsyncClient,
    Client,
    Enforcement,
    FinishReason,
    Message,
    OutputValidationError,
    Reasoning,
    ReasoningControl,
    Request,
    StreamAccumulator,
    StreamDelta,
    StreamEnd,
    Tool,
    ToolCall,
    run_tool_calls,
    tool,
    with_results,
)
from gengate_client import _convert as convert
from gengate_proto.v1 import generation_pb2, types_pb2
from pydantic import BaseModel, Field, field_validator


class Location(BaseModel):
    lat: float
    lon: float


class GetWeather(BaseModel):
    """Current weather at a place."""

    city: str = Field(description="City name")
    unit: Literal["c", "f"] = "c"
    where: Location | None = None

    @field_validator("city")
    @classmethod
    def not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("city is blank")
        return value


def search(
    query: str,
    limit: int = 10,
    tags: list[int] | None = None,
    mode: Literal["web", "news"] = "web",
    near: Location | None = None,
) -> list[str]:
    """Search the web
    for pages.

    Longer explanation that is not the description.

    Args:
        query: What to look for,
            over two lines.
        limit (int): The most results.
        tags: Tag ids to filter by.

    Returns:
        Page titles.
    """
    return [f"{query}:{limit}:{mode}:{tags}:{near}"]


def scale(x: int, factor: float = 0.5) -> float:
    """Scale a value.

    Parameters
    ----------
    x : int
        The value
        to scale.
    factor : float
        The factor.

    Returns
    -------
    float
        The product.
    """
    return x * factor


def now() -> str:
    return "noon"


class Opaque:
    """Not a type pydantic can describe."""


LOOKUP = Tool("lookup", "Look a key up.", {"type": "object", "properties": {"key": {"type": "string"}}})


def test_function_tool_from_signature_and_google_docstring() -> None:
    t = tool(search)
    assert t.name == "search" and t.description == "Search the web for pages."
    params = dict(t.parameters or {})
    assert "title" not in params and "description" not in params
    assert params["type"] == "object" and params["required"] == ["query"]
    props = params["properties"]
    assert list(props) == ["query", "limit", "tags", "mode", "near"]
    assert props["query"]["type"] == "string"
    assert props["query"]["description"] == "What to look for, over two lines."
    assert props["limit"] == {
        "default": 10,
        "description": "The most results.",
        "title": "Limit",
        "type": "integer",
    }
    assert props["tags"]["anyOf"] == [{"items": {"type": "integer"}, "type": "array"}, {"type": "null"}]
    assert props["tags"]["default"] is None and props["tags"]["description"] == "Tag ids to filter by."
    assert props["mode"]["enum"] == ["web", "news"] and "description" not in props["mode"]
    assert props["near"]["anyOf"][0] == {"$ref": "#/$defs/Location"}
    assert params["$defs"]["Location"]["required"] == ["lat", "lon"]
    assert "Page titles" not in json.dumps(params)


def test_function_tool_numpy_docstring_and_no_docstring() -> None:
    t = tool(scale)
    props = (t.parameters or {})["properties"]
    assert t.description == "Scale a value."
    assert props["x"]["description"] == "The value to scale."
    assert props["factor"]["description"] == "The factor." and props["factor"]["default"] == 0.5
    assert "product" not in json.dumps(t.parameters)
    bare = tool(now)
    assert bare.description == "" and bare.parameters == {"properties": {}, "type": "object"}


def test_model_tool_named_by_its_class_described_by_its_docstring() -> None:
    t = tool(GetWeather)
    schema = GetWeather.model_json_schema()
    assert t.name == "GetWeather" and t.description == "Current weather at a place."
    assert t.parameters == {k: v for k, v in schema.items() if k not in ("title", "description")}
    assert (t.parameters or {})["properties"]["city"]["description"] == "City name"
    assert "Location" in (t.parameters or {})["$defs"]


def test_tool_overrides_and_refusals() -> None:
    renamed = tool(GetWeather, name="get_weather", description="Weather.", strict=True)
    assert (renamed.name, renamed.description, renamed.strict) == ("get_weather", "Weather.", True)
    assert renamed.arguments_type is GetWeather
    assert tool(LOOKUP) is LOOKUP
    assert tool(search) is tool(search)  # derived once

    def spread(*values: int) -> None: ...

    with pytest.raises(TypeError, match=r"\*values"):
        tool(spread)
    with pytest.raises(TypeError, match="pydantic model class or a function"):
        tool(42)  # type: ignore[arg-type]

    def takes_opaque(thing: Opaque) -> None: ...

    with pytest.raises(TypeError, match="tool function takes_opaque"):
        tool(takes_opaque)

    class Local(BaseModel):
        x: int

    def takes_local(thing: Local) -> None: ...

    with pytest.raises(TypeError, match=r"takes_local: an annotation does not resolve .*Local"):
        tool(takes_local)

    @dataclass(eq=True)  # eq without frozen: instances are unhashable, so are their methods
    class Shop:
        stock: int

        def buy(self, item: str, count: int = 1) -> str:
            """Buy an item."""
            return f"{count} {item} of {self.stock}"

    bought = tool(Shop(3).buy)
    assert bought.name == "buy" and list((bought.parameters or {})["properties"]) == ["item", "count"]
    with pytest.raises(TypeError, match="tool_choice"):
        convert.build_request(Request(model="m", prompt="p", tools=[search], tool_choice=3.5))


def _built(**fields: Any) -> generation_pb2.GenerateRequest:
    return convert.build_request(Request(model="m", prompt="p", **fields))[0]


def test_request_proto_for_each_option() -> None:
    pb = _built(
        tools=[GetWeather, search, LOOKUP],
        tool_choice="required",
        parallel_tool_calls=False,
        reasoning=ReasoningControl(enabled=True, effort="high", budget_tokens=2048),
        chat_template_kwargs={"enable_thinking": False},
    )
    assert [t.name for t in pb.tools] == ["GetWeather", "search", "lookup"]
    assert json.loads(pb.tools[0].parameters_json) == tool(GetWeather).parameters
    assert list(json.loads(pb.tools[1].parameters_json)["properties"]) == [
        "query",
        "limit",
        "tags",
        "mode",
        "near",
    ]
    assert pb.tools[2].description == "Look a key up." and not pb.tools[2].strict
    assert pb.tool_choice.WhichOneof("choice") == "mode"
    assert pb.tool_choice.mode == types_pb2.TOOL_CHOICE_MODE_REQUIRED
    assert pb.HasField("parallel_tool_calls") and pb.parallel_tool_calls is False
    assert pb.reasoning.enabled is True and pb.reasoning.effort == types_pb2.REASONING_EFFORT_HIGH
    assert pb.reasoning.budget_tokens == 2048
    assert json.loads(pb.chat_template_kwargs_json) == {"enable_thinking": False}


def test_tool_choice_forms_and_unset_fields() -> None:
    assert _built(tools=[search], tool_choice="none").tool_choice.mode == types_pb2.TOOL_CHOICE_MODE_NONE
    assert _built(tools=[search], tool_choice="auto").tool_choice.mode == types_pb2.TOOL_CHOICE_MODE_AUTO
    for choice, name in (
        (search, "search"),
        (GetWeather, "GetWeather"),
        (LOOKUP, "lookup"),
        ("lookup", "lookup"),
    ):
        pb = _built(tools=[search, GetWeather, LOOKUP], tool_choice=choice)
        assert pb.tool_choice.WhichOneof("choice") == "name" and pb.tool_choice.name == name
    assert _built(tools=[Tool("auto")], tool_choice=Tool("auto")).tool_choice.name == "auto"
    plain = _built()
    assert not plain.tools and not plain.HasField("tool_choice") and not plain.HasField("parallel_tool_calls")
    assert not plain.HasField("reasoning") and plain.chat_template_kwargs_json == ""
    only_effort = _built(reasoning=ReasoningControl(effort="low")).reasoning
    assert not only_effort.HasField("enabled") and not only_effort.HasField("budget_tokens")
    assert only_effort.effort == types_pb2.REASONING_EFFORT_LOW
    assert _built(tools=[Tool("bare")]).tools[0].parameters_json == ""  # no parameters: none sent
    with pytest.raises(ValueError, match="effort"):
        _built(reasoning=ReasoningControl(effort="max"))  # type: ignore[arg-type]


def test_tool_and_tool_calling_messages(fake: RunningFake) -> None:
    call = ToolCall("call_1", "search", '{"query": "cats"}')
    with Client(fake.address) as client:
        client.generate(
            "tiny",
            messages=[
                {"role": "user", "content": "Find cats and the weather."},
                Message("assistant", tool_calls=[call], reasoning=Reasoning("think", ("sig-1",))),
                {"role": "tool", "tool_call_id": "call_1", "content": '["a cat page"]'},
                {
                    "role": "assistant",
                    "content": "Now the weather.",
                    "tool_calls": [
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "GetWeather", "arguments": "{}"},
                        },
                        {"id": "call_3", "name": "lookup", "arguments": {"key": "k"}},
                    ],
                    "reasoning": {"text": "more", "signatures": ["sig-2"]},
                },
                Message("tool", "sunny", tool_call_id="call_2"),
            ],
        )
    msgs = fake.servicer.requests[-1].messages.messages
    assert [m.role for m in msgs] == [
        types_pb2.ROLE_USER,
        types_pb2.ROLE_ASSISTANT,
        types_pb2.ROLE_TOOL,
        types_pb2.ROLE_ASSISTANT,
        types_pb2.ROLE_TOOL,
    ]
    assert list(msgs[1].content) == []  # called tools, said nothing: no empty text part
    assert msgs[1].tool_calls[0] == types_pb2.ToolCall(
        id="call_1", name="search", arguments_json='{"query": "cats"}'
    )
    assert msgs[1].reasoning.text == "think" and list(msgs[1].reasoning.signatures) == ["sig-1"]
    assert msgs[2].tool_call_id == "call_1" and msgs[2].content[0].text == '["a cat page"]'
    assert msgs[3].content[0].text == "Now the weather."
    assert [(c.id, c.name) for c in msgs[3].tool_calls] == [("call_2", "GetWeather"), ("call_3", "lookup")]
    assert json.loads(msgs[3].tool_calls[1].arguments_json) == {"key": "k"}
    assert list(msgs[3].reasoning.signatures) == ["sig-2"]
    assert msgs[4].tool_call_id == "call_2" and msgs[4].content[0].text == "sunny"
    assert not msgs[0].HasField("reasoning") and msgs[0].tool_call_id == ""


CALLS = [
    types_pb2.ToolCall(
        id="call_w", name="GetWeather", arguments_json='{"city": "Oslo", "where": {"lat": 59.9, "lon": 10.7}}'
    ),
    types_pb2.ToolCall(id="call_s", name="search", arguments_json='{"query": "cats", "tags": [1, 2]}'),
    types_pb2.ToolCall(id="call_l", name="lookup", arguments_json='{"key": "k"}'),
]


def calling(calls: list[types_pb2.ToolCall]) -> Any:
    """A responder whose first generation calls `calls`, with reasoning and signatures."""

    def respond(request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse:
        resp = default_responder(request)
        first = resp.generations[0]
        first.text = ""
        first.finish_reason = types_pb2.FINISH_REASON_TOOL_CALLS
        first.tool_calls.extend(calls)
        first.reasoning.CopyFrom(types_pb2.Reasoning(text="I should look.", signatures=["sig-a", "sig-b"]))
        resp.enforcement = types_pb2.ENFORCEMENT_NATIVE
        return resp

    return respond


def test_calls_are_parsed_into_the_tools_types(fake: RunningFake) -> None:
    fake.servicer.responder = calling(CALLS)
    with Client(fake.address) as client:
        resp = client.generate("tiny", "go", tools=[GetWeather, search, LOOKUP], n=2)
    assert resp.finish_reason is FinishReason.TOOL_CALLS and resp.enforcement is Enforcement.NATIVE
    weather, found, looked = resp.tool_calls
    assert (weather.id, weather.name) == ("call_w", "GetWeather")
    assert weather.arguments() == GetWeather(city="Oslo", where=Location(lat=59.9, lon=10.7))
    assert found.arguments() == {"query": "cats", "limit": 10, "tags": [1, 2], "mode": "web", "near": None}
    assert found.invoke() == ["cats:10:web:[1, 2]:None"]
    assert looked.arguments() == {"key": "k"} and looked.tool == LOOKUP
    assert resp.generations[0].reasoning == Reasoning("I should look.", ("sig-a", "sig-b"))
    assert resp.generations[1].tool_calls == () and resp.generations[1].reasoning is None
    with pytest.raises(TypeError, match="no Python function"):
        weather.invoke()


def test_arguments_that_do_not_parse_raise_naming_the_call(fake: RunningFake) -> None:
    fake.servicer.responder = calling(
        [
            types_pb2.ToolCall(id="call_b", name="GetWeather", arguments_json='{"city": "  "}'),
            types_pb2.ToolCall(id="call_t", name="search", arguments_json='{"query": "q", "limit": "many"}'),
            types_pb2.ToolCall(id="call_u", name="unknown", arguments_json='{"x": 1}'),
        ]
    )
    with Client(fake.address) as client:
        blank, typed, unknown = client.generate("tiny", "go", tools=[GetWeather, search]).tool_calls
    with pytest.raises(OutputValidationError, match=r"(?s)call_b.*GetWeather.*city is blank") as info:
        blank.arguments()
    assert info.value.text == '{"city": "  "}'
    with pytest.raises(OutputValidationError, match=r"(?s)call_t.*search.*limit"):
        typed.arguments()
    assert unknown.tool is None and unknown.arguments() == {"x": 1}


def test_with_results_continues_the_conversation(fake: RunningFake) -> None:
    fake.servicer.responder = calling(CALLS)
    question = [{"role": "user", "content": "go"}]
    with Client(fake.address) as client:
        resp = client.generate("tiny", messages=question, tools=[GetWeather, search, LOOKUP])
        results = {"call_l": {"value": 3}, "call_w": GetWeather(city="Oslo"), "call_s": "plain text"}
        messages = with_results(question, resp, results)
        fake.servicer.responder = default_responder
        client.generate("tiny", messages=messages, tools=[GetWeather, search, LOOKUP])
    assert messages[0] is question[0] and len(messages) == 5
    sent = fake.servicer.requests[-1].messages.messages
    assert [m.role for m in sent] == [types_pb2.ROLE_USER, types_pb2.ROLE_ASSISTANT] + [
        types_pb2.ROLE_TOOL
    ] * 3
    assert [c.id for c in sent[1].tool_calls] == ["call_w", "call_s", "call_l"]
    assert sent[1].tool_calls[0].arguments_json == CALLS[0].arguments_json
    assert (
        list(sent[1].reasoning.signatures) == ["sig-a", "sig-b"]
        and sent[1].reasoning.text == "I should look."
    )
    assert [m.tool_call_id for m in sent[2:]] == ["call_w", "call_s", "call_l"]  # in call order
    texts = [m.content[0].text for m in sent[2:]]
    assert json.loads(texts[0]) == {"city": "Oslo", "unit": "c", "where": None}
    assert texts[1] == "plain text" and json.loads(texts[2]) == {"value": 3}
    with pytest.raises(ValueError, match="call_x"):
        with_results(question, resp, {**results, "call_x": 1})
    with pytest.raises(ValueError, match=r"call_s \(search\)"):
        with_results(question, resp, {"call_w": 1, "call_l": 2})


def test_run_tool_calls_invokes_function_tools() -> None:
    only_functions = [c for c in CALLS if c.name == "search"] + [
        types_pb2.ToolCall(id="call_x", name="scale", arguments_json='{"x": 4}')
    ]
    pb = generation_pb2.GenerateResponse(
        generations=[
            types_pb2.Generation(finish_reason=types_pb2.FINISH_REASON_TOOL_CALLS, tool_calls=only_functions)
        ]
    )
    resp = convert.response(
        pb, convert.build_request(Request(model="m", prompt="p", tools=[search, scale]))[1]
    )
    assert run_tool_calls(resp) == {"call_s": ["cats:10:web:[1, 2]:None"], "call_x": 2.0}
    with_model = convert.response(
        generation_pb2.GenerateResponse(generations=[types_pb2.Generation(tool_calls=CALLS[:1])]),
        convert.build_request(Request(model="m", prompt="p", tools=[GetWeather]))[1],
    )
    with pytest.raises(TypeError, match="GetWeather"):
        run_tool_calls(with_model)


def test_stream_frames_carry_fragments_and_complete_calls(fake: RunningFake) -> None:
    fake.servicer.responder = calling(CALLS[:2])
    acc = StreamAccumulator()
    with Client(fake.address) as client:
        frames = [acc.add(f) for f in client.generate_stream("tiny", "go", tools=[GetWeather, search], n=2)]
    sent = fake.servicer.requests[-1].request
    assert [t.name for t in sent.tools] == ["GetWeather", "search"]
    deltas = [f for f in frames if isinstance(f, StreamDelta) and f.index == 0]
    assert deltas[0].reasoning == "I should look." and deltas[0].tool_calls == ()
    fragments = [d for f in deltas for d in f.tool_calls]
    assert [(d.index, d.id, d.name) for d in fragments] == [
        (0, "call_w", "GetWeather"),
        (0, "", ""),
        (1, "call_s", "search"),
        (1, "", ""),
    ]
    assert "".join(d.arguments_fragment for d in fragments if d.index == 1) == CALLS[1].arguments_json
    end = next(f for f in frames if isinstance(f, StreamEnd) and f.index == 0)
    assert end.finish_reason is FinishReason.TOOL_CALLS and end.reasoning_signatures == ("sig-a", "sig-b")
    assert end.tool_calls[0].arguments() == GetWeather(city="Oslo", where=Location(lat=59.9, lon=10.7))
    assert end.tool_calls[1].arguments()["tags"] == [1, 2]
    assert acc.tool_calls[0] == end.tool_calls and acc.tool_calls[1] == ()
    assert acc.reasoning == {0: Reasoning("I should look.", ("sig-a", "sig-b"))}
    assert acc.texts == ["", "echo 1: go"]


def test_batch_items_parse_calls_with_their_own_tools(fake: RunningFake) -> None:
    fake.servicer.responder = calling(CALLS[1:2])
    with Client(fake.address) as client:
        items = client.batch_generate(
            [
                {"model": "tiny", "prompt": "a", "tools": [search], "tool_choice": search},
                Request(model="tiny", prompt="b"),
            ]
        )
    sent = fake.servicer.requests[-1].requests
    assert [t.name for t in sent[0].tools] == ["search"] and sent[0].tool_choice.name == "search"
    assert not sent[1].tools
    assert items[0].unwrap().tool_calls[0].arguments()["query"] == "cats"
    assert items[1].unwrap().tool_calls[0].tool is None  # offered no tools: arguments as plain JSON
    assert items[1].unwrap().tool_calls[0].arguments() == {"query": "cats", "tags": [1, 2]}


def test_model_capabilities_for_tools(fake: RunningFake) -> None:
    with Client(fake.address) as client:
        tiny, remote = client.list_models()
    assert tiny.capabilities.tools is None and not tiny.capabilities.reasoning_control
    assert remote.capabilities.tools is Enforcement.NATIVE
    assert remote.capabilities.reasoning_control and remote.capabilities.reasoning


async def test_async_client_tools(fake: RunningFake) -> None:
    fake.servicer.responder = calling(CALLS[1:2])
    async with AsyncClient(fake.address) as client:
        resp = await client.generate("tiny", "go", tools=[search], parallel_tool_calls=True)
        results = run_tool_calls(resp)
        ends = [
            f async for f in client.generate_stream("tiny", "go", tools=[search]) if isinstance(f, StreamEnd)
        ]
        fake.servicer.responder = default_responder
        follow = await client.generate(
            "tiny", messages=with_results([{"role": "user", "content": "go"}], resp, results)
        )
    assert results == {"call_s": ["cats:10:web:[1, 2]:None"]}
    assert ends[0].tool_calls[0].arguments()["tags"] == [1, 2]
    assert fake.servicer.requests[0].parallel_tool_calls is True
    assert fake.servicer.requests[-1].messages.messages[2].tool_call_id == "call_s"
    assert follow.finish_reason is FinishReason.STOP
