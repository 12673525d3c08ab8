"""The batched engines (transformers, MLX) on the tiny model, each loaded from the same Hugging Face
folder through its own loader: decoding features, constraints, and real batching. Every test runs
on both engines; the last ones are engine-specific."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from gengate import errors
from gengate.constraints import validate_output
from gengate.constraints.examples import EXAMPLE_CONSTRAINTS
from gengate.domain import (
    ChatMessage,
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GrammarSyntax,
    ImagePart,
    JsonSchemaConstraint,
    Role,
    SamplingParams,
    StoppingCriteria,
    StreamEvent,
    StreamStart,
    StructuredOutput,
    TextPart,
)
from gengate.engines.batching.engine import BatchedEngine
from gengate.engines.mlx import MlxBackend, MlxOptions
from gengate.engines.transformers import TransformersBackend, TransformersOptions
from gengate.models.tiny import TinyModelPaths


def _transformers(name: str, slots: int = 16, **options: object) -> BatchedEngine:
    return TransformersBackend(name, TransformersOptions(**options, max_batch_size=slots))  # type: ignore[arg-type]


def _mlx(name: str, slots: int = 16, **options: object) -> BatchedEngine:
    return MlxBackend(name, MlxOptions(**options, max_batch_size=slots))  # type: ignore[arg-type]


# engine -> (the module its extra installs, a backend of it with `slots` concurrent generations)
ENGINES: dict[str, tuple[str, Callable[..., BatchedEngine]]] = {
    "transformers": ("transformers", _transformers),
    "mlx": ("mlx_lm", _mlx),
}


def make_engine(engine: str, name: str, **options: object) -> BatchedEngine:
    module, build = ENGINES[engine]
    pytest.importorskip(module)
    pytest.importorskip({"transformers": "torch", "mlx_lm": "mlx.core"}[module])
    return build(name, **options)


PROMPT = "Once upon a time there was a small robot"
GREEDY = SamplingParams(temperature=0.0, seed=0)


@pytest.fixture(scope="module", params=list(ENGINES))
async def backend(request: pytest.FixtureRequest, tiny_model: TinyModelPaths) -> AsyncIterator[BatchedEngine]:
    engine = make_engine(request.param, "tiny-hf", model=str(tiny_model.hf_dir))
    await engine.start()
    yield engine
    await engine.aclose()


def request(**fields: object) -> GenerationRequest:
    fields.setdefault("prompt", PROMPT)
    fields.setdefault("stopping", StoppingCriteria(max_tokens=12))
    fields.setdefault("sampling", SamplingParams(seed=7))
    return GenerationRequest(model="tiny-hf", **fields)  # type: ignore[arg-type]


async def events_of(engine: BatchedEngine, req: GenerationRequest) -> list[StreamEvent]:
    return [event async for event in engine.generate_stream(req)]


def token_ids(result_generation_logprobs: object) -> list[int | None]:
    assert isinstance(result_generation_logprobs, tuple)
    return [lp.token_id for lp in result_generation_logprobs]


@pytest.mark.parametrize(("package", "heavy"), [("transformers", "torch"), ("mlx", "mlx.core")])
def test_import_does_not_load_the_framework(package: str, heavy: str) -> None:
    code = f"import sys, gengate.engines.{package} as t; print({heavy!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_options_need_exactly_one_source() -> None:
    with pytest.raises(ValueError):
        TransformersOptions()
    with pytest.raises(ValueError):
        TransformersOptions(model="x", tiny=True)
    with pytest.raises(ValueError):
        TransformersOptions(tiny=True, unknown_key=1)  # type: ignore[call-arg]
    assert TransformersOptions(tiny=True).device == "cpu"


async def test_capabilities(backend: BatchedEngine) -> None:
    caps = backend.capabilities
    assert set(caps.constraints.values()) == {Enforcement.ENGINE} and len(caps.constraints) == 5
    assert caps.grammar_syntaxes == frozenset(GrammarSyntax)
    assert caps.context_length == 2048 and caps.max_n == 16 and caps.max_top_logprobs == 20
    assert caps.seed and caps.logprobs and caps.chat


async def test_text_and_usage(backend: BatchedEngine) -> None:
    result = await backend.generate(request(sampling=GREEDY))
    (gen,) = result.generations
    assert gen.text and gen.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    prompt_tokens = len(backend._loaded.tokenizer(PROMPT)["input_ids"])  # type: ignore[union-attr]
    assert result.usage.input_tokens == prompt_tokens
    assert result.usage.output_tokens == gen.output_tokens > 0
    assert result.effective_sampling.seed == 0
    assert result.timings.time_to_first_token_s is not None and result.timings.queue_s is not None
    assert 0 <= result.timings.queue_s <= result.timings.time_to_first_token_s <= result.timings.total_s  # type: ignore[operator]


async def test_stream_event_order(backend: BatchedEngine) -> None:
    events = await events_of(backend, request(n=3))
    assert isinstance(events[0], StreamStart) and events[0].input_tokens > 0
    assert all(not isinstance(e, StreamStart) for e in events[1:])
    ends = [e for e in events if isinstance(e, GenerationEnd)]
    assert sorted(e.index for e in ends) == [0, 1, 2]
    for end in ends:
        position = events.index(end)
        later = [e for e in events[position + 1 :] if isinstance(e, GenerationDelta) and e.index == end.index]
        assert not later, "a delta came after its generation's end"
        deltas = [e for e in events[:position] if isinstance(e, GenerationDelta) and e.index == end.index]
        assert sum(d.token_count for d in deltas) <= end.usage.output_tokens
        assert end.timings.total_s is not None


async def test_n_generations_differ_and_are_reproducible(backend: BatchedEngine) -> None:
    first = await backend.generate(request(n=4, sampling=SamplingParams(seed=11)))
    assert [g.index for g in first.generations] == [0, 1, 2, 3]
    assert len({g.text for g in first.generations}) > 1
    again = await backend.generate(request(n=4, sampling=SamplingParams(seed=11)))
    assert [g.text for g in again.generations] == [g.text for g in first.generations]
    other = await backend.generate(request(n=4, sampling=SamplingParams(seed=12)))
    assert [g.text for g in other.generations] != [g.text for g in first.generations]


async def test_seeded_result_does_not_depend_on_the_batch(backend: BatchedEngine) -> None:
    target = request(sampling=SamplingParams(seed=5, temperature=0.8), logprobs=0)
    alone = await backend.generate(target)
    noise = [
        request(prompt=f"Numbers: {i} two three", n=2, stopping=StoppingCriteria(max_tokens=20))
        for i in range(5)
    ]
    together = await asyncio.gather(backend.generate(target), *(backend.generate(r) for r in noise))
    assert token_ids(together[0].generations[0].logprobs) == token_ids(alone.generations[0].logprobs)
    assert together[0].generations[0].text == alone.generations[0].text


async def test_joining_a_running_batch_matches_greedy_alone(backend: BatchedEngine) -> None:
    """Sequences that join mid-flight (cache merge) and leave early give the solo greedy tokens."""
    prompts = ["Hello, world! How", "The", "Colours: red green blue yellow orange", "Days: Monday"]
    long = StoppingCriteria(max_tokens=24)
    alone = [
        await backend.generate(request(prompt=p, sampling=GREEDY, logprobs=0, stopping=long)) for p in prompts
    ]

    async def staggered(i: int, prompt: str) -> object:
        await asyncio.sleep(0.01 * i)
        max_tokens = 12 if i % 2 else 24
        return await backend.generate(
            request(
                prompt=prompt, sampling=GREEDY, logprobs=0, stopping=StoppingCriteria(max_tokens=max_tokens)
            )
        )

    await wait_idle(backend)
    backend.stats.max_batch_size = 0
    together = await asyncio.gather(*(staggered(i, p) for i, p in enumerate(prompts)))
    assert backend.stats.max_batch_size > 1, "no request joined a running batch"
    for solo, batched in zip(alone, together, strict=True):
        got = token_ids(batched.generations[0].logprobs)  # type: ignore[attr-defined]
        assert got == token_ids(solo.generations[0].logprobs)[: len(got)]


async def test_stop_sequence(backend: BatchedEngine) -> None:
    free = await backend.generate(request(sampling=GREEDY, stopping=StoppingCriteria(max_tokens=20)))
    text = free.generations[0].text
    stop = text[6:9]
    assert len(stop) == 3
    cut = await backend.generate(
        request(sampling=GREEDY, stopping=StoppingCriteria(max_tokens=20, stop=(stop,)))
    )
    gen = cut.generations[0]
    assert gen.finish_reason is FinishReason.STOP_SEQUENCE and gen.matched_stop == stop
    assert gen.text == text[: text.index(stop)]
    streamed = await events_of(
        backend, request(sampling=GREEDY, stopping=StoppingCriteria(max_tokens=20, stop=(stop,)))
    )
    assert "".join(e.text for e in streamed if isinstance(e, GenerationDelta)) == gen.text


async def test_max_tokens_ends_with_length(backend: BatchedEngine) -> None:
    result = await backend.generate(request(sampling=GREEDY, stopping=StoppingCriteria(max_tokens=5)))
    gen = result.generations[0]
    assert gen.finish_reason is FinishReason.LENGTH and gen.output_tokens == 5


async def test_logprobs(backend: BatchedEngine) -> None:
    result = await backend.generate(
        request(sampling=GREEDY, logprobs=3, stopping=StoppingCriteria(max_tokens=6))
    )
    gen = result.generations[0]
    assert gen.logprobs is not None and len(gen.logprobs) == gen.output_tokens == 6
    for lp in gen.logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 3
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert lp.top[0].token_id == lp.token_id  # greedy picks the most likely token
    # Pieces decode token by token; the text leaves out a trailing incomplete UTF-8 character.
    assert "".join(lp.token for lp in gen.logprobs).startswith(gen.text)


async def test_chat_messages(backend: BatchedEngine) -> None:
    messages = (
        ChatMessage(Role.SYSTEM, (TextPart("You are a helpful assistant."),)),
        ChatMessage(Role.USER, (TextPart("What is your name?"),)),
    )
    result = await backend.generate(
        GenerationRequest(
            model="tiny-hf", messages=messages, sampling=GREEDY, stopping=StoppingCriteria(max_tokens=8)
        )
    )
    tokenizer = backend._loaded.tokenizer  # type: ignore[union-attr]
    rendered = tokenizer.apply_chat_template(
        [{"role": m.role.value, "content": m.text} for m in messages],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered.endswith("<|im_start|>assistant\n")
    assert result.usage.input_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert result.generations[0].output_tokens > 0


async def test_images_are_refused_by_field(backend: BatchedEngine) -> None:
    messages = (
        ChatMessage(Role.USER, (TextPart("hi"),)),
        ChatMessage(Role.USER, (TextPart("look:"), ImagePart(data=b"\x89PNG", mime_type="image/png"))),
    )
    with pytest.raises(errors.InvalidArgument) as caught:
        await backend.generate(GenerationRequest(model="tiny-hf", messages=messages))
    assert caught.value.violations[0].field == "messages[1].content[1].image"


async def test_deadline_ends_with_time_limit(backend: BatchedEngine) -> None:
    req = request(stopping=StoppingCriteria(max_tokens=1500), deadline=time.monotonic() + 0.3)
    result = await backend.generate(req)
    gen = result.generations[0]
    assert gen.finish_reason in (FinishReason.TIME_LIMIT, FinishReason.STOP)
    assert gen.finish_reason is FinishReason.STOP or gen.output_tokens < 1500


@pytest.mark.parametrize("name", list(EXAMPLE_CONSTRAINTS))
async def test_every_constraint_holds(backend: BatchedEngine, name: str) -> None:
    structured = StructuredOutput(EXAMPLE_CONSTRAINTS[name])
    max_tokens = 200 if name == "json_object" else 60
    result = await backend.generate(
        request(n=4, structured_output=structured, stopping=StoppingCriteria(max_tokens=max_tokens))
    )
    assert result.enforcement is Enforcement.ENGINE
    stopped = [g for g in result.generations if g.finish_reason is FinishReason.STOP]
    for gen in stopped:
        assert validate_output(structured, gen.text) is None, gen.text
    if name != "json_object":  # bounded languages always finish within the budget
        assert len(stopped) == 4


FORCING_SCHEMA = JsonSchemaConstraint(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "size": {"enum": ["small", "medium", "large"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["name", "size", "count"],
        "additionalProperties": False,
    }
)


async def test_forced_tokens_join_the_rows_next_pass(backend: BatchedEngine) -> None:
    """Jump-forward on transformers: the tokens a constraint forces after a sampled one are fed
    with it in the next pass of a row alone (in a batch they would widen every row's pass), and
    they are the tokens of stepping each (logprobs on: every token needs its logits), alone or
    batched with others. MLX's batch cache cannot take runs: one token a row a pass there."""
    structured = StructuredOutput(FORCING_SCHEMA)
    reqs = [
        request(prompt=f"Item {i}:", structured_output=structured, stopping=StoppingCriteria(max_tokens=60),
                sampling=SamplingParams(seed=i, temperature=0.0 if i % 2 else 1.0))
        for i in range(4)
    ]  # fmt: skip
    await wait_idle(backend)
    stats = backend.stats
    passes = tokens = 0
    for req in reqs:  # alone: a row takes its forced runs
        by_step = (await backend.generate(dataclasses.replace(req, logprobs=0))).generations[0]
        decodes, made = stats.decode_passes, stats.tokens_generated
        by_jump = (await backend.generate(req)).generations[0]
        passes, tokens = passes + stats.decode_passes - decodes, tokens + stats.tokens_generated - made
        assert (by_jump.text, by_jump.finish_reason) == (by_step.text, by_step.finish_reason)
        assert by_jump.finish_reason is FinishReason.STOP
        assert validate_output(structured, by_jump.text) is None, by_jump.text
    # Both engines prefill the tokens forced before the first sampled one (the schema's `{"name":"`);
    # transformers also feeds a lone row's later runs with the token before them.
    assert passes < tokens - len(reqs), "forced tokens had passes of their own"
    if backend._loaded.scheduler.batch.feeds_runs:  # type: ignore[union-attr]
        assert passes < tokens - len(reqs) - 5 * len(reqs), "forced runs had passes of their own"
    stepped = await asyncio.gather(*(backend.generate(dataclasses.replace(r, logprobs=0)) for r in reqs))
    jumped = await asyncio.gather(*(backend.generate(r) for r in reqs))  # together, then the last alone
    for one, other in zip(stepped, jumped, strict=True):
        assert one.generations[0].text == other.generations[0].text


async def test_a_run_cut_at_max_run_and_a_join_after_a_run(
    tiny_model: TinyModelPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers: a run longer than MAX_RUN goes into several passes; a request joining while
    the row alone was fed a run (its next decode feeds several tokens) gives the stepped text."""
    from gengate.engines.batching import scheduler

    engine = make_engine("transformers", "tiny-hf", model=str(tiny_model.hf_dir))
    await engine.start()
    try:
        monkeypatch.setattr(scheduler, "MAX_RUN", 3)
        literal = {"type": "object", "properties": {"note": {"const": "abc " * 30}}, "required": ["note"]}
        long_run = request(
            structured_output=StructuredOutput(JsonSchemaConstraint(literal)),
            stopping=StoppingCriteria(max_tokens=100),
            sampling=GREEDY,
        )
        stats = engine.stats
        decodes, made = stats.decode_passes, stats.tokens_generated
        (alone,) = (await engine.generate(long_run)).generations
        passes, tokens = stats.decode_passes - decodes, stats.tokens_generated - made
        assert alone.finish_reason is FinishReason.STOP and tokens >= 30
        assert (tokens - 3) / 3 - 1 <= passes < tokens - 1, (passes, tokens)  # a lead and runs of at most 3

        monkeypatch.setattr(scheduler, "MAX_RUN", 32)
        other = request(prompt="Numbers: one two", sampling=GREEDY, stopping=StoppingCriteria(max_tokens=16))
        solo = [
            (await engine.generate(dataclasses.replace(r, logprobs=0))).generations[0].text
            for r in (long_run, other)
        ]
        batch = engine._loaded.scheduler.batch  # type: ignore[union-attr]
        join = batch.join
        fed_at_join: list[int] = []

        def spied(active: list[Any], joining: list[Any]) -> Any:
            fed_at_join.extend(s.unfed for s in active)
            return join(active, joining)

        monkeypatch.setattr(batch, "join", spied)
        for _ in range(5):
            stream = engine.generate_stream(long_run)
            texts: dict[str, str] = {"long": ""}
            joined: asyncio.Task[Any] | None = None
            async for event in stream:
                if isinstance(event, GenerationDelta):
                    texts["long"] += event.text
                    if joined is None:
                        joined = asyncio.create_task(engine.generate(other))
            assert joined is not None
            texts["other"] = (await joined).generations[0].text
            assert [texts["long"], texts["other"]] == solo
            if any(n > 1 for n in fed_at_join):
                break
        assert any(n > 1 for n in fed_at_join), "no request joined while the lone row was fed a run"
    finally:
        await engine.aclose()


async def test_a_deadline_inside_a_run_ends_it(
    tiny_model: TinyModelPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers: the deadline is looked at before each forced token of a row's run."""
    from gengate.engines import decoding

    engine = make_engine("transformers", "tiny-hf", model=str(tiny_model.hf_dir))
    await engine.start()
    try:
        scheduler = engine._loaded.scheduler  # type: ignore[union-attr]
        submitted: list[Any] = []
        submit = scheduler.submit

        def keep(seq: Any) -> None:
            submitted.append(seq)
            submit(seq)

        monkeypatch.setattr(scheduler, "submit", keep)
        step_forced = decoding.SequenceDecoder.step_forced
        taken = [0]

        def forced_then_late(self: Any) -> Any:
            taken[0] += 1
            if taken[0] == 3:  # mid-run, on the scheduler's thread: the row's deadline passes
                submitted[0].deadline = time.monotonic() - 1.0
            return step_forced(self)

        monkeypatch.setattr(decoding.SequenceDecoder, "step_forced", forced_then_late)
        literal = {"type": "object", "properties": {"note": {"const": "abc " * 30}}, "required": ["note"]}
        result = await engine.generate(
            request(
                structured_output=StructuredOutput(JsonSchemaConstraint(literal)),
                stopping=StoppingCriteria(max_tokens=100),
                sampling=GREEDY,
            )
        )
        (gen,) = result.generations
        assert gen.finish_reason is FinishReason.TIME_LIMIT
        assert gen.output_tokens <= 4, "the run went on past the deadline"
    finally:
        await engine.aclose()


async def test_validated_constraint_retries_then_validates_or_aborts(
    backend: BatchedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uniqueItems is not enforced by the engine (VALIDATED): bad generations are re-generated."""
    from gengate.engines.batching import request as request_module

    launches = 0
    launch = request_module.RequestRun._launch

    def counting(self: request_module.RequestRun, gen: object) -> None:
        nonlocal launches
        launches += 1
        launch(self, gen)  # type: ignore[arg-type]

    monkeypatch.setattr(request_module.RequestRun, "_launch", counting)
    schema = {"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    structured = StructuredOutput(JsonSchemaConstraint(schema))
    outcomes = []
    for seed in range(16):  # until one was re-generated (most draws here are unique: ~1 in 10 is not)
        if launches > 4 * len(outcomes) and "validated" in outcomes:
            break
        req = request(n=4, structured_output=structured, sampling=SamplingParams(seed=seed))
        try:
            result = await backend.generate(req)
        except errors.Aborted as exc:
            assert exc.reason == "VALIDATION_FAILED" and "non-unique" in exc.message
            outcomes.append("aborted")
            continue
        assert result.enforcement is Enforcement.VALIDATED
        for gen in result.generations:
            assert gen.finish_reason is FinishReason.STOP and validate_output(structured, gen.text) is None
        outcomes.append("validated")
    assert launches > 4 * len(outcomes), "no generation was re-generated"
    assert "validated" in outcomes
    seed = outcomes.index("validated")
    events = await events_of(
        backend, request(n=4, structured_output=structured, sampling=SamplingParams(seed=seed))
    )
    deltas = [e for e in events if isinstance(e, GenerationDelta)]
    assert sorted(d.index for d in deltas) == [0, 1, 2, 3], "validated text is released once, whole"
    assert all(validate_output(structured, d.text) is None for d in deltas)


async def wait_idle(engine: BatchedEngine) -> None:
    """Waits until sequences cancelled by earlier tests have left the scheduler."""
    for _ in range(200):
        if engine.stats.active == 0 and engine.stats.waiting == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the scheduler did not become idle")


async def test_requests_run_as_real_batches(backend: BatchedEngine) -> None:
    await wait_idle(backend)
    stats = backend.stats
    passes, biggest = stats.forward_passes, stats.max_batch_size
    stats.max_batch_size = 0
    reqs = [
        request(prompt=f"Request {i}: the weather is", stopping=StoppingCriteria(max_tokens=16))
        for i in range(8)
    ]
    results = await asyncio.gather(*(backend.generate(r) for r in reqs))
    generated = sum(r.usage.output_tokens for r in results)
    assert generated > 8 * 4
    assert stats.max_batch_size > 1
    # One pass per step for the whole batch (plus a prefill per join), not one per token.
    assert stats.forward_passes - passes < generated / 3, (stats.forward_passes - passes, generated)
    stats.max_batch_size = max(stats.max_batch_size, biggest)


@pytest.mark.parametrize("engine_kind", list(ENGINES))
async def test_cancellation_frees_the_slot(
    tiny_model: TinyModelPaths, monkeypatch: pytest.MonkeyPatch, engine_kind: str
) -> None:
    monkeypatch.setenv("GENGATE_CACHE", str(tiny_model.hf_dir.parent.parent))  # `tiny: true` finds it built
    engine = make_engine(engine_kind, "one-slot", tiny=True, slots=1)
    assert engine.capabilities.context_length == 2048  # declared before loading
    await engine.start()
    try:
        stream = engine.generate_stream(
            request(stopping=StoppingCriteria(max_tokens=1500), sampling=SamplingParams(seed=3))
        )
        seen = 0
        async for event in stream:
            seen += isinstance(event, GenerationDelta)
            if seen >= 3:
                break
        await stream.aclose()  # type: ignore[attr-defined]
        result = await asyncio.wait_for(engine.generate(request(sampling=GREEDY)), timeout=30)
        assert result.generations[0].output_tokens > 0
        for _ in range(100):
            if engine.stats.active == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats.active == 0 and engine.stats.tokens_generated < 200
    finally:
        await engine.aclose()


@pytest.mark.gpu
async def test_gpu_batches_and_agrees_with_cpu(tiny_model: TinyModelPaths, backend: BatchedEngine) -> None:
    if not isinstance(backend, TransformersBackend):
        pytest.skip("the transformers engine's CUDA device")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = TransformersBackend("tiny-gpu", TransformersOptions(model=str(tiny_model.hf_dir), device="cuda"))
    await engine.start()
    try:
        reqs = [request(prompt=f"Day {i}: Monday", sampling=GREEDY, logprobs=0) for i in range(8)]
        on_gpu = await asyncio.gather(*(engine.generate(r) for r in reqs))
        on_cpu = await asyncio.gather(*(backend.generate(r) for r in reqs))
        assert engine.stats.max_batch_size > 1
        first = [token_ids(r.generations[0].logprobs)[0] for r in on_gpu]
        assert first == [token_ids(r.generations[0].logprobs)[0] for r in on_cpu]
        structured = StructuredOutput(EXAMPLE_CONSTRAINTS["json_schema"])
        result = await engine.generate(
            request(n=4, structured_output=structured, stopping=StoppingCriteria(max_tokens=60))
        )
        for gen in result.generations:
            assert gen.finish_reason is FinishReason.STOP and validate_output(structured, gen.text) is None
    finally:
        await engine.aclose()


async def test_empty_prompt_starts_from_bos_and_effective_stopping(backend: BatchedEngine) -> None:
    events = backend.generate_stream(request(prompt="", stopping=StoppingCriteria()))
    start = await anext(events)
    await events.aclose()  # type: ignore[attr-defined]
    assert isinstance(start, StreamStart)
    assert start.input_tokens == 1
    assert start.effective_stopping.max_tokens == 2048 - 1  # no max_tokens: up to the context


async def test_n_above_max_is_refused(backend: BatchedEngine) -> None:
    with pytest.raises(errors.InvalidArgument) as caught:
        await backend.generate(request(n=17))
    assert caught.value.violations[0].field == "n"


async def test_min_tokens_and_ignore_eos_hold_eos_back(backend: BatchedEngine) -> None:
    """A generation that ends by EOS early: min_tokens moves the earliest end, ignore_eos removes it."""
    long = StoppingCriteria(max_tokens=120)
    early = None
    for seed in range(40):
        result = await backend.generate(request(n=4, sampling=SamplingParams(seed=seed), stopping=long))
        early = next((g for g in result.generations if g.finish_reason is FinishReason.STOP), None)
        if early is not None:
            break
    assert early is not None, "no seed ended by EOS within 120 tokens"
    sampling = SamplingParams(seed=seed)
    held = await backend.generate(
        request(
            n=4, sampling=sampling, stopping=long, backend_options={"min_tokens": early.output_tokens + 5}
        )
    )
    assert all(g.output_tokens >= early.output_tokens + 5 for g in held.generations)
    endless = await backend.generate(
        request(n=4, sampling=sampling, stopping=long, backend_options={"ignore_eos": True})
    )
    assert all(g.finish_reason is FinishReason.LENGTH and g.output_tokens == 120 for g in endless.generations)
