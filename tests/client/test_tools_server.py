"""The client's tool calling against a real gengate server (port 0) with scripted models: schemas
derived from functions and models are accepted and enforced by the server, calls come back typed,
a conversation continues with the results, and refusals name the field. Blocking calls run in a
worker thread, so the server keeps its own loop."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from gengate.api.server import RunningServer
from gengate_client import (
    AbortedError,
    AsyncClient,
    Client,
    Enforcement,
    FinishReason,
    InvalidArgumentError,
    ReasoningControl,
    StreamAccumulator,
    StreamDelta,
    UnimplementedError,
    run_tool_calls,
    tool,
    with_results,
)
from observe import ServerFactory
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).parent.parent / "providers"))

import fake_openai


class Location(BaseModel):
    lat: float
    lon: float


class GetWeather(BaseModel):
    """Current weather at a place."""

    city: str
    unit: Literal["c", "f"] = "c"
    where: Location | None = None


def search(query: str, limit: int = 10, tags: list[int] | None = None) -> list[str]:
    """Search the web.

    Args:
        query: What to look for.
        limit: The most results.
        tags: Tag ids.
    """
    return [f"{query} page {i}" for i in range(min(limit, 2))]


SEARCH_CALL = {"id": "call_s", "name": "search", "arguments": {"query": "cats", "tags": [1, 2]}}
WEATHER_CALL = {
    "id": "call_w",
    "name": "GetWeather",
    "arguments": {"city": "Oslo", "where": {"lat": 59.9, "lon": 10.7}},
}


def scripted(name: str, **options: Any) -> dict[str, Any]:
    return {"name": name, "backend": "scripted", **options}


MODELS = [
    scripted("searcher", tool_calls=[SEARCH_CALL]),
    scripted("both", tool_calls=[WEATHER_CALL, SEARCH_CALL]),
    scripted("sloppy", tool_calls=[{"name": "search", "arguments": {"query": "q", "limit": "many"}}]),
    scripted("no-tools", tools_enforcement=None),
]


@pytest.fixture
async def server(make_server: ServerFactory) -> RunningServer:
    return await make_server({"models": MODELS})


async def test_function_tool_round_trip_blocking_client(server: RunningServer) -> None:
    def converse() -> tuple[Any, Any, Any]:
        with Client(server.address, timeout=30) as client:
            question = [{"role": "user", "content": "find cats"}]
            first = client.generate("searcher", messages=question, tools=[search])
            results = run_tool_calls(first)
            second = client.generate(
                "searcher", messages=with_results(question, first, results), tools=[search]
            )
            return first, results, second

    first, results, second = await asyncio.to_thread(converse)
    assert first.finish_reason is FinishReason.TOOL_CALLS and first.enforcement is Enforcement.VALIDATED
    (call,) = first.tool_calls
    assert (call.id, call.name) == ("call_s", "search")
    assert call.arguments() == {"query": "cats", "limit": 10, "tags": [1, 2]}
    assert results == {"call_s": ["cats page 0", "cats page 1"]}
    # After a tool result the scripted model answers the results it was given, one line each.
    assert second.finish_reason is FinishReason.STOP and second.tool_calls == ()
    assert second.text == 'call_s search: ["cats page 0","cats page 1"]'


async def test_model_tools_stream_and_batch_async_client(server: RunningServer) -> None:
    async with AsyncClient(server.address, timeout=30) as client:
        resp = await client.generate("both", "weather and cats", tools=[GetWeather, search])
        acc = StreamAccumulator()
        frames = [
            acc.add(f) async for f in client.generate_stream("both", "again", tools=[GetWeather, search])
        ]
        items = await client.batch_generate(
            [
                {"model": "both", "prompt": "a", "tools": [GetWeather, search]},
                {"model": "searcher", "prompt": "b", "tools": [search], "tool_choice": "none"},
            ]
        )
    weather, found = resp.tool_calls
    assert weather.arguments() == GetWeather(city="Oslo", where=Location(lat=59.9, lon=10.7))
    assert found.arguments()["tags"] == [1, 2]
    fragments = [d for f in frames if isinstance(f, StreamDelta) for d in f.tool_calls]
    assert {d.name for d in fragments if d.id} == {"GetWeather", "search"}
    for position, call in enumerate(acc.tool_calls[0]):
        assert "".join(d.arguments_fragment for d in fragments if d.index == position) == call.arguments_json
    assert acc.tool_calls[0][0].arguments() == weather.arguments()
    assert acc.finish_reasons[0] is FinishReason.TOOL_CALLS
    assert items[0].unwrap().tool_calls[1].arguments()["query"] == "cats"
    assert items[1].unwrap().tool_calls == () and items[1].unwrap().text == "b"  # tool_choice none


async def test_server_enforces_the_derived_schema_and_names_bad_fields(server: RunningServer) -> None:
    async with AsyncClient(server.address, timeout=30) as client:
        caps = {m.name: m.capabilities for m in await client.list_models()}
        with pytest.raises(AbortedError) as invalid_call:
            await client.generate("sloppy", "q", tools=[search])  # "limit": "many" is not an integer
        with pytest.raises(InvalidArgumentError) as bad_name:
            await client.generate("searcher", "q", tools=[tool(search, name="bad name!")])
        with pytest.raises(InvalidArgumentError) as unknown_choice:
            await client.generate("searcher", "q", tools=[search], tool_choice=GetWeather)
        with pytest.raises(UnimplementedError) as no_tools:
            await client.generate("no-tools", "q", tools=[search])
        with pytest.raises(UnimplementedError) as no_reasoning:
            await client.generate("searcher", "q", reasoning=ReasoningControl(effort="low"))
        with pytest.raises(UnimplementedError) as no_kwargs:
            await client.generate("searcher", "q", chat_template_kwargs={"enable_thinking": False})
    assert caps["searcher"].tools is Enforcement.VALIDATED and caps["no-tools"].tools is None
    assert invalid_call.value.reason == "VALIDATION_FAILED"
    assert [v.field for v in bad_name.value.field_violations] == ["tools[0].name"]
    assert [v.field for v in unknown_choice.value.field_violations] == ["tool_choice.name"]
    assert no_tools.value.reason == "TOOLS_UNSUPPORTED"
    assert [v.field for v in no_reasoning.value.field_violations] == ["reasoning"]
    assert [v.field for v in no_kwargs.value.field_violations] == ["chat_template_kwargs_json"]


@pytest.fixture
def upstream() -> Iterator[fake_openai.FakeOpenAI]:
    pytest.importorskip("openai", reason="the openai SDK is not installed (extra: gengate[openai])")
    fake = fake_openai.FakeOpenAI()
    fake.start()
    yield fake
    fake.stop()


async def test_tools_reach_an_openai_upstream_natively(
    make_server: ServerFactory, upstream: fake_openai.FakeOpenAI
) -> None:
    gpt = {
        "name": "gpt",
        "backend": "openai",
        "model": "gpt-fake",
        "base_url": upstream.server.base_url + "/v1",
        "api_key": fake_openai.API_KEY,
    }
    server = await make_server({"models": [gpt]})
    upstream.calls.append([("GetWeather", json.dumps(WEATHER_CALL["arguments"]))])
    upstream.reasoning = "Oslo is cold"
    question = [{"role": "user", "content": "weather in Oslo?"}]
    async with AsyncClient(server.address, timeout=30) as client:
        first = await client.generate(
            "gpt",
            messages=question,
            tools=[GetWeather, search],
            tool_choice=GetWeather,
            parallel_tool_calls=False,
            reasoning=ReasoningControl(effort="low"),
        )
        (call,) = first.tool_calls
        weather = call.arguments()
        upstream.reasoning = None
        second = await client.generate(
            "gpt",
            messages=with_results(question, first, {call.id: {"temp_c": -3}}),
            tools=[GetWeather, search],
        )
    asked, answered = (r.body for r in upstream.server.requests)
    assert [t["function"]["name"] for t in asked["tools"]] == ["GetWeather", "search"]
    assert asked["tools"][1]["function"]["description"] == "Search the web."
    assert asked["tools"][1]["function"]["parameters"] == tool(search).parameters
    assert asked["tool_choice"] == {"type": "function", "function": {"name": "GetWeather"}}
    assert asked["parallel_tool_calls"] is False and asked["reasoning_effort"] == "low"
    assert first.finish_reason is FinishReason.TOOL_CALLS and first.enforcement is Enforcement.NATIVE
    assert weather == GetWeather(city="Oslo", where=Location(lat=59.9, lon=10.7))
    assert (
        first.generations[0].reasoning is not None and first.generations[0].reasoning.text == "Oslo is cold"
    )
    assistant, result = answered["messages"][1:]
    assert assistant["role"] == "assistant" and assistant["tool_calls"][0]["id"] == call.id
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == WEATHER_CALL["arguments"]
    assert result == {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c":-3}'}
    assert second.finish_reason is FinishReason.STOP and second.text
