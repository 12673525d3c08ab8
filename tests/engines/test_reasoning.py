"""Think blocks on the local engines: the splitter (every chunk boundary), the stream wrapper, and
the tiny model held to `<think>..</think>answer` by the composed grammar (budget_tokens caps the
block, the constraint holds for the answer)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from gengate.backend import Backend, collect_stream
from gengate.domain import (
    ChatMessage,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    ReasoningControl,
    RegexConstraint,
    Role,
    SamplingParams,
    StoppingCriteria,
    StreamEvent,
    StreamStart,
    StructuredOutput,
    TextPart,
    ToolChoice,
    ToolChoiceMode,
    Usage,
)
from gengate.engines.reasoning import ReasoningPlan, ThinkSplitter, ThinkTags, reasoning_events
from gengate.models.tiny import TinyModelPaths
from hypothesis import given
from hypothesis import strategies as st
from test_engine_tools import TOOLS, assert_valid_calls

TAGS = ThinkTags("<think>", "</think>")
PLAN = ReasoningPlan(TAGS)


def split_whole(text: str, plan: ReasoningPlan = PLAN) -> tuple[str, str]:
    splitter = ThinkSplitter(plan)
    r, a = splitter.feed(text)
    r2, a2 = splitter.finish()
    return r + r2, a + a2


def split_chunks(chunks: list[str], plan: ReasoningPlan = PLAN) -> tuple[str, str]:
    splitter = ThinkSplitter(plan)
    out = [splitter.feed(c) for c in chunks] + [splitter.finish()]
    return "".join(r for r, _ in out), "".join(a for _, a in out)


CASES = {
    " <think>\n let me see \n</think>\n\n42": ("let me see", "42"),
    "<think></think>answer": ("", "answer"),
    "no think here <think>x</think>": ("", "no think here <think>x</think>"),
    "  plain": ("", "  plain"),
    "<thin": ("", "<thin"),
    "<think>cut off mid ": ("cut off mid", ""),
    "<think>a</thinkish</think> b": ("a</thinkish", "b"),
}


@pytest.mark.parametrize("text", sorted(CASES))
def test_the_splitter_gives_the_same_at_every_chunk_boundary(text: str) -> None:
    assert split_whole(text) == CASES[text]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert split_chunks([text[:i], text[i:j], text[j:]]) == CASES[text], (i, j)


def test_a_prompt_that_opened_the_block_starts_in_the_reasoning() -> None:
    inside = ReasoningPlan(TAGS, inside=True)
    assert split_whole("\nweighing it</think>\n\n{}", inside) == ("weighing it", "{}")
    assert split_whole("all thought", inside) == ("all thought", "")


pieces = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "</", "think>", " ", "\n", "a", "b c"]), max_size=12
)


@given(pieces, st.lists(st.integers(0, 60), max_size=4))
def test_any_chunking_of_any_text_splits_as_the_whole(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    reasoning, answer = split_whole(text)
    assert split_chunks(chunks) == (reasoning, answer)
    if not text.lstrip().startswith("<think>"):
        assert (reasoning, answer) == ("", text)  # no block: the text is untouched


async def test_the_stream_moves_the_block_to_reasoning_deltas_and_counts_every_token() -> None:
    async def events() -> AsyncIterator[StreamEvent]:
        yield StreamStart("r", "m", 3)
        for piece in ["<th", "ink>ab", "c</th", "ink>", "\n\nan", "swer"]:
            yield GenerationDelta(0, piece, 1)
        yield GenerationEnd(0, FinishReason.STOP, Usage(3, 6))

    out = [e async for e in reasoning_events(events(), PLAN)]
    deltas = [e for e in out if isinstance(e, GenerationDelta)]
    assert "".join(d.reasoning for d in deltas) == "abc" and "".join(d.text for d in deltas) == "answer"
    assert sum(d.token_count for d in deltas) == 6
    first_text = next(i for i, d in enumerate(deltas) if d.text)
    assert all(not d.reasoning for d in deltas[first_text:])  # reasoning first, then the answer
    result = await collect_stream(reasoning_events(events(), PLAN))
    (gen,) = result.generations
    assert gen.reasoning is not None and gen.reasoning.text == "abc" and gen.text == "answer"


# The generation prompt opens the think block, as DeepSeek-R1's and Qwen3 thinking templates do.
OPENING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
# Mentions the tags (history rendering) but leaves the model to open the block, with Qwen3's switch.
SWITCH_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _engine(kind: str, model: TinyModelPaths, template: str) -> Backend:
    if kind == "llamacpp":
        pytest.importorskip("llama_cpp")
        from gengate.engines.llamacpp import LlamaCppBackend, LlamaCppOptions

        return LlamaCppBackend(
            "tiny",
            LlamaCppOptions(path=str(model.gguf_path), n_ctx=1024, n_threads=1, chat_template=template),
        )
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gengate.engines.transformers import TransformersBackend, TransformersOptions

    return TransformersBackend(
        "tiny", TransformersOptions(model=str(model.hf_dir), max_batch_size=8, chat_template=template)
    )


@pytest.fixture(
    scope="module", params=[("llamacpp", "open"), ("transformers", "open"), ("llamacpp", "switch")]
)
async def backend(request: pytest.FixtureRequest, tiny_model: TinyModelPaths) -> AsyncIterator[Backend]:
    kind, which = request.param
    engine = _engine(kind, tiny_model, OPENING_TEMPLATE if which == "open" else SWITCH_TEMPLATE)
    await engine.start()
    yield engine
    await engine.aclose()


def ask(**fields: Any) -> GenerationRequest:
    fields.setdefault("messages", (ChatMessage(Role.USER, (TextPart("Two digits?"),)),))
    fields.setdefault("stopping", StoppingCriteria(max_tokens=160))
    return GenerationRequest(model="tiny", **fields)


async def test_a_template_with_think_tags_turns_the_parser_on(backend: Backend) -> None:
    assert backend.capabilities.reasoning and backend.capabilities.reasoning_control


async def test_the_constraint_holds_for_the_answer_after_a_capped_think_block(backend: Backend) -> None:
    for seed in range(3):
        req = ask(
            structured_output=StructuredOutput(RegexConstraint("[0-9]{2}")),
            reasoning=ReasoningControl(budget_tokens=4),
            sampling=SamplingParams(seed=seed),
        )
        events = [e async for e in backend.generate_stream(req)]
        deltas = [e for e in events if isinstance(e, GenerationDelta)]
        (end,) = [e for e in events if isinstance(e, GenerationEnd)]
        text, reasoning = "".join(d.text for d in deltas), "".join(d.reasoning for d in deltas)
        assert re.fullmatch("[0-9]{2}", text), (text, reasoning)
        assert "<think>" not in reasoning + text and "</think>" not in reasoning + text
        assert end.finish_reason is FinishReason.STOP
        assert end.usage.output_tokens >= 2 + len(reasoning.split())  # the block's tokens count too
        first_text = next(i for i, d in enumerate(deltas) if d.text)
        assert all(not d.reasoning for d in deltas[first_text + 1 :])  # one delta may hold both


async def test_tool_calls_come_after_the_think_block(backend: Backend) -> None:
    for seed in range(2):
        req = ask(
            tools=TOOLS,
            tool_choice=ToolChoice(ToolChoiceMode.REQUIRED),
            reasoning=ReasoningControl(budget_tokens=3),
            sampling=SamplingParams(seed=seed),
        )
        (gen,) = (await backend.generate(req)).generations
        assert gen.finish_reason is FinishReason.TOOL_CALLS and gen.tool_calls, gen
        assert gen.text == "" and "<tool_call>" not in (gen.reasoning.text if gen.reasoning else "")
        assert_valid_calls(req, gen)


async def test_without_a_constraint_the_split_still_happens(backend: Backend) -> None:
    req = ask(
        reasoning=ReasoningControl(budget_tokens=2),
        stopping=StoppingCriteria(max_tokens=12),
        sampling=SamplingParams(seed=0),
    )
    (gen,) = (await backend.generate(req)).generations
    assert "</think>" not in gen.text and "<think>" not in gen.text


async def test_thinking_switched_off_leaves_the_text_as_it_is(tiny_model: TinyModelPaths) -> None:
    engine = _engine("llamacpp", tiny_model, SWITCH_TEMPLATE)
    await engine.start()
    try:
        req = ask(
            reasoning=ReasoningControl(enabled=False),
            structured_output=StructuredOutput(RegexConstraint("<think>[a-z]{3}</think>[0-9]")),
            sampling=SamplingParams(seed=1),
        )
        (gen,) = (await engine.generate(req)).generations
        assert re.fullmatch("<think>[a-z]{3}</think>[0-9]", gen.text) and gen.reasoning is None
    finally:
        await engine.aclose()


class _FakeTokenizer:
    chat_template = "{{ '<think>' }}"
    bos_token_id = 1

    def apply_chat_template(self, messages: Any, *, tokenize: bool, **kwargs: Any) -> Any:
        return [1, 2] if tokenize else "<|assistant|>\n<think>\n"


def test_vllm_reads_the_block_and_refuses_a_constraint_after_it() -> None:
    from gengate import errors
    from gengate.engines.reasoning import ReasoningConfig
    from gengate.engines.vllm_prompt import vllm_prompt

    ids, plan = vllm_prompt(_FakeTokenizer(), ask(), None, ReasoningConfig())
    assert ids == [1, 2] and plan == ReasoningPlan(TAGS, inside=True)
    assert vllm_prompt(_FakeTokenizer(), ask(), None, ReasoningConfig(reasoning_parser="off"))[1] is None
    with pytest.raises(errors.Unimplemented) as caught:
        vllm_prompt(
            _FakeTokenizer(),
            ask(structured_output=StructuredOutput(RegexConstraint("a"))),
            None,
            ReasoningConfig(),
        )
    assert [v.field for v in caught.value.violations] == ["structured_output"]
    with pytest.raises(errors.Unimplemented) as caught:
        vllm_prompt(
            _FakeTokenizer(), ask(reasoning=ReasoningControl(budget_tokens=3)), None, ReasoningConfig()
        )
    assert [v.field for v in caught.value.violations] == ["reasoning.budget_tokens"]


async def test_enabled_true_is_taken_without_a_switch_and_false_is_refused(
    tiny_model: TinyModelPaths,
) -> None:
    from gengate import errors

    engine = _engine("llamacpp", tiny_model, OPENING_TEMPLATE)  # thinks always, no enable_thinking
    await engine.start()
    try:
        req = ask(
            reasoning=ReasoningControl(enabled=True),
            stopping=StoppingCriteria(max_tokens=4),
            sampling=SamplingParams(seed=0),
        )
        (gen,) = (await engine.generate(req)).generations
        assert gen.reasoning is not None and gen.text == ""  # the 4 tokens are all inside the opened block
        with pytest.raises(errors.Unimplemented) as caught:
            await engine.generate(ask(reasoning=ReasoningControl(enabled=False)))
        assert [v.field for v in caught.value.violations] == ["reasoning.enabled"]
    finally:
        await engine.aclose()
