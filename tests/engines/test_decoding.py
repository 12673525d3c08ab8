"""SequenceDecoder: sampling, penalties, stop strings, limits, logprobs and constraint masks."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from gengate.constraints import ConstraintCompiler
from gengate.domain import (
    FinishReason,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
    StoppingCriteria,
    StructuredOutput,
)
from gengate.engines.decoding import LoopHandoff, SequenceDecoder, StepResult
from gengate.models.tiny import EOS_TOKEN, TinyModelPaths
from llguidance import LLTokenizer
from packed_masks import WithoutPlans
from tokenizers import Tokenizer

# A synthetic vocabulary: token i is PIECES[i]; 0 is EOS.
PIECES = ["<eos>", "a", "b", "c", "ab", "X", "Y", "é"[:1], " ", "STOP", "ST", "OP", "\n"]
EOS = 0


def detok_bytes(ids: list[int]) -> bytes:
    return b"".join(PIECES[i].encode() if i else b"" for i in ids)


def make(
    *,
    sampling: SamplingParams | None = None,
    stop: tuple[str, ...] = (),
    max_tokens: int | None = 50,
    logprobs: int | None = None,
    prompt: tuple[int, ...] = (),
    detokenize: Callable[[list[int]], bytes | str] = detok_bytes,
    vocab: int = len(PIECES),
    index: int = 0,
    matcher: Any = None,
    eos: frozenset[int] = frozenset({EOS}),
) -> SequenceDecoder:
    return SequenceDecoder(
        index=index,
        detokenize=detokenize,
        eos_token_ids=eos,
        sampling=sampling or SamplingParams(temperature=0.0, seed=1),
        stopping=StoppingCriteria(max_tokens=max_tokens, stop=stop),
        logprobs=logprobs,
        matcher=matcher,
        prompt_token_ids=prompt,
        vocab_size=vocab,
    )


def one_hot(token: int, vocab: int = len(PIECES), high: float = 10.0) -> np.ndarray:
    logits = np.zeros(vocab, dtype=np.float32)
    logits[token] = high
    return logits


def feed(decoder: SequenceDecoder, tokens: list[int]) -> list[StepResult]:
    results = []
    for token in tokens:
        results.append(decoder.step(one_hot(token)))
        if results[-1].finished:
            break
    return results


def test_greedy_follows_the_logits_and_eos_stops() -> None:
    decoder = make()
    results = feed(decoder, [1, 2, 3, EOS])
    assert "".join(r.text_delta for r in results) == "abc" == decoder.text
    assert results[-1].finished is FinishReason.STOP and results[-1].token_id == EOS
    assert decoder.output_token_ids == [1, 2, 3, EOS]
    with pytest.raises(RuntimeError):
        decoder.step(one_hot(1))


def test_max_tokens_finishes_with_length() -> None:
    decoder = make(max_tokens=3)
    results = feed(decoder, [1, 1, 1, 1])
    assert len(results) == 3 and results[-1].finished is FinishReason.LENGTH
    assert decoder.text == "aaa"


def test_stop_string_across_tokens_is_held_back_and_cut() -> None:
    decoder = make(stop=("STOP",))
    results = feed(decoder, [1, 10, 11, 2])
    assert [r.text_delta for r in results] == ["a", "", ""]
    assert results[-1].finished is FinishReason.STOP_SEQUENCE
    assert results[-1].matched_stop == "STOP" == decoder.matched_stop
    assert decoder.text == "a"


def test_held_back_text_is_released_when_it_is_not_a_stop() -> None:
    decoder = make(stop=("STOP",))
    results = feed(decoder, [1, 10, 2, EOS])
    assert [r.text_delta for r in results] == ["a", "", "STb", ""]
    assert decoder.text == "aSTb"


def test_held_back_text_is_flushed_at_the_end() -> None:
    decoder = make(stop=("STOP",), max_tokens=2)
    results = feed(decoder, [1, 10])
    assert results[-1].finished is FinishReason.LENGTH and results[-1].text_delta == "ST"
    assert decoder.finalize() == "" and decoder.text == "aST"


def test_stop_inside_one_token_keeps_the_text_before_it() -> None:
    decoder = make(stop=("bc",))
    results = feed(decoder, [4, 3, 1])  # "ab" "c" -> "abc" contains "bc"
    assert results[-1].finished is FinishReason.STOP_SEQUENCE
    assert decoder.text == "a"


def test_earliest_stop_wins() -> None:
    decoder = make(stop=("c", "ab"))
    feed(decoder, [1, 2, 3])
    assert decoder.matched_stop == "ab" and decoder.text == ""


def test_utf8_split_across_tokens_is_joined() -> None:
    pieces = {1: "é".encode()[:1], 2: "é".encode()[1:], 3: b"!"}

    def detok(ids: list[int]) -> bytes:
        return b"".join(pieces.get(i, b"") for i in ids)

    decoder = make(detokenize=detok)
    deltas = [decoder.step(one_hot(t)).text_delta for t in (1, 2, 3)]
    assert deltas == ["", "é", "!"]


def test_str_detokenizer_uses_a_window() -> None:
    # A SentencePiece-like decoder that drops the leading space of a lone piece.
    pieces = {1: "▁hello", 2: "▁world", 3: "!"}

    def detok(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids).replace("▁", " ").lstrip(" ")

    decoder = make(detokenize=detok)
    text = "".join(decoder.step(one_hot(t)).text_delta for t in (1, 2, 3))
    assert text == "hello world!"


def sampled(seed: int, index: int = 0, n: int = 30, **sampling: Any) -> list[int]:
    decoder = make(sampling=SamplingParams(seed=seed, **sampling), max_tokens=None, index=index)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(n, len(PIECES))).astype(np.float32)
    logits[:, EOS] = -100
    return [decoder.step(row).token_id for row in logits]  # type: ignore[misc]


def test_seeded_sampling_is_reproducible_and_index_dependent() -> None:
    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)
    assert sampled(7, index=0) != sampled(7, index=1)


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(20, len(PIECES))).astype(np.float32)
    logits[:, EOS] = -100
    greedy = [int(np.argmax(row)) for row in logits]
    for sampling in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=0.9999)):
        decoder = make(sampling=SamplingParams(seed=3, temperature=1.0, **sampling), max_tokens=None)
        assert [decoder.step(row).token_id for row in logits] == greedy, sampling


def test_sampling_distribution_matches_softmax() -> None:
    logits = np.log(np.array([1e-9, 0.5, 0.3, 0.2] + [1e-9] * (len(PIECES) - 4), dtype=np.float32))
    counts = np.zeros(len(PIECES))
    decoder = make(sampling=SamplingParams(seed=5), max_tokens=None)
    for _ in range(3000):
        counts[decoder.step(logits).token_id] += 1  # type: ignore[index]
    assert np.allclose(counts[1:4] / 3000, [0.5, 0.3, 0.2], atol=0.04)


def test_top_p_keeps_the_nucleus_only() -> None:
    logits = np.log(np.array([1e-9, 0.5, 0.3, 0.2] + [1e-9] * (len(PIECES) - 4), dtype=np.float32))
    decoder = make(sampling=SamplingParams(seed=5, top_p=0.7), max_tokens=None)
    seen = {decoder.step(logits).token_id for _ in range(300)}
    assert seen == {1, 2}


def test_penalties_change_the_choice() -> None:
    logits = np.zeros(len(PIECES), dtype=np.float32)
    logits[1], logits[2] = 2.0, 1.5
    assert make().step(logits).token_id == 1
    assert (
        make(sampling=SamplingParams(temperature=0, seed=1, repetition_penalty=2.0), prompt=(1,))
        .step(logits)
        .token_id
        == 2
    )
    for penalty in (dict(frequency_penalty=1.0), dict(presence_penalty=1.0)):
        decoder = make(sampling=SamplingParams(temperature=0, seed=1, **penalty), prompt=(1,))
        assert decoder.step(logits).token_id == 1  # the prompt does not count for these
        assert decoder.step(logits).token_id == 2


def test_frequency_penalty_grows_with_count() -> None:
    logits = np.zeros(len(PIECES), dtype=np.float32)
    logits[1], logits[2] = 2.0, 0.5
    decoder = make(sampling=SamplingParams(temperature=0, seed=1, frequency_penalty=0.6))
    assert [decoder.step(logits).token_id for _ in range(4)] == [1, 1, 1, 2]


def test_logprobs_are_raw_log_softmax_with_alternatives() -> None:
    logits = np.array([0.0, 3.0, 2.0, 1.0] + [-5.0] * (len(PIECES) - 4), dtype=np.float32)
    result = make(logprobs=2, sampling=SamplingParams(temperature=0, seed=1, presence_penalty=9)).step(logits)
    log_z = math.log(np.exp(logits.astype(np.float64)).sum())
    assert result.logprob is not None
    assert result.logprob.token == "a" and result.logprob.token_id == 1
    assert result.logprob.logprob == pytest.approx(3.0 - log_z, abs=1e-5)
    assert [t.token_id for t in result.logprob.top] == [1, 2]
    assert result.logprob.top[1].logprob == pytest.approx(2.0 - log_z, abs=1e-5)
    assert make(logprobs=0).step(logits).logprob.top == ()  # type: ignore[union-attr]
    assert make().step(logits).logprob is None


# Token ids of seeded sampling over fixed logits, recorded before the sampler's fast paths were
# added: a seed must keep reproducing its output, so these must never drift by accident.
PINNED: dict[str, tuple[dict[str, Any], list[list[int]]]] = {
    "greedy": (
        dict(temperature=0.0),
        [[139, 334, 53, 80, 5, 303, 232, 148, 45, 153, 126, 317, 129, 482, 368, 411]] * 3,
    ),
    "greedy + repetition penalty": (
        dict(temperature=0.0, repetition_penalty=1.5),
        [[139, 334, 53, 80, 118, 303, 232, 148, 45, 153, 126, 317, 129, 482, 368, 411]] * 3,
    ),
    "temperature 1": (
        dict(temperature=1.0),
        [
            [248, 472, 53, 478, 118, 267, 382, 160, 165, 7, 332, 260, 137, 479, 165, 411],
            [162, 164, 422, 80, 288, 399, 69, 11, 84, 296, 205, 91, 181, 400, 236, 411],
            [101, 130, 403, 233, 35, 269, 232, 53, 277, 16, 126, 255, 181, 365, 368, 468],
        ],
    ),
    "temperature 0.8 top_p 0.9": (
        dict(temperature=0.8, top_p=0.9),
        [
            [248, 445, 53, 472, 118, 291, 352, 148, 126, 7, 247, 265, 129, 482, 233, 411],
            [162, 170, 419, 80, 270, 408, 69, 11, 45, 244, 126, 91, 147, 482, 236, 411],
            [139, 140, 392, 233, 5, 303, 232, 57, 223, 10, 126, 255, 147, 439, 368, 411],
        ],
    ),
    "top_k 5": (
        dict(top_k=5),
        [
            [248, 334, 29, 80, 94, 215, 232, 263, 126, 124, 126, 91, 324, 482, 236, 411],
            [479, 119, 53, 221, 118, 303, 84, 11, 223, 153, 126, 81, 358, 482, 236, 411],
            [506, 164, 53, 233, 397, 215, 69, 104, 45, 489, 63, 91, 358, 482, 368, 411],
        ],
    ),
    "top_k 5 top_p 0.5 temperature 0.7": (
        dict(temperature=0.7, top_k=5, top_p=0.5),
        [
            [139, 334, 314, 80, 118, 303, 232, 160, 45, 10, 126, 317, 129, 482, 368, 411],
            [248, 334, 53, 233, 118, 303, 69, 160, 45, 153, 126, 91, 129, 482, 368, 411],
            [248, 334, 53, 80, 288, 303, 232, 160, 45, 10, 126, 317, 129, 482, 368, 411],
        ],
    ),
    "min_p 0.2 temperature 1.3": (
        dict(min_p=0.2, temperature=1.3),
        [
            [248, 445, 53, 463, 118, 303, 352, 148, 126, 3, 309, 195, 137, 482, 236, 411],
            [162, 164, 422, 80, 270, 433, 69, 11, 45, 244, 126, 91, 161, 482, 236, 411],
            [138, 164, 422, 221, 5, 303, 229, 17, 223, 10, 126, 195, 161, 479, 368, 411],
        ],
    ),
    "all penalties": (
        dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
        [
            [248, 472, 53, 478, 132, 267, 382, 160, 167, 10, 332, 260, 137, 482, 165, 411],
            [162, 164, 422, 80, 288, 399, 69, 11, 87, 296, 205, 91, 181, 400, 236, 411],
            [101, 130, 404, 233, 78, 269, 232, 53, 277, 16, 126, 255, 181, 373, 368, 468],
        ],
    ),
}


@pytest.mark.parametrize("name", PINNED)
def test_seeded_token_ids_are_pinned(name: str) -> None:
    sampling, expected = PINNED[name]
    vocab = 512
    logits = (np.random.default_rng(42).normal(size=(16, vocab)) * 2).astype(np.float32)
    logits[:, 0] = -100
    for seed, ids in zip((1, 2, 3), expected, strict=True):
        for logprobs in (None, 0):  # with logprobs on, the same tokens are chosen
            decoder = SequenceDecoder(
                index=0,
                detokenize=lambda ids: b"x",
                eos_token_ids=frozenset({0}),
                sampling=SamplingParams(seed=seed, **sampling),
                stopping=StoppingCriteria(max_tokens=None),
                logprobs=logprobs,
                matcher=None,
                prompt_token_ids=(5, 6, 7),
                vocab_size=vocab,
            )
            assert [decoder.step(row).token_id for row in logits] == ids, (name, seed, logprobs)


# --- real tokenizer + llguidance matcher -------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model: TinyModelPaths) -> tuple[Tokenizer, ConstraintCompiler, int]:
    tokenizer = Tokenizer.from_file(str(tiny_model.hf_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ll = LLTokenizer(tokenizer.to_str(), eos_token=eos)
    return tokenizer, ConstraintCompiler(ll, "tiny"), eos


def constrained_run(
    tiny: tuple[Tokenizer, ConstraintCompiler, int],
    structured: StructuredOutput,
    prefer: str,
    *,
    seed: int = 0,
    temperature: float = 0.0,
    max_tokens: int = 200,
) -> SequenceDecoder:
    """Runs a decoder whose 'model' strongly prefers the tokens of `prefer` (plus noise)."""
    tokenizer, compiler, eos = tiny
    vocab = tokenizer.get_vocab_size()
    preferred = set(tokenizer.encode(prefer).ids)
    decoder = SequenceDecoder(
        index=0,
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        eos_token_ids=frozenset({eos}),
        sampling=SamplingParams(temperature=temperature, seed=seed),
        stopping=StoppingCriteria(max_tokens=max_tokens),
        logprobs=None,
        matcher=compiler.compile_sync(structured).new_matcher(),
        prompt_token_ids=(),
        vocab_size=vocab,
    )
    rng = np.random.default_rng(seed)
    while decoder.finished is None:
        logits = rng.normal(size=vocab).astype(np.float32)
        logits[list(preferred)] += 20.0
        logits[eos] += 5.0
        decoder.step(logits)
    return decoder


def test_regex_constraint_forces_the_output(tiny: Any) -> None:
    structured = StructuredOutput(RegexConstraint(r"[0-9]{3}-(red|blue)"))
    for seed in range(3):
        decoder = constrained_run(
            tiny, structured, "Hello world, the weather is sunny", seed=seed, temperature=1.0
        )
        assert decoder.finished is FinishReason.STOP
        assert __import__("re").fullmatch(r"[0-9]{3}-(red|blue)", decoder.text), decoder.text


def test_json_schema_constraint_forces_valid_json(tiny: Any) -> None:
    schema = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "name": {"type": "string", "maxLength": 8},
        },
        "required": ["age", "name"],
        "additionalProperties": False,
    }
    structured = StructuredOutput(JsonSchemaConstraint(schema))
    from gengate.constraints import validate_output

    for seed in range(3):
        decoder = constrained_run(
            tiny, structured, '{"age": 501, "city": "Paris"}', seed=seed, temperature=0.7
        )
        assert decoder.finished is FinishReason.STOP, decoder.text
        assert validate_output(structured, decoder.text) is None, decoder.text
        assert set(json.loads(decoder.text)) == {"age", "name"}


def test_eos_is_masked_until_the_constraint_accepts(tiny: Any) -> None:
    tokenizer, compiler, eos = tiny
    vocab = tokenizer.get_vocab_size()
    decoder = SequenceDecoder(
        index=0,
        detokenize=lambda ids: tokenizer.decode(ids),
        eos_token_ids=frozenset({eos}),
        sampling=SamplingParams(temperature=0, seed=0),
        stopping=StoppingCriteria(max_tokens=50),
        logprobs=None,
        matcher=compiler.compile_sync(StructuredOutput(RegexConstraint("a+"))).new_matcher(),
        prompt_token_ids=(),
        vocab_size=vocab + 64,  # a padded model vocabulary: the extra ids are never allowed
    )
    logits = np.zeros(vocab + 64, dtype=np.float32)
    logits[eos] = 50.0
    logits[vocab:] = 100.0
    first = decoder.step(logits)
    assert first.token_id != eos and first.token_id is not None and first.token_id < vocab
    second = decoder.step(logits)
    assert second.token_id == eos and second.finished is FinishReason.STOP
    assert decoder.text and set(decoder.text) == {"a"}


def test_finalize_flushes_held_text_when_the_engine_ends_the_generation() -> None:
    decoder = make(stop=("STOP",))
    assert [r.text_delta for r in feed(decoder, [1, 10])] == ["a", ""]
    assert decoder.finalize() == "ST" and decoder.finalize() == ""
    assert decoder.text == "aST" and decoder.finished is None


def test_a_constraint_that_only_takes_the_empty_string_ends_at_once(tiny: Any) -> None:
    _, compiler, eos = tiny
    from gengate.domain import ChoiceConstraint

    decoder = make(
        matcher=compiler.compile_sync(StructuredOutput(ChoiceConstraint(("",)))).new_matcher(),
        vocab=compiler.ll_tokenizer.vocab_size,
        eos=frozenset({eos}),
    )
    result = decoder.step(np.zeros(compiler.ll_tokenizer.vocab_size, dtype=np.float32))
    assert result.token_id in (None, eos) and result.finished is FinishReason.STOP
    assert decoder.text == ""


def test_sampled_constrained_choice_respects_top_k(tiny: Any) -> None:
    from gengate.domain import ChoiceConstraint

    structured = StructuredOutput(ChoiceConstraint(("red", "green", "blue")))
    outputs = {
        constrained_run(tiny, structured, "yellow", seed=seed, temperature=2.0).text for seed in range(6)
    }
    assert outputs <= {"red", "green", "blue"} and outputs


def test_seeded_constrained_sampling_is_pinned(tiny: Any) -> None:
    """Seeded sampling among the tokens a constraint allows; recorded like PINNED above (again on
    2026-12-03, when the decoder began drawing before it masks)."""
    regex = StructuredOutput(RegexConstraint(r"[0-9]{3}-(red|blue)"))
    runs = [
        constrained_run(tiny, regex, "Hello world, the weather", seed=s, temperature=1.0) for s in range(3)
    ]
    assert [d.output_token_ids for d in runs] == [
        [336, 16, 401],
        [668, 27, 16, 280, 71],
        [309, 19, 16, 85, 328],
    ]
    assert [d.text for d in runs] == ["100-red", "108-red", "120-red"]
    from gengate.domain import ChoiceConstraint

    choice = StructuredOutput(ChoiceConstraint(("red", "green", "blue")))
    runs = [constrained_run(tiny, choice, "yellow", seed=s, temperature=2.0) for s in range(3)]
    assert [d.output_token_ids for d in runs] == [[74, 280, 329], [401], [74, 280, 329]]
    assert [d.text for d in runs] == ["green", "red", "green"]


def test_dead_end_raises_internal() -> None:
    from gengate import errors

    class NothingAllowed(WithoutPlans):
        vocab_size = len(PIECES)

        def fill_mask(self, row: np.ndarray) -> None:
            row[:] = 0

        def bind_mask(self, row: np.ndarray) -> Callable[[], None]:
            return lambda: self.fill_mask(row)

        def is_accepting(self) -> bool:
            return False

        def is_stopped(self) -> bool:
            return False

        def is_forced(self) -> bool:
            return False

        def try_advance(self, token: int) -> int:
            return -1  # the draw made first is refused, then the mask allows nothing

    for sampling in (SamplingParams(temperature=0, seed=1), SamplingParams(temperature=1.0, seed=1)):
        with pytest.raises(errors.Internal) as info:
            make(matcher=NothingAllowed(), sampling=sampling).step(one_hot(1))
        assert info.value.reason == "CONSTRAINT_DEAD_END"


# --- LoopHandoff ----------------------------------------------------------------------------


async def test_handoff_delivers_every_item_in_order_and_coalesces_fast_ones() -> None:
    loop = asyncio.get_running_loop()
    handoff: LoopHandoff[object] = LoopHandoff(loop, on_closed=lambda _: None)
    count = 3000

    def produce() -> None:
        for i in range(count):
            handoff.put(i)
            if i % 97 == 0:
                time.sleep(0.002)  # slower than the coalescing window now and then
        handoff.put("end", last=True)

    worker = threading.Thread(target=produce)
    worker.start()
    batches: list[list[object]] = []
    while not batches or batches[-1][-1] != "end":
        batches.append(await asyncio.wait_for(handoff.take(), 5))
    worker.join()
    assert [i for batch in batches for i in batch] == [*range(count), "end"]
    assert len(batches) < count / 4  # far fewer wake-ups than items


async def test_handoff_wakes_at_once_for_a_slow_item_and_for_the_last() -> None:
    loop = asyncio.get_running_loop()
    handoff: LoopHandoff[object] = LoopHandoff(loop, on_closed=lambda _: None)
    handoff.put("a")
    assert await handoff.take() == ["a"]
    await asyncio.sleep(0.01)  # nothing arrives within the 1 ms window...
    pending = asyncio.ensure_future(handoff.take())
    await asyncio.sleep(0.01)
    handoff.COALESCE_S = 30.0  # (windows from now on would be noticed)
    threading.Thread(target=handoff.put, args=("b",)).start()
    assert await asyncio.wait_for(pending, 5) == ["b"]  # ...so the next item wakes the loop at once
    # right after a batch the loop waits out the window, but not for the last item
    threading.Thread(target=handoff.put, args=("c",), kwargs={"last": True}).start()
    assert await asyncio.wait_for(handoff.take(), 5) == ["c"]


def test_handoff_on_a_closed_loop_reports_it() -> None:
    loop = asyncio.new_event_loop()
    closed: list[object] = []
    handoff = LoopHandoff(loop, on_closed=closed.append)
    loop.close()
    handoff.put("x")
    assert closed == ["x"]
