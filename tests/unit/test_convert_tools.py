"""Round trips of the tool-calling and reasoning fields between protobuf and domain objects, and
the named errors of their JSON-as-text fields."""

from __future__ import annotations

import pytest
from gengate import domain as d
from gengate.api import convert
from gengate.api.convert_tools import MAX_CHAT_TEMPLATE_KWARGS_BYTES
from gengate.errors import InvalidArgument
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import types_pb2 as t

WEATHER = d.Tool(
    name="get_weather",
    description="Weather in a city",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 9007199254740993}},
        "required": ["city"],
    },
    strict=True,
)
CONVERSATION = (
    d.ChatMessage(d.Role.USER, (d.TextPart("weather in Paris?"),)),
    d.ChatMessage(
        d.Role.ASSISTANT,
        (),
        tool_calls=(d.ToolCall("call_1", "get_weather", '{"city": "Paris"}'),),
        reasoning=d.Reasoning("the user wants weather", ("sig-a", "sig-b")),
    ),
    d.ChatMessage(d.Role.TOOL, (d.TextPart("18 C"),), tool_call_id="call_1"),
)

REQUESTS = [
    d.GenerationRequest(model="m", prompt="p", tools=(WEATHER, d.Tool(name="noop"))),
    d.GenerationRequest(
        model="m",
        messages=CONVERSATION,
        tools=(WEATHER,),
        tool_choice=d.ToolChoice(name="get_weather"),
        parallel_tool_calls=False,
        reasoning=d.ReasoningControl(enabled=True, effort=d.ReasoningEffort.HIGH, budget_tokens=0),
        chat_template_kwargs={"enable_thinking": False, "depth": {"a": [1, 2]}},
    ),
    d.GenerationRequest(
        model="m", prompt="p", tools=(WEATHER,), tool_choice=d.ToolChoice(mode=d.ToolChoiceMode.REQUIRED)
    ),
    d.GenerationRequest(
        model="m", prompt="p", tools=(WEATHER,), tool_choice=d.ToolChoice(mode=d.ToolChoiceMode.NONE)
    ),
    d.GenerationRequest(model="m", prompt="p", reasoning=d.ReasoningControl()),
    d.GenerationRequest(model="m", prompt="p", parallel_tool_calls=True),
]


@pytest.mark.parametrize("request_", REQUESTS)
def test_tool_request_round_trip(request_: d.GenerationRequest) -> None:
    wire = convert.request_to_pb(request_).SerializeToString()
    assert convert.request_from_pb(g.GenerateRequest.FromString(wire)) == request_


def test_unset_tool_fields_stay_unset() -> None:
    back = convert.request_from_pb(g.GenerateRequest(model="m", prompt="x"))
    assert back.tools == () and back.tool_choice is None and back.parallel_tool_calls is None
    assert back.reasoning is None and back.chat_template_kwargs == {}


def test_parameters_json_keeps_order_and_big_integers_and_empty_means_no_parameters() -> None:
    msg = g.GenerateRequest(
        model="m",
        prompt="p",
        tools=[
            t.Tool(
                name="a",
                parameters_json='{"type": "object", "properties": '
                '{"z": {}, "b": {"maximum": 12345678901234567890}}}',
            ),
            t.Tool(name="b"),
        ],
    )
    tools = convert.request_from_pb(msg).tools
    assert list(tools[0].parameters["properties"]) == ["z", "b"]
    assert tools[0].parameters["properties"]["b"]["maximum"] == 12345678901234567890
    assert tools[1].parameters == {}


def test_an_empty_tool_choice_is_not_set_and_an_unknown_mode_is_named() -> None:
    empty = g.GenerateRequest(model="m", prompt="p", tool_choice=t.ToolChoice())
    assert convert.request_from_pb(empty).tool_choice is None
    unspecified = g.GenerateRequest(model="m", prompt="p", tool_choice=t.ToolChoice(mode=0))
    assert convert.request_from_pb(unspecified).tool_choice is None
    bad = g.GenerateRequest(model="m", prompt="p", tool_choice=t.ToolChoice(mode=42))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as caught:
        convert.request_from_pb(bad, prefix="requests[3].")
    assert caught.value.violations[0].field == "requests[3].tool_choice.mode"
    assert caught.value.reason == "INVALID_ENUM"


def test_an_unknown_reasoning_effort_is_named() -> None:
    bad = g.GenerateRequest(model="m", prompt="p", reasoning=t.ReasoningControl(effort=9))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as caught:
        convert.request_from_pb(bad)
    assert caught.value.violations[0].field == "reasoning.effort"


@pytest.mark.parametrize(
    ("text", "reason", "says"),
    [
        ("{not json", "INVALID_SCHEMA", "not valid JSON"),
        ("[1, 2]", "INVALID_SCHEMA", "must be a JSON object"),
        ('"object"', "INVALID_SCHEMA", "must be a JSON object"),
        ("[" * 100_000 + "]" * 100_000, "LIMIT_EXCEEDED", "nested too deeply"),
        ('{"maximum": 1' + "0" * 5000 + "}", "INVALID_SCHEMA", "cannot be read"),
    ],
)
def test_bad_parameters_json_names_the_tool(text: str, reason: str, says: str) -> None:
    msg = g.GenerateRequest(
        model="m",
        prompt="p",
        tools=[t.Tool(name="ok", parameters_json="{}"), t.Tool(name="bad", parameters_json=text)],
    )
    with pytest.raises(InvalidArgument) as caught:
        convert.request_from_pb(msg, prefix="requests[2].")
    assert [v.field for v in caught.value.violations] == ["requests[2].tools[1].parameters_json"]
    assert caught.value.reason == reason and says in caught.value.message


def test_parameters_json_over_the_limit_is_refused_before_it_is_read() -> None:
    text = "{" * 2000  # not JSON either: the size is what is reported
    msg = g.GenerateRequest(model="m", prompt="p", tools=[t.Tool(name="big", parameters_json=text)])
    with pytest.raises(InvalidArgument) as caught:
        convert.request_from_pb(msg, max_schema_json_bytes=1000)
    assert caught.value.reason == "LIMIT_EXCEEDED"
    assert caught.value.violations[0].field == "tools[0].parameters_json"
    assert "max_constraint_bytes" in caught.value.message


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("nope", "INVALID_JSON"),
        ("[true]", "INVALID_JSON"),
        ('{"k": "' + "x" * MAX_CHAT_TEMPLATE_KWARGS_BYTES + '"}', "LIMIT_EXCEEDED"),
    ],
)
def test_bad_chat_template_kwargs_are_named(text: str, reason: str) -> None:
    msg = g.GenerateStreamRequest(
        request=g.GenerateRequest(model="m", prompt="p", chat_template_kwargs_json=text)
    )
    with pytest.raises(InvalidArgument) as caught:
        convert.request_from_pb(msg.request, prefix="request.")
    assert caught.value.violations[0].field == "request.chat_template_kwargs_json"
    assert caught.value.reason == reason


def test_role_tool_converts_and_an_unknown_role_names_the_message() -> None:
    msg = g.GenerateRequest(model="m")
    msg.messages.messages.add(role=t.ROLE_TOOL, tool_call_id="c").content.add(text="r")
    assert convert.request_from_pb(msg).messages[0].role is d.Role.TOOL  # type: ignore[index]
    msg.messages.messages.add(role=9)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="ROLE_TOOL") as caught:
        convert.request_from_pb(msg)
    assert caught.value.violations[0].field == "messages.messages[1].role"


def test_result_with_tool_calls_and_reasoning_round_trips() -> None:
    result = d.GenerationResult(
        request_id="r",
        model="m",
        generations=(
            d.Generation(
                0,
                "",
                d.FinishReason.TOOL_CALLS,
                5,
                tool_calls=(
                    d.ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
                    d.ToolCall("call_2", "noop", "{}"),
                ),
                reasoning=d.Reasoning("thinking", ("sig",)),
            ),
            d.Generation(1, "plain", d.FinishReason.STOP, 1, reasoning=d.Reasoning("")),
            d.Generation(2, "none", d.FinishReason.STOP, 1),
        ),
        usage=d.Usage(3, 7),
        enforcement=d.Enforcement.VALIDATED,
    )
    back = convert.result_from_pb(
        g.GenerateResponse.FromString(convert.result_to_pb(result).SerializeToString())
    )
    assert back == result


def test_stream_frames_carry_tool_call_fragments_reasoning_and_complete_calls() -> None:
    delta = convert.event_to_pb(
        d.GenerationDelta(
            1,
            "",
            token_count=2,
            tool_calls=(
                d.ToolCallDelta(0, "call_1", "get_weather", '{"ci'),
                d.ToolCallDelta(1, arguments="{}"),
            ),
            reasoning="hmm",
        )
    ).delta
    assert [(c.index, c.id, c.name, c.arguments_fragment) for c in delta.tool_calls] == [
        (0, "call_1", "get_weather", '{"ci'),
        (1, "", "", "{}"),
    ]
    assert delta.reasoning == "hmm" and delta.index == 1
    end = convert.event_to_pb(
        d.GenerationEnd(
            1,
            d.FinishReason.TOOL_CALLS,
            d.Usage(4, 2),
            tool_calls=(d.ToolCall("call_1", "get_weather", '{"city": "Paris"}'),),
            reasoning_signatures=("s1", "s2"),
        )
    ).end
    assert end.finish_reason == t.FINISH_REASON_TOOL_CALLS
    assert [(c.id, c.name, c.arguments_json) for c in end.tool_calls] == [
        ("call_1", "get_weather", '{"city": "Paris"}')
    ]
    assert list(end.reasoning_signatures) == ["s1", "s2"]


@pytest.mark.parametrize(
    ("tools", "expected"),
    [
        (None, t.ENFORCEMENT_UNSPECIFIED),
        (d.Enforcement.NATIVE, t.ENFORCEMENT_NATIVE),
        (d.Enforcement.VALIDATED, t.ENFORCEMENT_VALIDATED),
        (d.Enforcement.ENGINE, t.ENFORCEMENT_ENGINE),
    ],
)
def test_capabilities_say_how_tools_are_enforced(tools: d.Enforcement | None, expected: int) -> None:
    caps = d.ModelCapabilities(tools=tools, reasoning_control=True, reasoning=tools is not None)
    info = convert.model_info_to_pb(d.ModelInfo("m", "scripted", caps)).capabilities
    assert info.tools == expected and info.reasoning_control
    assert info.reasoning is (tools is not None)


def test_a_batch_item_replaces_the_defaults_tools_choice_and_reasoning() -> None:
    defaults = g.GenerateRequest(
        model="m",
        tools=[t.Tool(name="a"), t.Tool(name="b")],
        tool_choice=t.ToolChoice(name="a"),
        reasoning=t.ReasoningControl(effort=t.REASONING_EFFORT_LOW, budget_tokens=5),
    )
    item = g.GenerateRequest(
        prompt="p",
        tools=[t.Tool(name="c")],
        tool_choice=t.ToolChoice(mode=t.TOOL_CHOICE_MODE_REQUIRED),
        reasoning=t.ReasoningControl(enabled=False),
    )
    merged = convert.merged_request(defaults, item)
    assert [tool.name for tool in merged.tools] == ["c"]
    assert merged.tool_choice.WhichOneof("choice") == "mode"
    assert merged.reasoning == t.ReasoningControl(enabled=False)  # not merged with the default's
    inherits = convert.merged_request(defaults, g.GenerateRequest(prompt="p"))
    assert [tool.name for tool in inherits.tools] == ["a", "b"] and inherits.tool_choice.name == "a"


def test_a_json_line_may_carry_a_tool_message() -> None:
    line = (
        '{"model": "m", "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "q"}, '
        '{"role": "assistant", "toolCalls": [{"id": "c1", "name": "f", "argumentsJson": "{}"}]}, '
        '{"role": "tool", "toolCallId": "c1", "content": "done"}]}'
    )
    request = convert.request_from_pb(convert.request_from_json_line(line, 0))
    assert request.messages is not None
    assert [m.role for m in request.messages] == [d.Role.USER, d.Role.ASSISTANT, d.Role.TOOL]
    assert request.messages[1].tool_calls == (d.ToolCall("c1", "f", "{}"),)
    assert request.messages[2].tool_call_id == "c1" and request.messages[2].text == "done"
