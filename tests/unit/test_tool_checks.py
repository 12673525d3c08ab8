"""gengate.checks.prepare and gengate.tools on tool requests, where the gRPC tests cannot reach
(no served model takes both Magpie and tools), and ToolSet.call_errors case by case."""

from __future__ import annotations

import pytest
from gengate import tools
from gengate.checks import prepare
from gengate.domain import (
    ChatMessage,
    Enforcement,
    GenerationRequest,
    MagpieInput,
    MagpiePreset,
    ModelCapabilities,
    ReasoningControl,
    ReasoningEffort,
    Role,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    evolve,
)
from gengate.errors import GengateError, InvalidArgument
from gengate.limits import RequestLimits

CAPS = ModelCapabilities(max_n=4, raw_prompt=True, tools=Enforcement.VALIDATED, reasoning_control=True)
CITY = Tool(
    "city", parameters={"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
)


def fields_of(request: GenerationRequest) -> list[str]:
    with pytest.raises(GengateError) as caught:
        prepare(request, CAPS)
    return [v.field for v in caught.value.violations]


def test_tools_beside_magpie_are_refused_naming_tools() -> None:
    magpie = MagpieInput(preset=MagpiePreset.LLAMA3)
    assert "tools" in fields_of(GenerationRequest(model="m", magpie=magpie, tools=(CITY,)))


def test_a_magpie_conversation_holds_no_tool_turns() -> None:
    turns = (
        ChatMessage(Role.USER, (TextPart("q"),)),
        ChatMessage(Role.ASSISTANT, (), tool_calls=(ToolCall("c", "city", "{}"),)),
    )
    magpie = MagpieInput(preset=MagpiePreset.LLAMA3, conversation=turns)
    assert "magpie.conversation[1]" in fields_of(GenerationRequest(model="m", magpie=magpie))


def test_reasoning_effort_with_reasoning_off_is_contradictory() -> None:
    control = ReasoningControl(enabled=False, effort=ReasoningEffort.LOW, budget_tokens=10)
    fields = fields_of(GenerationRequest(model="m", prompt="p", reasoning=control))
    assert fields == ["reasoning.effort", "reasoning.budget_tokens"]
    prepare(GenerationRequest(model="m", prompt="p", reasoning=ReasoningControl(enabled=False)), CAPS)


def test_an_assistant_turn_may_be_only_calls_but_a_user_turn_needs_content() -> None:
    messages = (
        ChatMessage(Role.USER, (TextPart("q"),)),
        ChatMessage(Role.ASSISTANT, (), tool_calls=(ToolCall("c", "city", '{"name": "x"}'),)),
        ChatMessage(Role.TOOL, (TextPart("ok"),), tool_call_id="c"),
        ChatMessage(Role.USER, ()),
    )
    assert fields_of(GenerationRequest(model="m", messages=messages, tools=(CITY,))) == [
        "messages.messages[3].content"
    ]


def test_an_assistant_turn_with_too_many_calls_is_over_the_limit() -> None:
    calls = tuple(ToolCall(f"c{i}", "city", "{}") for i in range(tools.MAX_TOOLS + 1))
    messages = (ChatMessage(Role.USER, (TextPart("q"),)), ChatMessage(Role.ASSISTANT, (), tool_calls=calls))
    assert fields_of(GenerationRequest(model="m", messages=messages)) == ["messages.messages[1].tool_calls"]


def test_all_tools_together_count_against_the_constraint_size_limit() -> None:
    # Each tool is within the limit on its own; together they are not (a local engine compiles
    # them into one grammar). The request is refused naming `tools`, before anything is compiled.
    limits = RequestLimits(max_constraint_bytes=2000)
    each = Tool("t", "d" * 600, {"type": "object", "properties": {"a": {"type": "string"}}})
    offered = tuple(evolve(each, name=f"t{i}") for i in range(4))
    request = GenerationRequest(model="m", prompt="p", tools=offered)
    with pytest.raises(InvalidArgument) as caught:
        prepare(request, CAPS, limits=limits)
    assert [v.field for v in caught.value.violations] == ["tools"]
    assert "together" in caught.value.message and "max_constraint_bytes" in caught.value.message
    prepare(evolve(request, tools=offered[:2]), CAPS, limits=limits)  # two fit


def test_a_schema_refusal_is_moved_under_its_tool() -> None:
    bad = Tool("bad", parameters={"type": "object", "properties": {"a": {"type": 5}}})
    with pytest.raises(InvalidArgument) as caught:
        tools.check_syntax(GenerationRequest(model="m", prompt="p", tools=(CITY, bad)))
    assert all(v.field.startswith("tools[1].parameters_json") for v in caught.value.violations)
    assert caught.value.message.startswith("tools[1].parameters_json")


def toolset(**fields: object) -> tools.ToolSet:
    return tools.ToolSet(GenerationRequest(model="m", prompt="p", tools=(CITY, Tool("noop")), **fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "calls", "says"),
    [
        ({}, [ToolCall("a", "city", '{"name": "Oslo"}'), ToolCall("b", "noop", "{}")], None),
        ({}, [ToolCall("", "noop", "{}"), ToolCall("", "noop", "{}")], None),  # ids come later
        ({}, [], None),
        ({}, [ToolCall("a", "city", "{}")], "arguments"),
        ({}, [ToolCall("a", "city", '{"name": "x"}'), ToolCall("a", "noop", "{}")], "ids must be unique"),
        ({}, [ToolCall("a", "nope", "{}")], "not an offered tool"),
        ({}, [ToolCall("a", "noop", "")], "arguments"),
        ({}, [ToolCall("a", "noop", "[]")], "arguments"),
        (
            {"parallel_tool_calls": False},
            [ToolCall("a", "noop", "{}"), ToolCall("b", "noop", "{}")],
            "parallel",
        ),
        ({"tool_choice": ToolChoice(ToolChoiceMode.NONE)}, [ToolCall("a", "noop", "{}")], "none"),
        ({"tool_choice": ToolChoice(ToolChoiceMode.REQUIRED)}, [], "required"),
        ({"tool_choice": ToolChoice(name="city")}, [ToolCall("a", "noop", "{}")], "not 'city'"),
    ],
)
def test_call_errors(fields: dict[str, object], calls: list[ToolCall], says: str | None) -> None:
    problem = toolset(**fields).call_errors(calls)
    if says is None:
        assert problem is None
    else:
        assert problem is not None and says in problem
