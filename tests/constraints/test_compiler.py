"""ConstraintCompiler: compile against a real tokenizer, cache, timeout, matcher behaviour."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from gengate import errors
from gengate.constraints import ConstraintCompiler, constraint_key, kinds, lowering
from gengate.domain import (
    ChoiceConstraint,
    Enforcement,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuredOutput,
)
from llguidance import LLTokenizer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def compiler(ll_tokenizer: LLTokenizer) -> ConstraintCompiler:
    return ConstraintCompiler(ll_tokenizer, "tiny")


async def test_second_compile_is_a_cache_hit(compiler: ConstraintCompiler) -> None:
    structured = StructuredOutput(RegexConstraint("[ab]{2}"))
    first = await compiler.compile(structured)
    second = await compiler.compile(StructuredOutput(RegexConstraint("[ab]{2}")))
    assert second.lowered is first.lowered  # one compile, shared
    assert compiler.stats.lowerings == 1
    assert (compiler.stats.hits, compiler.stats.misses) == (1, 1)
    await compiler.compile(StructuredOutput(RegexConstraint("[ab]{3}")))
    assert compiler.stats.lowerings == 2


async def test_schemas_differing_only_in_annotations_share_one_compile(compiler: ConstraintCompiler) -> None:
    def person(**annotations: object) -> StructuredOutput:
        name = {"type": "string", **annotations}
        # a property called "description" is data, not an annotation: it must stay in the key
        schema = {
            "type": "object",
            "properties": {"name": name, "description": {"type": "string"}},
            **annotations,
        }
        return StructuredOutput(JsonSchemaConstraint(schema))

    plain = person()
    first = await compiler.compile(plain)
    described = person(title="Person", description="Someone", examples=["x"], **{"$comment": "c"})
    second = await compiler.compile(described)
    assert compiler.stats.lowerings == 1 and compiler.stats.hits == 1
    assert second.structured is described and first.structured is plain  # each reports its own
    assert second.grammar == first.grammar
    without_property = StructuredOutput(
        JsonSchemaConstraint({"type": "object", "properties": {"name": {"type": "string"}}})
    )
    await compiler.compile(without_property)
    assert compiler.stats.lowerings == 2  # a real difference still compiles anew
    tighter = person(description="Someone", maxLength=3)
    matcher = (await compiler.compile(tighter)).new_matcher()
    assert compiler.stats.lowerings == 3  # maxLength is a keyword, not an annotation
    assert matcher is not None


def test_only_compile_keys_leave_annotations_out() -> None:
    """The sandbox keys its metaschema verdicts on the whole schema: `title: 5` is invalid there,
    and must not share a verdict with the valid schema it otherwise equals."""
    clean = StructuredOutput(JsonSchemaConstraint({"type": "string"}))
    titled = StructuredOutput(JsonSchemaConstraint({"type": "string", "title": 5}))
    assert constraint_key(clean, grammar_only=True) == constraint_key(titled, grammar_only=True)
    assert constraint_key(clean) != constraint_key(titled)


def test_a_ref_into_an_annotation_keeps_the_annotation_in_the_key() -> None:
    def pointing(kind: str) -> StructuredOutput:
        return StructuredOutput(JsonSchemaConstraint({"examples": [{"type": kind}], "$ref": "#/examples/0"}))

    integer, string = pointing("integer"), pointing("string")
    assert constraint_key(integer, grammar_only=True) != constraint_key(string, grammar_only=True)


async def test_concurrent_compiles_of_one_constraint_share_the_work(compiler: ConstraintCompiler) -> None:
    structured = StructuredOutput(ChoiceConstraint(("red", "green")))
    results = await asyncio.gather(*(compiler.compile(structured) for _ in range(5)))
    assert all(r is results[0] for r in results)
    assert compiler.stats.lowerings == 1


async def test_cache_is_bounded(ll_tokenizer: LLTokenizer) -> None:
    compiler = ConstraintCompiler(ll_tokenizer, "tiny", cache_size=2)
    for n in range(3):
        await compiler.compile(StructuredOutput(RegexConstraint(f"a{{{n + 1}}}")))
    await compiler.compile(StructuredOutput(RegexConstraint("a{1}")))  # evicted: compiled again
    assert compiler.stats.lowerings == 4


def slow_lowering(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every lowering takes `seconds` longer: a compile that runs long, on demand."""
    real_lower = kinds.lower

    def slow_lower(
        structured: StructuredOutput, *, syntax_checked: bool = False
    ) -> lowering.LoweredConstraint:
        time.sleep(seconds)
        return real_lower(structured, syntax_checked=syntax_checked)

    monkeypatch.setattr(kinds, "lower", slow_lower)


async def test_timeout_is_invalid_argument(
    compiler: ConstraintCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_lowering(monkeypatch, 0.5)
    compiler.timeout_s = 0.05
    with pytest.raises(errors.InvalidArgument) as info:
        await compiler.compile(StructuredOutput(RegexConstraint("x+")))
    assert info.value.reason == "CONSTRAINT_COMPILE_TIMEOUT"
    assert info.value.violations[0].field == "structured_output.regex.pattern"


async def test_refusals_are_not_cached_and_keep_the_field(compiler: ConstraintCompiler) -> None:
    for _ in range(2):
        with pytest.raises(errors.InvalidArgument) as info:
            await compiler.compile(StructuredOutput(RegexConstraint("(")))
        assert info.value.reason == "INVALID_REGEX"
    assert compiler.stats.lowerings == 2


async def test_relaxed_schema_compiles_as_validated(compiler: ConstraintCompiler) -> None:
    compiled = await compiler.compile(
        StructuredOutput(
            JsonSchemaConstraint({"type": "array", "uniqueItems": True, "items": {"type": "integer"}})
        )
    )
    assert compiled.enforcement is Enforcement.VALIDATED
    assert compiled.relaxations == ("keyword uniqueItems not enforced at /",)


def _walk(compiler: ConstraintCompiler, structured: StructuredOutput, text: str) -> bool:
    """Feeds `text` token by token through a fresh matcher, checking the mask allows each."""
    compiled = compiler.compile_sync(structured)
    matcher = compiled.new_matcher()
    for token in compiler.ll_tokenizer.tokenize_str(text):
        if not matcher.allowed_token_mask()[token]:
            return False
        matcher.consume(token)
    return matcher.is_accepting()


def test_matcher_masks_and_consumes(compiler: ConstraintCompiler, eos_id: int) -> None:
    compiled = compiler.compile_sync(StructuredOutput(ChoiceConstraint(("yes", "no"))))
    matcher = compiled.new_matcher()
    mask = matcher.allowed_token_mask()
    assert mask.dtype == np.bool_ and mask.shape == (compiler.ll_tokenizer.vocab_size,)
    allowed = {compiler.ll_tokenizer.decode_str([int(t)]) for t in np.flatnonzero(mask)}
    assert allowed and all("yes".startswith(a) or "no".startswith(a) for a in allowed)
    assert not mask[eos_id] and not matcher.is_accepting()
    for token in compiler.ll_tokenizer.tokenize_str("no"):
        matcher.consume(token)
    assert matcher.is_accepting() and matcher.is_stopped()
    with pytest.raises(errors.Internal):
        matcher.consume(compiler.ll_tokenizer.tokenize_str("x")[0])


def test_matchers_are_independent(compiler: ConstraintCompiler) -> None:
    compiled = compiler.compile_sync(StructuredOutput(RegexConstraint("ab|cd")))
    one, two = compiled.new_matcher(), compiled.new_matcher()
    one.consume(compiler.ll_tokenizer.tokenize_str("a")[0])
    assert two.allowed_token_mask()[compiler.ll_tokenizer.tokenize_str("c")[0]]


def test_matcher_fill_mask_checks_its_row(compiler: ConstraintCompiler) -> None:
    matcher = compiler.compile_sync(StructuredOutput(RegexConstraint("a"))).new_matcher()
    with pytest.raises(ValueError):
        matcher.fill_mask(np.zeros(1, dtype=np.int32))
    row = np.zeros((compiler.ll_tokenizer.vocab_size + 31) // 32, dtype=np.int32)
    matcher.fill_mask(row)
    assert int(np.unpackbits(row.view(np.uint8)).sum()) >= 1


def test_bound_mask_fills_the_checked_row_as_fill_mask_does(compiler: ConstraintCompiler) -> None:
    compiled = compiler.compile_sync(StructuredOutput(ChoiceConstraint(("yes", "no"))))
    words = (compiler.ll_tokenizer.vocab_size + 31) // 32
    with pytest.raises(ValueError):
        compiled.new_matcher().bind_mask(np.zeros(words, dtype=np.int64))
    with pytest.raises(ValueError):
        compiled.new_matcher().bind_mask(np.zeros(words - 1, dtype=np.int32))
    bound, plain = compiled.new_matcher(), compiled.new_matcher()
    row, expected = np.zeros(words, dtype=np.int32), np.zeros(words, dtype=np.int32)
    fill = bound.bind_mask(row)
    for token in compiler.ll_tokenizer.tokenize_str("no"):
        fill()
        plain.fill_mask(expected)
        assert np.array_equal(row, expected) and row.any()
        bound.consume(token)
        plain.consume(token)


def test_advance_consumes_and_tells_whether_the_output_is_complete(compiler: ConstraintCompiler) -> None:
    matcher = compiler.compile_sync(StructuredOutput(ChoiceConstraint(("yes", "no")))).new_matcher()
    tokens = compiler.ll_tokenizer.tokenize_str("no")
    assert [matcher.advance(t) for t in tokens] == [False] * (len(tokens) - 1) + [True]
    other = compiler.compile_sync(StructuredOutput(ChoiceConstraint(("yes", "no")))).new_matcher()
    with pytest.raises(errors.Internal):
        other.advance(compiler.ll_tokenizer.tokenize_str("x")[0])


def test_schema_walks(compiler: ConstraintCompiler) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 150}}, "required": ["n"]}
    structured = StructuredOutput(JsonSchemaConstraint(schema))
    assert _walk(compiler, structured, json.dumps({"n": 42}, separators=(",", ":")))
    assert not _walk(compiler, structured, json.dumps({"n": 501}, separators=(",", ":")))


async def test_waiting_for_a_busy_pool_is_resource_exhausted_not_the_callers_fault(
    ll_tokenizer: LLTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_lowering(monkeypatch, 0.6)
    compiler = ConstraintCompiler(ll_tokenizer, "tiny", max_workers=1, timeout_s=5.0)
    try:
        busy = asyncio.create_task(compiler.compile(StructuredOutput(RegexConstraint("a+"))))
        await asyncio.sleep(0.1)  # the one compile thread is taken
        compiler.timeout_s = 0.2
        with pytest.raises(errors.ResourceExhausted) as info:
            await compiler.compile(StructuredOutput(RegexConstraint("b+")))
        assert info.value.reason == "CONSTRAINT_COMPILERS_BUSY"
        assert info.value.retry_after_s is not None
        assert (await busy).grammar
    finally:
        compiler.close()
    queueless = ConstraintCompiler(ll_tokenizer, "tiny", max_workers=1, max_queued=0, timeout_s=5.0)
    try:
        blocker = asyncio.create_task(queueless.compile(StructuredOutput(RegexConstraint("c+"))))
        await asyncio.sleep(0.1)
        with pytest.raises(errors.ResourceExhausted):  # no room to queue: refused at once
            await queueless.compile(StructuredOutput(RegexConstraint("d+")))
        assert (await blocker).grammar
    finally:
        queueless.close()


async def test_library_failures_while_compiling_are_the_callers_input_error(
    compiler: ConstraintCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(structured: StructuredOutput, *, syntax_checked: bool = False) -> lowering.LoweredConstraint:
        raise ValueError(
            "Exceeds the limit (4300 digits) for integer string conversion\n  internal state: ..."
        )

    monkeypatch.setattr(kinds, "lower", broken)
    with pytest.raises(errors.InvalidArgument) as info:
        await compiler.compile(StructuredOutput(RegexConstraint("e+")))
    assert info.value.reason == "INVALID_CONSTRAINT"
    assert "internal state" not in info.value.message and "4300 digits" in info.value.message


async def test_a_request_compile_skips_the_checks_the_sandbox_made_and_others_do_not(
    compiler: ConstraintCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's own constraint passed the sandbox's syntax and metaschema check before it
    reaches an engine, so `compile(checked=True)` does not check it again (most of a cold
    compile); a constraint the engine composed (a tool plan's grammar: `compile()`), `warm`
    (config, at load, before any sandbox) and `compile_sync` still do."""
    seen: list[bool] = []
    real_lower = kinds.lower

    def spying(structured: StructuredOutput, *, syntax_checked: bool = False) -> lowering.LoweredConstraint:
        seen.append(syntax_checked)
        return real_lower(structured, syntax_checked=syntax_checked)

    monkeypatch.setattr(kinds, "lower", spying)
    schema = StructuredOutput(
        JsonSchemaConstraint({"type": "object", "properties": {"a": {"type": "integer"}}})
    )
    await compiler.compile(schema, checked=True)
    await compiler.compile(StructuredOutput(RegexConstraint("u+")))
    compiler.warm(StructuredOutput(RegexConstraint("w+")))
    compiler.compile_sync(StructuredOutput(RegexConstraint("v+")))
    assert seen == [True, False, False, False]
    bad = StructuredOutput(JsonSchemaConstraint({"type": "object", "properties": {"a": {"type": 7}}}))
    with pytest.raises(errors.InvalidArgument) as info:
        compiler.warm(bad)  # the metaschema check names the schema's own path
    assert info.value.violations[0].field.startswith("structured_output.json_schema")


async def test_the_cache_is_bounded_by_the_weight_of_what_it_holds(ll_tokenizer: LLTokenizer) -> None:
    """Big compiled grammars (tens of MB each) evict each other long before the entry count."""
    compiler = ConstraintCompiler(ll_tokenizer, "tiny", max_cached_weight=25_000)
    try:
        heavy = [StructuredOutput(RegexConstraint(f"{ch}{{10000}}")) for ch in "abc"]
        for structured in heavy:
            await compiler.compile(structured)
        await compiler.compile(StructuredOutput(RegexConstraint("[xy]{2}")))  # light: fits beside them
        assert compiler.stats.lowerings == 4
        await compiler.compile(heavy[2])  # the newest heavy one is still cached
        assert compiler.stats.lowerings == 4
        await compiler.compile(heavy[0])  # the oldest was evicted by weight, not by count
        assert compiler.stats.lowerings == 5
    finally:
        compiler.close()


async def test_a_think_block_before_a_constraint_is_compiled_once(compiler: ConstraintCompiler) -> None:
    from gengate.engines.reasoning import ReasoningPlan, ThinkTags, compile_with_reasoning

    def plan(budget: int | None) -> ReasoningPlan:
        return ReasoningPlan(ThinkTags("<think>", "</think>"), budget_tokens=budget)

    def schema(**annotations: object) -> StructuredOutput:
        return StructuredOutput(JsonSchemaConstraint({"type": "integer", **annotations}))

    first = await compile_with_reasoning(compiler, schema(), plan(4), checked=True)
    lowered = compiler.stats.lowerings  # the schema, then the think block around it
    described = schema(description="a number")
    again = await compile_with_reasoning(compiler, described, plan(4), checked=True)
    assert first is not None and again is not None
    assert compiler.stats.lowerings == lowered  # both were cache hits
    assert again.grammar == first.grammar and again.structured is described
    assert again.new_matcher().is_accepting() is False  # a fresh matcher each request
    await compile_with_reasoning(compiler, schema(), plan(5), checked=True)
    assert compiler.stats.lowerings == lowered + 1  # another budget is another grammar
    free = await compile_with_reasoning(compiler, None, plan(4), checked=True)
    assert free is not None and compiler.stats.lowerings == lowered + 2
    assert await compile_with_reasoning(compiler, None, plan(4), checked=True) is free
