"""The llama.cpp backend on the tiny GGUF, used directly (no gRPC)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (extra: llamacpp)")

from gengate import errors
from gengate.backend import Backend
from gengate.constraints import validate_output
from gengate.constraints.retries import VALIDATION_RETRIES
from gengate.domain import (
    ChatMessage,
    ChoiceConstraint,
    Constraint,
    ConstraintKind,
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GenerationResult,
    GrammarConstraint,
    GrammarSyntax,
    ImagePart,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    Role,
    SamplingParams,
    StoppingCriteria,
    StreamEvent,
    StreamStart,
    StructuredOutput,
    TextPart,
)
from gengate.engines.llamacpp import LlamaCppBackend, LlamaCppOptions
from gengate.engines.options import EngineOptions
from gengate.models.tiny import TinyModelPaths

PROMPT = "Hello world, the answer is"


@pytest.fixture(scope="module")
async def backend(tiny_model: TinyModelPaths) -> AsyncIterator[LlamaCppBackend]:
    b = LlamaCppBackend("tiny", LlamaCppOptions(path=str(tiny_model.gguf_path), n_ctx=1024, n_threads=1))
    await b.start()
    yield b
    await b.aclose()


def _request(**kwargs: Any) -> GenerationRequest:
    kwargs.setdefault("prompt", PROMPT)
    kwargs.setdefault("sampling", SamplingParams(seed=1))
    kwargs.setdefault("stopping", StoppingCriteria(max_tokens=24))
    return GenerationRequest(model="tiny", **kwargs)


async def _events(backend: LlamaCppBackend, request: GenerationRequest) -> list[StreamEvent]:
    return [event async for event in backend.generate_stream(request)]


def test_is_a_backend_with_declared_capabilities() -> None:
    b = LlamaCppBackend("x", LlamaCppOptions(tiny=True, n_ctx=512))
    assert isinstance(b, Backend)
    caps = b.capabilities
    assert caps.constraints == {kind: Enforcement.ENGINE for kind in ConstraintKind}
    assert caps.grammar_syntaxes == {GrammarSyntax.LARK, GrammarSyntax.GBNF, GrammarSyntax.EBNF}
    assert (caps.max_n, caps.logprobs, caps.max_top_logprobs, caps.seed, caps.chat) == (
        16,
        True,
        20,
        True,
        True,
    )
    assert caps.context_length == 512


def test_options_need_exactly_one_model() -> None:
    with pytest.raises(ValueError):
        LlamaCppOptions()
    with pytest.raises(ValueError):
        LlamaCppOptions(path="a.gguf", tiny=True)
    with pytest.raises(ValueError):
        LlamaCppOptions.model_validate({"path": "a.gguf", "n_gpu": 1})
    assert LlamaCppBackend("x", LlamaCppOptions(path="~/m.gguf")).model_path == Path.home() / "m.gguf"


async def test_tiny_option_builds_into_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GENGATE_CACHE", str(tmp_path))
    b = LlamaCppBackend("t", LlamaCppOptions(tiny=True, n_ctx=256, n_threads=1))
    await b.start()
    try:
        assert b.model_path == tmp_path / "tiny" / "tiny.gguf"
        result = await b.generate(_request(stopping=StoppingCriteria(max_tokens=4)))
        assert result.generations[0].output_tokens > 0
    finally:
        await b.aclose()


async def test_text_usage_and_length(backend: LlamaCppBackend) -> None:
    result = await backend.generate(
        _request(stopping=StoppingCriteria(max_tokens=12), sampling=SamplingParams(seed=3, temperature=0.5))
    )
    prompt_tokens = backend._llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    assert result.usage.input_tokens == len(prompt_tokens)
    (gen,) = result.generations
    assert gen.text
    assert gen.finish_reason is FinishReason.LENGTH
    assert gen.output_tokens == 12 == result.usage.output_tokens
    assert result.effective_sampling.seed == 3
    assert result.enforcement is Enforcement.NONE


async def test_unseeded_request_echoes_the_seed_it_used(backend: LlamaCppBackend) -> None:
    first = await backend.generate(_request(sampling=SamplingParams()))
    seed = first.effective_sampling.seed
    assert seed is not None
    again = await backend.generate(_request(sampling=SamplingParams(seed=seed)))
    assert again.generations[0].text == first.generations[0].text


async def test_stream_event_order(backend: LlamaCppBackend) -> None:
    events = await _events(backend, _request(n=3))
    assert isinstance(events[0], StreamStart)
    assert not any(isinstance(e, StreamStart) for e in events[1:])
    ended: set[int] = set()
    tokens: dict[int, int] = {}
    for event in events[1:]:
        assert isinstance(event, GenerationDelta | GenerationEnd)
        assert event.index not in ended, "no event of an index after its end"
        if isinstance(event, GenerationDelta):
            tokens[event.index] = tokens.get(event.index, 0) + event.token_count
        else:
            ended.add(event.index)
            assert event.usage.output_tokens == tokens[event.index]
            assert event.usage.input_tokens == events[0].input_tokens
            assert event.timings.total_s is not None and event.timings.time_to_first_token_s is not None
    assert ended == {0, 1, 2}
    assert isinstance(events[-1], GenerationEnd)


async def test_n_generations_differ_and_seed_reproduces(backend: LlamaCppBackend) -> None:
    a = await backend.generate(_request(n=3, sampling=SamplingParams(seed=11)))
    texts = [g.text for g in a.generations]
    assert [g.index for g in a.generations] == [0, 1, 2]
    assert len(set(texts)) == 3
    # another prompt in between: the KV cache prefix reuse must not change results
    await backend.generate(_request(prompt="Something else entirely", sampling=SamplingParams(seed=2)))
    b = await backend.generate(_request(n=3, sampling=SamplingParams(seed=11)))
    assert [g.text for g in b.generations] == texts
    c = await backend.generate(_request(n=3, sampling=SamplingParams(seed=12)))
    assert [g.text for g in c.generations] != texts


async def test_stop_sequence_cuts_text(backend: LlamaCppBackend) -> None:
    plain = (await backend.generate(_request(stopping=StoppingCriteria(max_tokens=40)))).generations[0].text
    stop = plain[len(plain) // 2 : len(plain) // 2 + 3]
    assert len(stop) == 3
    stopped_request = _request(stopping=StoppingCriteria(max_tokens=40, stop=("zzzq", stop)))
    result = await backend.generate(stopped_request)
    gen = result.generations[0]
    assert gen.finish_reason is FinishReason.STOP_SEQUENCE
    assert gen.matched_stop == stop
    assert gen.text == plain[: plain.index(stop)]
    streamed = "".join(
        e.text for e in await _events(backend, stopped_request) if isinstance(e, GenerationDelta)
    )
    assert streamed == gen.text


async def test_logprobs_with_top_alternatives(backend: LlamaCppBackend) -> None:
    greedy = await backend.generate(_request(logprobs=5, sampling=SamplingParams(temperature=0.0), n=1))
    gen = greedy.generations[0]
    assert gen.logprobs is not None and len(gen.logprobs) == gen.output_tokens == 24
    assert "".join(lp.token for lp in gen.logprobs) == gen.text
    for lp in gen.logprobs:
        assert lp.logprob <= 0.0 and len(lp.top) == 5
        tops = [t.logprob for t in lp.top]
        assert tops == sorted(tops, reverse=True)
        assert lp.top[0].token_id == lp.token_id and lp.top[0].logprob == pytest.approx(lp.logprob)
    none = await backend.generate(_request())
    assert none.generations[0].logprobs is None


async def test_chat_messages_use_the_template(backend: LlamaCppBackend) -> None:
    messages = (
        ChatMessage(Role.SYSTEM, (TextPart("Be brief."),)),
        ChatMessage(Role.USER, (TextPart("Hi"),)),
    )
    result = await backend.generate(_request(prompt=None, messages=messages))
    rendered = (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    expected = backend._llm.tokenize(rendered.encode(), add_bos=False, special=True)
    assert expected[:2] == [1, 3], "bos and <|im_start|> are single special tokens"
    assert result.usage.input_tokens == len(expected)
    assert result.generations[0].output_tokens > 0


async def test_images_are_refused_by_field(backend: LlamaCppBackend) -> None:
    messages = (ChatMessage(Role.USER, (TextPart("What is this?"), ImagePart(url="http://x/y.png"))),)
    with pytest.raises(errors.InvalidArgument) as info:
        await backend.generate(_request(prompt=None, messages=messages))
    assert info.value.violations[0].field == "messages[0].content[1].image"


async def test_prompt_longer_than_context_is_refused(backend: LlamaCppBackend) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        await backend.generate(_request(prompt="one two three " * 400))
    assert info.value.reason == "PROMPT_TOO_LONG"  # the same reason on every local engine
    assert info.value.violations[0].field == "prompt"


async def test_max_tokens_is_capped_by_the_context(backend: LlamaCppBackend) -> None:
    def room_after(prompt: str) -> int:
        return 1024 - len(backend._llm.tokenize(prompt.encode(), add_bos=True, special=True))

    prompt = "one two three "
    while room_after(prompt + "one two three ") > 0:
        prompt += "one two three "
    room = room_after(prompt)
    assert 0 < room < 50
    result = await backend.generate(
        _request(
            prompt=prompt,
            stopping=StoppingCriteria(max_tokens=500),
            sampling=SamplingParams(seed=5, temperature=0.3),
        )
    )
    gen = result.generations[0]
    assert gen.output_tokens <= room
    if gen.finish_reason is FinishReason.LENGTH:
        assert gen.output_tokens == room


async def test_cancellation_stops_generating(backend: LlamaCppBackend) -> None:
    request = _request(
        stopping=StoppingCriteria(max_tokens=1000), sampling=SamplingParams(seed=4, temperature=0.3)
    )
    before = backend.tokens_generated
    stream = backend.generate_stream(request)
    deltas = 0
    async for event in stream:
        deltas += isinstance(event, GenerationDelta)
        if deltas == 2:
            break
    await stream.aclose()
    await asyncio.sleep(0.05)
    after_close = backend.tokens_generated
    await asyncio.sleep(0.3)
    assert backend.tokens_generated == after_close, "the worker kept generating after the stream closed"
    assert after_close - before < 1000
    # the worker is free for the next request
    result = await backend.generate(_request(stopping=StoppingCriteria(max_tokens=5)))
    assert result.generations[0].output_tokens == 5


async def test_task_cancellation_stops_generating(backend: LlamaCppBackend) -> None:
    request = _request(
        stopping=StoppingCriteria(max_tokens=1000), sampling=SamplingParams(seed=4, temperature=0.3), n=16
    )
    task = asyncio.create_task(backend.generate(request))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    after = backend.tokens_generated
    await asyncio.sleep(0.3)
    assert backend.tokens_generated == after


_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

CONSTRAINTS: dict[str, Constraint] = {
    "json_schema": JsonSchemaConstraint(_SCHEMA),
    "regex": RegexConstraint(r"[A-Z][a-z]{2,6} [0-9]{1,3}(\.[0-9])?"),
    "choice": ChoiceConstraint(("positive", "negative", "neutral")),
    "lark": GrammarConstraint(
        GrammarSyntax.LARK,
        'start: expr\nexpr: NUMBER | "(" expr OP expr ")"\nOP: "+" | "*"\nNUMBER: /[0-9]{1,3}/',
    ),
    "gbnf": GrammarConstraint(GrammarSyntax.GBNF, 'root ::= ("yes" | "no") " " [0-9] [0-9]? "!"'),
    "json_object": JsonObjectConstraint(),
}


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
async def test_every_constraint_kind_holds(backend: LlamaCppBackend, name: str) -> None:
    structured = StructuredOutput(CONSTRAINTS[name])
    result = await backend.generate(
        _request(
            n=6,
            structured_output=structured,
            # random weights write long JSON strings: give free-form JSON room to close
            stopping=StoppingCriteria(max_tokens=400 if name == "json_object" else 120),
            sampling=SamplingParams(seed=7),
        )
    )
    assert result.enforcement is Enforcement.ENGINE
    finished = [g for g in result.generations if g.finish_reason is FinishReason.STOP]
    assert finished, f"no generation finished: {[g.text for g in result.generations]}"
    for gen in finished:
        assert validate_output(structured, gen.text) is None, gen.text


async def test_constraint_holds_when_streamed(backend: LlamaCppBackend) -> None:
    structured = StructuredOutput(CONSTRAINTS["choice"])
    events = await _events(backend, _request(n=3, structured_output=structured))
    assert isinstance(events[0], StreamStart) and events[0].enforcement is Enforcement.ENGINE
    for index in range(3):
        text = "".join(e.text for e in events if isinstance(e, GenerationDelta) and e.index == index)
        assert text in CONSTRAINTS["choice"].choices


async def test_bad_constraint_is_refused(backend: LlamaCppBackend) -> None:
    with pytest.raises(errors.InvalidArgument):
        await backend.generate(_request(structured_output=StructuredOutput(RegexConstraint("(unclosed"))))


async def _validated(backend: LlamaCppBackend, seed: int) -> GenerationResult | errors.Aborted:
    schema = {
        "type": "array",
        "items": {"enum": ["a", "b", "c", "d", "e"]},
        "minItems": 2,
        "maxItems": 2,
        "uniqueItems": True,
    }
    request = _request(
        n=3,
        structured_output=StructuredOutput(JsonSchemaConstraint(schema)),
        stopping=StoppingCriteria(max_tokens=60),
        sampling=SamplingParams(seed=seed),
    )
    try:
        return await backend.generate(request)
    except errors.Aborted as exc:
        return exc


async def test_validated_constraint_never_returns_an_invalid_result(backend: LlamaCppBackend) -> None:
    outcomes = [await _validated(backend, seed) for seed in range(4)]
    results = [o for o in outcomes if isinstance(o, GenerationResult)]
    assert results, "every request failed validation"
    stopped = 0
    for outcome in outcomes:
        if isinstance(outcome, errors.Aborted):
            assert outcome.reason == "VALIDATION_FAILED"
            continue
        assert outcome.enforcement is Enforcement.VALIDATED
        for gen in outcome.generations:
            if gen.finish_reason is FinishReason.STOP:
                assert len(set(json.loads(gen.text))) == 2, gen.text  # two different strings
                stopped += 1
    assert stopped > 0, "no generation finished, so none was checked"


async def test_validated_text_streams_only_once_valid(backend: LlamaCppBackend) -> None:
    schema = {"type": "string", "format": "jsonpath", "maxLength": 6}  # unknown format: relaxed
    structured = StructuredOutput(JsonSchemaConstraint(schema))
    events = await _events(
        backend, _request(n=2, structured_output=structured, stopping=StoppingCriteria(max_tokens=40))
    )
    assert isinstance(events[0], StreamStart) and events[0].enforcement is Enforcement.VALIDATED
    stopped = 0
    for index in range(2):
        deltas = [e for e in events if isinstance(e, GenerationDelta) and e.index == index]
        end = next(e for e in events if isinstance(e, GenerationEnd) and e.index == index)
        if end.finish_reason is FinishReason.STOP:
            assert len(deltas) == 1, "a validated generation arrives in one piece"
            assert validate_output(structured, deltas[0].text) is None
            assert deltas[0].token_count == end.usage.output_tokens
            stopped += 1
        else:  # cut by max_tokens: the text is sent as is, in one piece too
            assert len(deltas) <= 1
    assert stopped > 0, "no generation finished, so none was checked"


_IMPOSSIBLE = {"type": "array", "items": {"enum": ["a"]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}


async def test_validation_failure_is_retried_then_aborted(backend: LlamaCppBackend) -> None:
    # the relaxed form (uniqueness dropped) only allows ["a","a"], which the original refuses
    structured = StructuredOutput(JsonSchemaConstraint(_IMPOSSIBLE))
    before = backend.tokens_generated
    stream = backend.generate_stream(
        _request(structured_output=structured, stopping=StoppingCriteria(max_tokens=40))
    )
    events: list[StreamEvent] = []
    with pytest.raises(errors.Aborted) as info:
        async for event in stream:
            events.append(event)
    assert info.value.reason == "VALIDATION_FAILED"
    assert [type(e) for e in events] == [StreamStart], "no text of an invalid result is streamed"
    tries = 1 + VALIDATION_RETRIES
    assert backend.tokens_generated - before >= tries * 5, "every try generated its ≥5 tokens"
    assert f"did not validate in {tries} tries" in info.value.message


async def test_length_cut_results_are_not_validated(backend: LlamaCppBackend) -> None:
    structured = StructuredOutput(JsonSchemaConstraint(_IMPOSSIBLE))
    result = await backend.generate(
        _request(structured_output=structured, stopping=StoppingCriteria(max_tokens=3))
    )
    gen = result.generations[0]
    assert gen.finish_reason is FinishReason.LENGTH and gen.output_tokens == 3
    assert result.enforcement is Enforcement.VALIDATED


async def test_concurrent_requests_take_turns_and_stay_reproducible(backend: LlamaCppBackend) -> None:
    requests = [
        _request(prompt=p, n=2, sampling=SamplingParams(seed=s))
        for s, p in enumerate(["Hi", "Tell me", "Why"])
    ]
    sequential = [await backend.generate(r) for r in requests]
    concurrent = await asyncio.gather(*(backend.generate(r) for r in requests))
    for one, other in zip(sequential, concurrent, strict=True):
        assert [g.text for g in one.generations] == [g.text for g in other.generations]


async def test_expired_deadline_ends_with_time_limit(backend: LlamaCppBackend) -> None:
    result = await backend.generate(_request(deadline=time.monotonic() - 1.0))
    gen = result.generations[0]
    assert gen.finish_reason is FinishReason.TIME_LIMIT and gen.output_tokens == 0


# Token ids of seeded generations, recorded before the sampler's fast paths were added: the
# documented guarantee is that a seed reproduces its output, so these must never drift by accident.
PINNED_IDS: dict[str, tuple[dict[str, Any], list[list[int]]]] = {
    "greedy": (
        dict(temperature=0.0),
        [[975, 133, 928, 686, 139, 911, 738, 880, 396, 148, 53, 672]] * 3,
    ),
    "temperature 1": (
        dict(temperature=1.0),
        [
            [664, 930, 301, 960, 335, 452, 634, 572, 743, 98, 755, 583],
            [299, 347, 822, 133, 605, 922, 235, 95, 14, 560, 527, 288],
            [159, 208, 991, 750, 138, 210, 376, 325, 686, 153, 334, 646],
        ],
    ),
    "temperature 0.8 top_p 0.9": (
        dict(temperature=0.8, top_p=0.9),
        [
            [822, 739, 738, 913, 170, 742, 683, 16, 288, 0, 520, 426],
            [347, 680, 725, 166, 348, 548, 170, 28, 822, 855, 266, 321],
            [159, 269, 619, 426, 141, 411, 780, 266, 547, 272, 928, 1015],
        ],
    ),
    "top_k 5": (
        dict(top_k=5),
        [
            [159, 346, 857, 674, 389, 877, 548, 509, 509, 143, 686, 193],
            [664, 750, 252, 26, 164, 558, 300, 128, 485, 626, 135, 653],
            [347, 716, 460, 725, 239, 466, 240, 568, 288, 949, 415, 559],
        ],
    ),
}


@pytest.mark.parametrize("name", PINNED_IDS)
async def test_seeded_token_ids_are_pinned(backend: LlamaCppBackend, name: str) -> None:
    sampling, expected = PINNED_IDS[name]
    for seed, ids in zip((1, 2, 3), expected, strict=True):
        request = _request(
            sampling=SamplingParams(seed=seed, **sampling), stopping=StoppingCriteria(max_tokens=12)
        )
        with_logprobs = (await backend.generate(replace(request, logprobs=0))).generations[0]
        assert with_logprobs.logprobs is not None
        assert [lp.token_id for lp in with_logprobs.logprobs] == ids, (name, seed)
        plain = (await backend.generate(request)).generations[0]  # logprobs off: the fast paths
        assert plain.text == with_logprobs.text == backend._llm.detokenize(ids).decode("utf-8", "replace")


async def test_cached_detokenize_matches_llama(backend: LlamaCppBackend) -> None:
    llm = backend._llm
    tokens = list(range(llm.n_vocab()))
    for _ in range(2):  # filling the cache, then from it
        assert [backend._detokenize([t]) for t in tokens] == [llm.detokenize([t]) for t in tokens]
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    assert backend._detokenize(prompt) == llm.detokenize(prompt)  # several tokens: BOS rules kept


class _Passes:
    """Forward passes and tokens of a backend from now on."""

    def __init__(self, backend: LlamaCppBackend) -> None:
        self.backend = backend
        self.start = (backend.forward_passes, backend.tokens_generated)

    def passes(self) -> int:
        return self.backend.forward_passes - self.start[0]

    def tokens(self) -> int:
        return self.backend.tokens_generated - self.start[1]


FORCING: dict[str, Constraint] = {
    "json_schema": CONSTRAINTS["json_schema"],
    "regex": RegexConstraint(r"id-[0-9]{2,4}: (yes|no), value=[a-z]{1,5}!"),
    "gbnf": CONSTRAINTS["gbnf"],
}


@pytest.mark.parametrize("name", FORCING)
async def test_forced_tokens_share_a_forward_pass_and_give_the_stepped_text(
    backend: LlamaCppBackend, name: str
) -> None:
    """Jump-forward: tokens the constraint forces after a sampled one go into its forward pass.
    With logprobs every token has its own pass (each needs its logits): the same text comes out
    (the logits after a run may differ in their last bits; these seeds meet no near-tie)."""
    structured = StructuredOutput(FORCING[name])
    for sampling in (SamplingParams(seed=3, temperature=0.0), SamplingParams(seed=3, temperature=1.0)):
        request = _request(n=3, structured_output=structured, sampling=sampling,
                           stopping=StoppingCriteria(max_tokens=120))  # fmt: skip
        counted = _Passes(backend)
        stepped = await backend.generate(replace(request, logprobs=0))
        assert counted.passes() == counted.tokens() - 3  # a pass per token but each generation's last
        counted = _Passes(backend)
        jumped = await backend.generate(request)
        assert counted.passes() < counted.tokens() - 3, "no forced token jumped"
        for plain, with_logprobs in zip(jumped.generations, stepped.generations, strict=True):
            assert with_logprobs.logprobs is not None
            ids = [lp.token_id for lp in with_logprobs.logprobs]
            assert (plain.text, plain.finish_reason) == (with_logprobs.text, with_logprobs.finish_reason)
            assert plain.text == backend._llm.detokenize(ids).decode("utf-8", "replace")
            if plain.finish_reason is FinishReason.STOP:
                assert validate_output(structured, plain.text) is None, plain.text


async def test_a_run_is_cut_at_n_batch(tiny_model: TinyModelPaths) -> None:
    """A forced run longer than llama.cpp's batch goes into several passes, none over n_batch."""
    small = LlamaCppBackend("tiny", LlamaCppOptions(path=str(tiny_model.gguf_path), n_ctx=1024, n_batch=4))
    await small.start()
    try:
        literal = "abc " * 40
        structured = StructuredOutput(
            JsonSchemaConstraint(
                {"type": "object", "properties": {"note": {"const": literal}}, "required": ["note"]}
            )
        )
        sizes: list[int] = []
        eval_next = LlamaCppBackend._eval_next

        def counted(llm: Any, tokens: list[int]) -> None:
            sizes.append(len(tokens))
            eval_next(llm, tokens)

        small._eval_next = counted  # type: ignore[method-assign]
        result = await small.generate(
            _request(structured_output=structured, stopping=StoppingCriteria(max_tokens=200))
        )
        (gen,) = result.generations
        assert gen.finish_reason is FinishReason.STOP and json.loads(gen.text) == {"note": literal}
        assert max(sizes) == 4 and len(sizes) < gen.output_tokens // 2, sizes
    finally:
        await small.aclose()


def test_a_cancel_or_deadline_inside_a_run_ends_it(
    backend: LlamaCppBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancellation and the deadline are looked at before each forced token of a run, not only
    before each forward pass: a forced token can cost milliseconds (a long literal re-tokenized)."""
    import threading

    from gengate.engines import decoding
    from gengate.engines.llamacpp import _Done, _Job

    literal = "abc " * 100
    structured = StructuredOutput(
        JsonSchemaConstraint(
            {"type": "object", "properties": {"note": {"const": literal}}, "required": ["note"]}
        )
    )
    compiled = backend._compiler.compile_sync(structured)
    prompt = backend._prompt(_request())[0]
    step_forced = decoding.SequenceDecoder.step_forced
    for how in ("cancel", "deadline"):
        done: list[_Done] = []
        cancel = threading.Event()
        job = _Job(
            index=0,
            prompt=prompt,
            sampling=SamplingParams(seed=1, temperature=0.0),
            stopping=StoppingCriteria(max_tokens=300),
            logprobs=None,
            compiled=compiled,
            options=EngineOptions(),
            deadline=None,
            handoff=_Handoff(done),  # type: ignore[arg-type]
            cancel=cancel,
        )
        taken = [0]

        def forced_then_stop(self: Any, how: str = how, job: _Job = job, taken: list[int] = taken) -> Any:
            taken[0] += 1
            if taken[0] == 3:  # mid-run
                if how == "cancel":
                    job.cancel.set()
                else:
                    job.deadline = time.monotonic() - 1.0
            return step_forced(self)

        monkeypatch.setattr(decoding.SequenceDecoder, "step_forced", forced_then_stop)
        backend._decode(job)
        (end,) = done
        assert end.finish_reason is (FinishReason.CANCELLED if how == "cancel" else FinishReason.TIME_LIMIT)
        assert end.output_tokens <= 4, "the run went on after the cancel or the deadline"


class _Handoff:
    """Stands in for LoopHandoff when the worker loop runs on the test's thread: keeps the end."""

    def __init__(self, done: list[Any]) -> None:
        self.done = done

    def put(self, item: Any, *, last: bool = False, more: bool = False) -> None:
        from gengate.engines.llamacpp import _Done, _Failed

        if isinstance(item, _Failed):
            raise item.error
        if isinstance(item, _Done):
            self.done.append(item)


async def test_tokens_forced_from_the_start_join_the_prompt(
    backend: LlamaCppBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokens forced before the first sampled one join the prompt's pass; an output forced to its
    end (a `const` schema) needs no pass at all, not even the prompt's, and streams whole."""
    loaded: list[int] = []
    load = backend._load_prompt

    def spied(llm: Any, prompt: list[int]) -> None:
        loaded.append(len(prompt))
        load(llm, prompt)

    monkeypatch.setattr(backend, "_load_prompt", spied)
    prompt = len(backend._prompt(_request())[0])
    closed = StructuredOutput(FORCING["json_schema"])  # starts with `{"name":"`, all forced
    (gen,) = (await backend.generate(_request(structured_output=closed))).generations
    assert gen.text.startswith('{"name":"') and loaded[-1] > prompt  # with the lead

    structured = StructuredOutput(JsonSchemaConstraint({"const": {"answer": "forty-two", "sure": True}}))
    counted = _Passes(backend)
    loads = len(loaded)
    events = await _events(
        backend, _request(structured_output=structured, stopping=StoppingCriteria(max_tokens=50))
    )
    deltas = [e for e in events if isinstance(e, GenerationDelta)]
    (end,) = [e for e in events if isinstance(e, GenerationEnd)]
    assert end.finish_reason is FinishReason.STOP
    assert json.loads("".join(d.text for d in deltas)) == {"answer": "forty-two", "sure": True}
    assert sum(d.token_count for d in deltas) == end.usage.output_tokens == counted.tokens() > 3
    assert counted.passes() == 0 and len(loaded) == loads  # not even the prompt's
    assert end.timings is not None and end.timings.time_to_first_token_s is not None
