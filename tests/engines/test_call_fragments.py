"""Tool calls stream in fragments on the local engines: the id and name once a call's head is
written, then its arguments as they come; the end frame's call is those fragments joined."""

from __future__ import annotations

import json

import pytest
from gengate.backend import Backend
from gengate.domain import (
    GenerationDelta,
    GenerationEnd,
    SamplingParams,
    ToolCallDelta,
    ToolChoice,
)
from gengate.engines.toolcalls import CallSplitter, call_block
from gengate.models.tiny import TinyModelPaths
from test_engine_tools import _llamacpp, _transformers, ask

NESTED = call_block("weather", json.dumps({"city": "Paris } </tool", "where": {"lat": 1, "deep": {}}}))
FLAT = call_block("time-now", "{}")
WHOLE = "Checking.\n" + NESTED + "\n" + FLAT


def run(chunks: list[str]) -> tuple[str, list[ToolCallDelta], CallSplitter]:
    splitter = CallSplitter()
    text, deltas = "", []
    for chunk in chunks:
        piece, out = splitter.stream(chunk)
        text += piece
        deltas += out
    return text + splitter.finish(), deltas, splitter


def check(deltas: list[ToolCallDelta], splitter: CallSplitter) -> None:
    heads = [d for d in deltas if d.id]
    assert [(h.index, h.name) for h in heads] == [(0, "weather"), (1, "time-now")]
    for head in heads:
        mine = [d for d in deltas if d.index == head.index]
        assert mine[0] is head and all(not d.id and not d.name for d in mine[1:])  # id and name once, first
    for i, call in enumerate(splitter.calls):
        assert call.id == heads[i].id and call.name == heads[i].name
        assert call.arguments == "".join(d.arguments for d in deltas if d.index == i)
    assert json.loads(splitter.calls[0].arguments) == {
        "city": "Paris } </tool",
        "where": {"lat": 1, "deep": {}},
    }
    assert json.loads(splitter.calls[1].arguments) == {}


def test_the_whole_text_at_once_gives_the_calls() -> None:
    text, deltas, splitter = run([WHOLE])
    assert text == "Checking."
    check(deltas, splitter)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13])
def test_arguments_go_out_in_fragments_as_they_come(size: int) -> None:
    chunks = [WHOLE[i : i + size] for i in range(0, len(WHOLE), size)]
    text, deltas, splitter = run(chunks)
    assert text == "Checking."
    check(deltas, splitter)
    assert len([d for d in deltas if d.index == 0 and d.arguments]) > 1  # not held to the close


def test_every_single_cut_gives_the_same_calls() -> None:
    for cut in range(len(WHOLE) + 1):
        text, deltas, splitter = run([WHOLE[:cut], WHOLE[cut:]])
        assert text == "Checking.", cut
        check(deltas, splitter)


def test_space_before_the_arguments_is_left_out_wherever_the_chunks_cut() -> None:
    spaced = '<tool_call>\n{"name": "weather", "arguments":   {"city":"Oslo"}}\n</tool_call>'
    for cut in range(len(spaced) + 1):
        _, deltas, splitter = run([spaced[:cut], spaced[cut:]])
        assert splitter.calls[0].arguments == '{"city":"Oslo"}', cut
        assert "".join(d.arguments for d in deltas) == '{"city":"Oslo"}'


def test_a_block_not_in_the_format_goes_out_whole_when_it_closes() -> None:
    _, deltas, splitter = run(["<tool_call>\nnot", " json\n</tool_call>"])
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "", "not json")]
    assert deltas[0].id == splitter.calls[0].id


@pytest.mark.parametrize("make", [_llamacpp, _transformers])
async def test_an_engine_streams_the_arguments_of_its_calls(make: object, tiny_model: TinyModelPaths) -> None:
    backend: Backend = make(tiny_model)  # type: ignore[operator]
    await backend.start()
    try:
        req = ask(tool_choice=ToolChoice(name="weather"), sampling=SamplingParams(seed=2))
        events = [e async for e in backend.generate_stream(req)]
        (end,) = [e for e in events if isinstance(e, GenerationEnd)]
        frames = [d for e in events if isinstance(e, GenerationDelta) for d in e.tool_calls]
        assert end.tool_calls
        for i, call in enumerate(end.tool_calls):
            mine = [d for d in frames if d.index == i]
            assert (mine[0].id, mine[0].name, mine[0].arguments) == (call.id, "weather", "")
            assert len(mine) > 2  # the arguments came in pieces, as the tokens came
            assert "".join(d.arguments for d in mine) == call.arguments
            assert isinstance(json.loads(call.arguments), dict)
    finally:
        await backend.aclose()
