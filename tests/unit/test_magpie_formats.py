"""gengate.magpie: each preset's exact pre-query text (distilabel's where it has one), its
special tokens, and a conversation rendered in its format."""

from __future__ import annotations

import pytest
from gengate.api import convert
from gengate.domain import ChatMessage, GenerationRequest, MagpieInput, MagpiePreset, Role, TextPart
from gengate.magpie import PRESET_TOKENS, PRESETS


def msg(role: Role, text: str) -> ChatMessage:
    return ChatMessage(role, (TextPart(text),))


@pytest.mark.parametrize(
    ("preset", "pre_query"),
    [
        (MagpiePreset.LLAMA3, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"),
        (MagpiePreset.QWEN2, "<|im_start|>user\n"),
        (MagpiePreset.PHI3, "<|user|>\n"),
        (MagpiePreset.GEMMA, "<start_of_turn>user\n"),
    ],
)
def test_the_pre_query_text_of_each_preset(preset: MagpiePreset, pre_query: str) -> None:
    assert PRESETS[preset].pre_query() == pre_query
    assert PRESETS[preset].tokens <= PRESET_TOKENS


def test_a_conversation_in_llama3_then_the_pre_query_after_it() -> None:
    fmt = PRESETS[MagpiePreset.LLAMA3]
    rendered = fmt.render([msg(Role.SYSTEM, "S"), msg(Role.USER, "Q"), msg(Role.ASSISTANT, "A")])
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nQ<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
    )
    assert fmt.pre_query(after_conversation=True) == "<|start_header_id|>user<|end_header_id|>\n\n"
    assert fmt.render([]) == ""


def test_gemma_has_no_system_turn_and_calls_the_assistant_model() -> None:
    fmt = PRESETS[MagpiePreset.GEMMA]
    assert fmt.render([msg(Role.SYSTEM, "S"), msg(Role.USER, "Q"), msg(Role.ASSISTANT, "A")]) == (
        "<start_of_turn>user\nS\n\nQ<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
    )
    assert fmt.render([msg(Role.SYSTEM, "S")]) == "<start_of_turn>user\nS<end_of_turn>\n"
    assert "<|system|>" in PRESETS[MagpiePreset.PHI3].tokens and fmt.assistant_prompt() == (
        "<start_of_turn>model\n"
    )


def test_a_magpie_request_survives_the_proto_round_trip() -> None:
    magpie = MagpieInput(
        preset=MagpiePreset.PHI3,
        system_prompt="sys",
        conversation=(msg(Role.USER, "q"), msg(Role.ASSISTANT, "a")),
        n_turns=3,
        end_with_user=True,
    )
    request = GenerationRequest(model="m", magpie=magpie)
    back = convert.request_from_pb(convert.request_to_pb(request))
    assert back.magpie == magpie and back.prompt is None and back.messages is None
    custom = GenerationRequest(model="m", magpie=MagpieInput(template="<|x|>"))
    assert convert.request_from_pb(convert.request_to_pb(custom)).magpie == MagpieInput(template="<|x|>")
