"""Tool calls on the local engines (llama.cpp, transformers, MLX) with the tiny model, called
directly. Its random weights write nonsense, so every call that comes back well formed, naming an
offered tool and with arguments that validate, is the grammar's doing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from gengate.backend import Backend
from gengate.domain import (
    ChatMessage,
    Enforcement,
    FinishReason,
    Generation,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    Role,
    SamplingParams,
    StoppingCriteria,
    StreamEvent,
    StreamStart,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from gengate.models.tiny import TinyModelPaths
from gengate.tools import ToolSet

WEATHER = Tool(
    "weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["C", "F"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit"],
    },
)
CLOCK = Tool("time-now", "The time now")
BOOK = Tool(
    "book_table",
    "Books a table",
    {
        "type": "object",
        "properties": {
            "people": {"type": "integer", "minimum": 1, "maximum": 12},
            "vegan": {"type": "boolean"},
        },
        "required": ["people", "vegan"],
    },
)
TOOLS = (WEATHER, CLOCK, BOOK)
SEEDS = range(3)
# Free text runs to max_tokens: kept short where the tiny model writes text (auto, none).
SHORT = StoppingCriteria(max_tokens=32)


def _llamacpp(model: TinyModelPaths) -> Backend:
    pytest.importorskip("llama_cpp")
    from gengate.engines.llamacpp import LlamaCppBackend, LlamaCppOptions

    return LlamaCppBackend("tiny", LlamaCppOptions(path=str(model.gguf_path), n_ctx=1024, n_threads=1))


def _transformers(model: TinyModelPaths) -> Backend:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gengate.engines.transformers import TransformersBackend, TransformersOptions

    return TransformersBackend("tiny", TransformersOptions(model=str(model.hf_dir), max_batch_size=8))


def _mlx(model: TinyModelPaths) -> Backend:
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from gengate.engines.mlx import MlxBackend, MlxOptions

    return MlxBackend("tiny", MlxOptions(model=str(model.hf_dir), max_batch_size=8))


ENGINES: dict[str, Callable[[TinyModelPaths], Backend]] = {
    "llamacpp": _llamacpp,
    "transformers": _transformers,
    "mlx": _mlx,
}


@pytest.fixture(scope="module", params=list(ENGINES))
async def backend(request: pytest.FixtureRequest, tiny_model: TinyModelPaths) -> AsyncIterator[Backend]:
    engine = ENGINES[request.param](tiny_model)
    await engine.start()
    yield engine
    await engine.aclose()


def ask(**fields: Any) -> GenerationRequest:
    fields.setdefault("model", "tiny")
    fields.setdefault("messages", (ChatMessage(Role.USER, (TextPart("What is the weather in Paris?"),)),))
    fields.setdefault("tools", TOOLS)
    fields.setdefault("stopping", StoppingCriteria(max_tokens=160))
    return GenerationRequest(**fields)


async def generations(backend: Backend, **fields: Any) -> list[tuple[GenerationRequest, Generation]]:
    """Two generations (n=2) for each of several seeds, the requests run together (batched engines
    batch them; llama.cpp takes turns)."""
    requests = [ask(sampling=SamplingParams(seed=seed), n=2, **fields) for seed in SEEDS]
    results = await asyncio.gather(*(backend.generate(req) for req in requests))
    return [(req, g) for req, result in zip(requests, results, strict=True) for g in result.generations]


def assert_valid_calls(req: GenerationRequest, gen: Generation) -> None:
    assert ToolSet(req).call_errors(gen.tool_calls) is None, gen
    for call in gen.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
    assert len({c.id for c in gen.tool_calls}) == len(gen.tool_calls)


async def test_tools_are_declared_engine_enforced(backend: Backend) -> None:
    assert backend.capabilities.tools is Enforcement.ENGINE


async def test_required_always_gives_valid_calls(backend: Backend) -> None:
    names = set()
    for req, gen in await generations(backend, tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)):
        assert gen.tool_calls and gen.finish_reason is FinishReason.TOOL_CALLS, gen
        assert gen.text == ""  # required: calls only, no text around them
        assert_valid_calls(req, gen)
        names |= {c.name for c in gen.tool_calls}
    assert names <= {t.name for t in TOOLS}


async def test_a_named_tool_is_the_only_one_called(backend: Backend) -> None:
    for req, gen in await generations(backend, tool_choice=ToolChoice(name="book_table")):
        assert gen.tool_calls and gen.finish_reason is FinishReason.TOOL_CALLS
        assert {c.name for c in gen.tool_calls} == {"book_table"}
        assert_valid_calls(req, gen)
        for call in gen.tool_calls:
            arguments = json.loads(call.arguments)
            assert set(arguments) == {"people", "vegan"} and 1 <= arguments["people"] <= 12


async def test_parallel_false_gives_exactly_one_call(backend: Backend) -> None:
    for req, gen in await generations(
        backend, tool_choice=ToolChoice(ToolChoiceMode.REQUIRED), parallel_tool_calls=False
    ):
        assert len(gen.tool_calls) == 1
        assert_valid_calls(req, gen)


async def test_auto_gives_text_or_valid_calls(backend: Backend) -> None:
    for req, gen in await generations(backend, stopping=SHORT):
        assert_valid_calls(req, gen)
        if gen.tool_calls:
            assert gen.finish_reason is FinishReason.TOOL_CALLS
            assert "<tool_call>" not in gen.text
        else:
            assert gen.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


async def test_choice_none_makes_no_calls(backend: Backend) -> None:
    for _, gen in await generations(backend, tool_choice=ToolChoice(ToolChoiceMode.NONE), stopping=SHORT):
        assert gen.tool_calls == ()
        assert gen.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


async def test_stream_gives_the_calls_as_deltas_then_on_the_end(backend: Backend) -> None:
    req = ask(tool_choice=ToolChoice(ToolChoiceMode.REQUIRED), sampling=SamplingParams(seed=3), n=2)
    events: list[StreamEvent] = [e async for e in backend.generate_stream(req)]
    assert isinstance(events[0], StreamStart) and events[0].enforcement is Enforcement.ENGINE
    for index in range(2):
        deltas = [e for e in events if isinstance(e, GenerationDelta) and e.index == index]
        (end,) = [e for e in events if isinstance(e, GenerationEnd) and e.index == index]
        assert events.index(end) > max(events.index(d) for d in deltas)
        streamed = [c for d in deltas for c in d.tool_calls]
        heads = [c for c in streamed if c.id]  # id and name first, then the arguments' fragments
        assert [c.index for c in heads] == list(range(len(end.tool_calls)))
        joined = ["".join(c.arguments for c in streamed if c.index == i) for i in range(len(heads))]
        assert [(c.id, c.name, a) for c, a in zip(heads, joined, strict=True)] == [
            (c.id, c.name, c.arguments) for c in end.tool_calls
        ]
        assert end.tool_calls and end.finish_reason is FinishReason.TOOL_CALLS
        assert "".join(d.text for d in deltas) == ""
        assert sum(d.token_count for d in deltas) <= end.usage.output_tokens  # as any stream


async def test_a_conversation_with_calls_and_results_goes_on(backend: Backend) -> None:
    call = ToolCall("call_1", "weather", '{"city": "Paris", "unit": "C"}')
    messages = (
        ChatMessage(Role.USER, (TextPart("Weather in Paris, then book for two?"),)),
        ChatMessage(Role.ASSISTANT, (TextPart("Looking."),), tool_calls=(call,)),
        ChatMessage(Role.TOOL, (TextPart('{"sky": "clear"}'),), tool_call_id="call_1"),
    )
    fresh = await backend.generate(
        ask(tool_choice=ToolChoice(name="book_table"), sampling=SamplingParams(seed=1))
    )
    req = ask(messages=messages, tool_choice=ToolChoice(name="book_table"), sampling=SamplingParams(seed=1))
    result = await backend.generate(req)
    assert result.usage.input_tokens > fresh.usage.input_tokens  # the call and its result were rendered
    (gen,) = result.generations
    assert gen.tool_calls and {c.name for c in gen.tool_calls} == {"book_table"}
    assert_valid_calls(req, gen)


async def test_a_raw_prompt_is_held_to_the_tools_grammar_too(backend: Backend) -> None:
    req = GenerationRequest(
        model="tiny",
        prompt="Call a tool:",
        tools=TOOLS,
        tool_choice=ToolChoice(ToolChoiceMode.REQUIRED),
        sampling=SamplingParams(seed=5),
        stopping=StoppingCriteria(max_tokens=160),
    )
    (gen,) = (await backend.generate(req)).generations
    assert gen.tool_calls
    assert_valid_calls(req, gen)


async def test_tools_cross_the_worker_process_boundary(tiny_model: TinyModelPaths) -> None:
    pytest.importorskip("llama_cpp")
    from gengate.workers.backend import WorkerBackend

    worker = WorkerBackend("tiny-llama", "llamacpp", {"path": str(tiny_model.gguf_path), "n_ctx": 1024})
    await worker.start()
    try:
        assert worker.capabilities.tools is Enforcement.ENGINE
        req = ask(model="tiny-llama", tool_choice=ToolChoice(name="weather"), sampling=SamplingParams(seed=2))
        (gen,) = (await worker.generate(req)).generations
        assert gen.finish_reason is FinishReason.TOOL_CALLS and [c.name for c in gen.tool_calls] == [
            "weather"
        ]
        assert_valid_calls(req, gen)
        events = [e async for e in worker.generate_stream(req)]
        (end,) = [e for e in events if isinstance(e, GenerationEnd)]
        streamed = [c for e in events if isinstance(e, GenerationDelta) for c in e.tool_calls]
        assert [c.id for c in streamed if c.id] == [c.id for c in end.tool_calls] and end.tool_calls
        assert [c.arguments for c in end.tool_calls] == [c.arguments for c in gen.tool_calls]  # same seed
    finally:
        await worker.aclose()


async def test_llamacpp_chat_format_gets_the_generic_form(tiny_model: TinyModelPaths) -> None:
    pytest.importorskip("llama_cpp")
    from gengate.engines.llamacpp import LlamaCppBackend, LlamaCppOptions

    options = LlamaCppOptions(path=str(tiny_model.gguf_path), n_ctx=1024, n_threads=1, chat_format="chatml")
    backend = LlamaCppBackend("tiny", options)
    await backend.start()
    try:
        req = ask(tool_choice=ToolChoice(ToolChoiceMode.REQUIRED), sampling=SamplingParams(seed=4))
        assert "# Tools" in backend._render_chat(req) and '"name": "book_table"' in backend._render_chat(req)
        (gen,) = (await backend.generate(req)).generations
        assert gen.tool_calls and gen.finish_reason is FinishReason.TOOL_CALLS
        assert_valid_calls(req, gen)
    finally:
        await backend.aclose()


# A template that renders tools and calls itself, as Qwen2.5's does (cut down).
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_a_template_that_speaks_tools_renders_them_itself(tiny_model: TinyModelPaths) -> None:
    pytest.importorskip("llama_cpp")
    from gengate.engines.llamacpp import LlamaCppBackend, LlamaCppOptions

    options = LlamaCppOptions(
        path=str(tiny_model.gguf_path), n_ctx=1024, n_threads=1, chat_template=HERMES_TEMPLATE
    )
    backend = LlamaCppBackend("tiny", options)
    await backend.start()
    try:
        req = ask(tool_choice=ToolChoice(name="weather"), sampling=SamplingParams(seed=6))
        rendered = backend._render_chat(req)
        assert rendered.startswith("<|im_start|>system\n<tools>") and '"name": "weather"' in rendered
        assert "# Tools" not in rendered  # the template's own, not the generic form
        (gen,) = (await backend.generate(req)).generations
        assert gen.tool_calls and {c.name for c in gen.tool_calls} == {"weather"}
        assert_valid_calls(req, gen)
    finally:
        await backend.aclose()


async def test_a_tool_plan_grammar_is_checked_in_full_and_a_requests_own_constraint_is_not(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine composes a tool plan's grammar itself, so its compile makes every check; the
    request's own constraint passed the server's sandbox, so its compile skips those
    (ConstraintCompiler.compile's `checked`)."""
    from gengate.constraints import kinds
    from gengate.domain import RegexConstraint, StructuredOutput

    seen: list[tuple[str, bool]] = []
    real_lower = kinds.lower

    def spying(structured: StructuredOutput, *, syntax_checked: bool = False) -> Any:
        seen.append((structured.constraint.kind.value, syntax_checked))
        return real_lower(structured, syntax_checked=syntax_checked)

    monkeypatch.setattr(kinds, "lower", spying)
    lone = Tool("lone_tool_for_the_check", "Says which checks ran", {"type": "object"})
    await backend.generate(ask(tools=(lone,), tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)))
    await backend.generate(
        ask(tools=(), structured_output=StructuredOutput(RegexConstraint("checked-[a-c]{1,3}")))
    )
    assert seen == [("grammar", False), ("regex", True)]
