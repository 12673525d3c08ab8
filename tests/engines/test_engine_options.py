"""Backend options of the local engines (min_tokens, ignore_eos): checking, and the decoder."""

from __future__ import annotations

import numpy as np
import pytest
from gengate import errors
from gengate.domain import (
    FinishReason,
    GenerationRequest,
    RegexConstraint,
    SamplingParams,
    StoppingCriteria,
    StructuredOutput,
)
from gengate.engines.decoding import SequenceDecoder
from gengate.engines.options import NO_OPTIONS, EngineOptions, engine_options

# token i is PIECES[i]; 0 is EOS
PIECES = ["<eos>", "a", "b", "STOP"]


def request(**kwargs: object) -> GenerationRequest:
    return GenerationRequest(model="m", prompt="p", **kwargs)  # type: ignore[arg-type]


def test_options_are_read_typed() -> None:
    assert engine_options(request()) is NO_OPTIONS
    got = engine_options(request(backend_options={"min_tokens": 3, "ignore_eos": True}))
    assert got == EngineOptions(min_tokens=3, ignore_eos=True) and got.holds_eos


@pytest.mark.parametrize(
    ("kwargs", "field", "text"),
    [
        ({"backend_options": {"min_tokens": "3"}}, "backend_options[min_tokens]", "must be a int, got str"),
        ({"backend_options": {"min_tokens": True}}, "backend_options[min_tokens]", "must be a int, got bool"),
        ({"backend_options": {"ignore_eos": 1}}, "backend_options[ignore_eos]", "must be a bool, got int"),
        ({"backend_options": {"min_tokens": -1}}, "backend_options[min_tokens]", "must be 0 or more"),
        (
            {"backend_options": {"min_tokens": 9}, "stopping": StoppingCriteria(max_tokens=4)},
            "backend_options[min_tokens]",
            "more than stopping.max_tokens (4)",
        ),
        (
            {
                "backend_options": {"ignore_eos": True},
                "structured_output": StructuredOutput(RegexConstraint("a+")),
            },
            "backend_options[ignore_eos]",
            "does not go with structured_output",
        ),
        ({"backend_options": {"beam_width": 2}}, "backend_options[beam_width]", "unknown option"),
    ],
)
def test_bad_options_name_the_option(kwargs: dict[str, object], field: str, text: str) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        engine_options(request(**kwargs))
    assert [v.field for v in info.value.violations] == [field]
    assert text in info.value.message


def decoder(options: EngineOptions, *, stop: tuple[str, ...] = (), max_tokens: int = 8) -> SequenceDecoder:
    return SequenceDecoder(
        index=0,
        detokenize=lambda ids: "".join(PIECES[i] for i in ids if i),
        eos_token_ids=frozenset({0}),
        sampling=SamplingParams(temperature=0.0),
        stopping=StoppingCriteria(max_tokens=max_tokens, stop=stop),
        logprobs=None,
        matcher=None,
        prompt_token_ids=(),
        vocab_size=len(PIECES),
        options=options,
    )


def run(d: SequenceDecoder, favourite: int) -> tuple[str, FinishReason | None, int]:
    """Steps `d` with logits that always favour token `favourite` (then "a", then "b")."""
    logits = np.array([0.0, 5.0, 1.0, 0.0], dtype=np.float32)
    logits[favourite] = 10.0
    text = ""
    while d.finished is None:
        text += d.step(logits).text_delta
    return text, d.finished, len(d.output_token_ids)


def test_min_tokens_holds_eos_back_then_lets_it_end() -> None:
    assert run(decoder(NO_OPTIONS), favourite=0) == ("", FinishReason.STOP, 1)
    assert run(decoder(EngineOptions(min_tokens=3)), favourite=0) == ("aaa", FinishReason.STOP, 4)


def test_ignore_eos_runs_to_max_tokens() -> None:
    assert run(decoder(EngineOptions(ignore_eos=True), max_tokens=5), favourite=0) == (
        "aaaaa",
        FinishReason.LENGTH,
        5,
    )


def test_only_text_after_min_tokens_can_match_a_stop_string() -> None:
    text, reason, tokens = run(decoder(NO_OPTIONS, stop=("STOP",)), favourite=3)
    assert (text, reason, tokens) == ("", FinishReason.STOP_SEQUENCE, 1)
    text, reason, tokens = run(decoder(EngineOptions(min_tokens=2), stop=("STOP",)), favourite=3)
    assert (text, reason, tokens) == ("STOPSTOP", FinishReason.STOP_SEQUENCE, 3)
