"""The local engines' tool-call format without a model: the parser (whole and streamed), the grammar
each tool choice gets, and the prompt a chat template is given."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from gengate.constraints import validate_output
from gengate.domain import (
    ChatMessage,
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    Role,
    StreamEvent,
    StreamStart,
    StructuredOutput,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    Usage,
)
from gengate.engines.llamacpp import _compile_template
from gengate.engines.toolcalls import (
    CallSplitter,
    ToolPlan,
    call_block,
    chat_prompt,
    split_calls,
    template_speaks_tools,
    tool_events,
    tool_plan,
)
from gengate.models.tiny import CHAT_TEMPLATE
from gengate.tools import TOOL_CALL_ID_PREFIX

WEATHER = Tool(
    "weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city"],
    },
)
CLOCK = Tool("time-now", "The time now")  # no parameters: an empty object
TOOLS = (WEATHER, CLOCK)


def block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


PARIS = block("weather", '{"city":"Paris","days":3}')
NOW = block("time-now", "{}")


def request(**fields: object) -> GenerationRequest:
    fields.setdefault("messages", (ChatMessage(Role.USER, (TextPart("Weather in Paris?"),)),))
    fields.setdefault("tools", TOOLS)
    return GenerationRequest(model="m", **fields)  # type: ignore[arg-type]


def grammar_of(**fields: object) -> StructuredOutput:
    plan = tool_plan(request(**fields))
    assert plan is not None and plan.grammar is not None
    return plan.grammar


# -- parsing ------------------------------------------------------------------------------------


def test_text_without_calls_is_all_text() -> None:
    assert split_calls("just words, a <tag> and <tool_ca") == ("just words, a <tag> and <tool_ca", ())


def test_one_call_is_parsed_with_a_fresh_id() -> None:
    text, calls = split_calls(PARIS)
    assert text == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Paris", "days": 3})]
    assert calls[0].id.startswith(TOOL_CALL_ID_PREFIX)


def test_two_calls_get_their_own_ids() -> None:
    _, calls = split_calls(PARIS + "\n" + NOW)
    assert [c.name for c in calls] == ["weather", "time-now"]
    assert calls[0].id != calls[1].id


def test_text_before_the_calls_is_kept_without_the_space_before_them() -> None:
    text, calls = split_calls("Let me look that up.\n\n" + PARIS + "\n" + NOW)
    assert text == "Let me look that up."
    assert len(calls) == 2


def test_an_unclosed_call_is_not_a_call() -> None:
    assert split_calls("hm " + PARIS[:30]) == ("hm", ())


def test_a_block_that_is_not_a_call_still_reaches_the_checks() -> None:
    _, calls = split_calls("<tool_call>\nnot json\n</tool_call>")
    assert [(c.name, c.arguments) for c in calls] == [("", "not json")]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 11])
def test_streamed_in_any_pieces_splits_as_the_whole(size: int) -> None:
    whole = "Sure thing  \n" + PARIS + "\n" + NOW
    splitter = CallSplitter()
    text, names = "", []
    for start in range(0, len(whole), size):
        piece, calls = splitter.feed(whole[start : start + size])
        assert "<" not in piece  # nothing of a tag is ever released as text
        text += piece
        names += [c.name for c in calls]
    text += splitter.finish()
    assert (text, names) == ("Sure thing", ["weather", "time-now"])


def test_held_back_text_is_released_when_no_call_follows() -> None:
    splitter = CallSplitter()
    assert splitter.feed("a <tool_c") == ("a", [])
    assert splitter.feed("at>  ") == (" <tool_cat>", [])
    assert splitter.finish() == "  "


async def test_tool_events_put_calls_on_deltas_and_the_end() -> None:
    async def engine() -> AsyncIterator[StreamEvent]:
        yield StreamStart("r", "m", 3)
        for piece in ["Hi ", PARIS[:20], PARIS[20:], "\n", NOW]:
            yield GenerationDelta(0, piece, token_count=2)
        yield GenerationEnd(0, FinishReason.STOP, Usage(3, 10))

    plan = tool_plan(request())
    events = [e async for e in tool_events(engine(), plan)]
    deltas = [e for e in events if isinstance(e, GenerationDelta)]
    end = events[-1]
    assert isinstance(end, GenerationEnd)
    assert "".join(d.text for d in deltas) == "Hi"
    assert sum(d.token_count for d in deltas) == 10  # held-back text's tokens are carried on
    streamed = [c for d in deltas for c in d.tool_calls]
    heads = [c for c in streamed if c.name]  # id and name on each call's first fragment
    assert [(c.index, c.name) for c in heads] == [(0, "weather"), (1, "time-now")]
    assert end.finish_reason is FinishReason.TOOL_CALLS
    joined = ["".join(c.arguments for c in streamed if c.index == i) for i in range(len(heads))]
    assert [(c.id, c.name, c.arguments) for c in end.tool_calls] == [
        (h.id, h.name, arguments) for h, arguments in zip(heads, joined, strict=True)
    ]


async def test_tool_events_leave_a_length_cut_and_choice_none_alone() -> None:
    async def engine(text: str, reason: FinishReason) -> AsyncIterator[StreamEvent]:
        yield GenerationDelta(0, text)
        yield GenerationEnd(0, reason, Usage(1, 1))

    cut = [
        e
        async for e in tool_events(
            engine(PARIS + "\n<tool_call>\n{", FinishReason.LENGTH), tool_plan(request())
        )
    ]
    assert isinstance(cut[-1], GenerationEnd) and cut[-1].finish_reason is FinishReason.LENGTH
    assert len(cut[-1].tool_calls) == 1  # the complete call, and the end says it was cut
    none = tool_plan(request(tool_choice=ToolChoice(ToolChoiceMode.NONE)))
    plain = [e async for e in tool_events(engine(PARIS, FinishReason.STOP), none)]
    assert plain == [GenerationDelta(0, PARIS), GenerationEnd(0, FinishReason.STOP, Usage(1, 1))]


# -- grammar ------------------------------------------------------------------------------------


def accepts(grammar: StructuredOutput, text: str) -> bool:
    return validate_output(grammar, text) is None


def test_auto_takes_text_or_text_then_calls() -> None:
    g = grammar_of()
    assert accepts(g, "no tools needed, <b>bold</b>")
    assert accepts(g, PARIS)
    assert accepts(g, "Checking. " + PARIS + "\n" + NOW)
    assert not accepts(g, PARIS + " and some words after")
    assert not accepts(g, "x " + block("weather", '{"city":"Paris","wind":1}'))  # closed objects


def test_required_takes_only_calls() -> None:
    g = grammar_of(tool_choice=ToolChoice(ToolChoiceMode.REQUIRED))
    assert accepts(g, PARIS + "\n" + NOW)
    assert not accepts(g, "text")
    assert not accepts(g, "text " + PARIS)
    assert not accepts(g, "")


def test_arguments_follow_their_own_tools_schema() -> None:
    g = grammar_of(tool_choice=ToolChoice(ToolChoiceMode.REQUIRED))
    assert not accepts(g, block("weather", '{"days":3}'))  # city is required
    assert not accepts(g, block("weather", '{"city":"Paris","days":9}'))  # days at most 7
    assert not accepts(g, block("time-now", '{"city":"Paris"}'))  # the clock takes nothing
    assert not accepts(g, block("other", "{}"))  # not an offered tool


def test_a_named_tool_takes_only_its_calls() -> None:
    g = grammar_of(tool_choice=ToolChoice(name="time-now"))
    assert accepts(g, NOW + "\n" + NOW)
    assert not accepts(g, PARIS)
    assert not accepts(g, "text")


def test_parallel_false_takes_one_call() -> None:
    for choice in (None, ToolChoice(ToolChoiceMode.REQUIRED)):
        g = grammar_of(tool_choice=choice, parallel_tool_calls=False)
        assert accepts(g, PARIS)
        assert not accepts(g, PARIS + "\n" + NOW)


def test_choice_none_has_no_grammar() -> None:
    plan = tool_plan(request(tool_choice=ToolChoice(ToolChoiceMode.NONE)))
    assert plan is not None and plan.grammar is None and not plan.parses_calls
    assert tool_plan(request(tools=())) is None


def test_a_relaxed_schema_makes_the_calls_validated() -> None:
    odd = Tool("odd", "", {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}})
    plan = tool_plan(request(tools=(odd,)))
    assert isinstance(plan, ToolPlan)
    assert plan.enforcement is Enforcement.VALIDATED
    assert any("uniqueItems" in r for r in plan.relaxations)


# -- prompt -------------------------------------------------------------------------------------

# A template that speaks the format itself, as Qwen2.5's does (cut to what it does with tools).
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def history() -> tuple[ChatMessage, ...]:
    call = ToolCall("call_1", "weather", '{"city": "Paris"}')
    return (
        ChatMessage(Role.SYSTEM, (TextPart("Be brief."),)),
        ChatMessage(Role.USER, (TextPart("Weather in Paris?"),)),
        ChatMessage(Role.ASSISTANT, (), tool_calls=(call,)),
        ChatMessage(Role.TOOL, (TextPart("sunny"),), tool_call_id="call_1"),
    )


def test_the_tiny_template_does_not_speak_tools_and_a_hermes_one_does() -> None:
    assert not template_speaks_tools(CHAT_TEMPLATE)
    assert template_speaks_tools(HERMES_TEMPLATE)
    assert template_speaks_tools({"default": "x", "tool_use": HERMES_TEMPLATE})
    assert not template_speaks_tools(None)


def test_generic_prompt_puts_the_tools_into_the_system_message() -> None:
    prompt = chat_prompt(request(messages=history()), native=False)
    assert prompt.tools is None
    system, user, assistant, result = prompt.messages
    assert user == {"role": "user", "content": "Weather in Paris?"}
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "weather"' in system["content"] and '"maxLength": 12' in system["content"]
    assert assistant == {"role": "assistant", "content": call_block("weather", '{"city": "Paris"}')}
    assert result == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    rendered = _compile_template(CHAT_TEMPLATE).render(messages=prompt.messages, bos_token="", eos_token="")
    assert '<tool_call>\n{"name": "weather", "arguments": {"city":"Paris"}}\n</tool_call>' in rendered


def test_generic_prompt_without_a_system_message_adds_one_that_says_what_is_demanded() -> None:
    prompt = chat_prompt(
        request(tool_choice=ToolChoice(name="weather"), parallel_tool_calls=False), native=False
    )
    first = prompt.messages[0]
    assert first["role"] == "system"
    assert first["content"].endswith('Call the function "weather".\n\nCall at most one function.')


def test_choice_none_leaves_the_tools_out_of_the_prompt() -> None:
    generic = chat_prompt(request(tool_choice=ToolChoice(ToolChoiceMode.NONE)), native=False)
    assert [m["role"] for m in generic.messages] == ["user"]
    native = chat_prompt(request(tool_choice=ToolChoice(ToolChoiceMode.NONE)), native=True)
    assert native.tools is None


def test_native_prompt_hands_tools_and_calls_to_the_template() -> None:
    prompt = chat_prompt(request(messages=history()), native=True)
    assert prompt.tools is not None and [t["function"]["name"] for t in prompt.tools] == [
        "weather",
        "time-now",
    ]
    assistant, result = prompt.messages[2], prompt.messages[3]
    assert assistant["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Paris"}}
    assert result == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    rendered = _compile_template(HERMES_TEMPLATE).render(
        messages=prompt.messages, **prompt.template_kwargs(), add_generation_prompt=True
    )
    declared = rendered.split("</tools>")[0]
    assert declared.startswith("<|im_start|>system\n<tools>") and '"name": "time-now"' in declared
    assert '{"name": "weather", "arguments": {"city": "Paris"}}' in rendered
