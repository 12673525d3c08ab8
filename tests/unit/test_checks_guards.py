"""gengate.checks.prepare, field by field: every refusal names its proto field path, its reason and its
status class; every bound is where the contract puts it; every default is filled. These are the
"precise error statuses with field details" of the README, at the function that decides them
(scripts/mutation: each assertion here kills mutants that the end-to-end tests let through)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from gengate.checks import DEFAULT_MAX_TOKENS, prepare
from gengate.domain import (
    ChatMessage,
    ChoiceConstraint,
    ConstraintKind,
    Enforcement,
    GenerationRequest,
    GrammarConstraint,
    GrammarSyntax,
    ImagePart,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    Modality,
    ModelCapabilities,
    RegexConstraint,
    Role,
    SamplingParams,
    StoppingCriteria,
    StructuredOutput,
    TextPart,
)
from gengate.errors import GengateError, InvalidArgument, Unimplemented
from gengate.limits import LIMIT_REASON, RequestLimits

ALL_KINDS = {kind: Enforcement.ENGINE for kind in ConstraintKind}
CAPS = ModelCapabilities(
    constraints=ALL_KINDS,
    grammar_syntaxes=frozenset({GrammarSyntax.LARK}),
    max_n=4,
    logprobs=True,
    max_top_logprobs=5,
    input_modalities=frozenset({Modality.TEXT, Modality.IMAGE}),
    context_length=1000,
    seed=True,
    chat=True,
    backend_options=frozenset({"mirostat"}),
)


def _req(**fields: Any) -> GenerationRequest:
    fields.setdefault("prompt", "hi")
    return GenerationRequest(model="m", **fields)


def _user(*parts: Any) -> tuple[ChatMessage, ...]:
    return (ChatMessage(Role.USER, tuple(parts)),)


def _refusal(request: GenerationRequest, caps: ModelCapabilities = CAPS, **kw: Any) -> GengateError:
    with pytest.raises(GengateError) as caught:
        prepare(request, caps, **kw)
    return caught.value


def _fields(error: GengateError) -> list[str]:
    # Every violation goes on the wire as a BadRequest field violation: a path and a description.
    assert all(isinstance(v.description, str) and v.description for v in error.violations)
    return [v.field for v in error.violations]


def _invalid(request: GenerationRequest, caps: ModelCapabilities = CAPS) -> list[str]:
    """The field paths of an INVALID_REQUEST refusal, checking the status class and the message."""
    error = _refusal(request, caps)
    assert type(error) is InvalidArgument
    assert error.reason == "INVALID_REQUEST"
    # The message lists every violation as "field: description", in order.
    assert error.message == "; ".join(f"{v.field}: {v.description}" for v in error.violations)
    return _fields(error)


# --- input -----------------------------------------------------------------------------------------


def test_a_request_without_input_names_the_input_field() -> None:
    assert _invalid(_req(prompt=None)) == ["input"]


def test_chat_messages_to_a_prompt_only_model_name_messages() -> None:
    caps = ModelCapabilities(chat=False)
    assert _invalid(_req(prompt=None, messages=_user(TextPart("x"))), caps) == ["messages"]
    # A prompt is what that model takes.
    assert prepare(_req(), caps).prompt == "hi"


def test_message_shapes_name_their_message_and_part() -> None:
    assert _invalid(_req(prompt=None, messages=())) == ["messages.messages"]
    empty = (ChatMessage(Role.USER, (TextPart("a"),)), ChatMessage(Role.USER, ()))
    assert _invalid(_req(prompt=None, messages=empty)) == ["messages.messages[1].content"]
    image = "messages.messages[0].content[1].image"
    no_source = _user(TextPart("a"), ImagePart())
    assert _invalid(_req(prompt=None, messages=no_source)) == [image]
    no_mime = _user(TextPart("a"), ImagePart(data=b"\x89PNG"))
    assert _invalid(_req(prompt=None, messages=no_mime)) == [image + ".mime_type"]
    text_only = ModelCapabilities(chat=True)
    by_url = _user(TextPart("a"), ImagePart(url="https://example.com/a.png"))
    assert _invalid(_req(prompt=None, messages=by_url), text_only) == [image]
    # The same image parts that are well formed pass, on a model that takes images.
    for ok in (by_url, _user(ImagePart(data=b"\x89PNG", mime_type="image/png"))):
        assert prepare(_req(prompt=None, messages=ok), CAPS).messages == ok


# --- sampling --------------------------------------------------------------------------------------

# (field, accepted values, refused values): the ends of each range, inclusive or not.
SAMPLING_BOUNDS: list[tuple[str, list[float], list[float]]] = [
    ("temperature", [0.0, 100.0], [-0.001, 100.001, math.nan]),
    ("top_p", [0.001, 1.0], [0.0, 1.001, math.nan]),
    ("min_p", [0.0, 1.0], [-0.001, 1.001, math.nan]),
    ("repetition_penalty", [0.001, 100.0], [0.0, 100.001, math.nan]),
    ("frequency_penalty", [-2.0, 2.0], [-2.001, 2.001, math.nan]),
    ("presence_penalty", [-2.0, 2.0], [-2.001, 2.001, math.nan]),
]


@pytest.mark.parametrize(
    ("name", "accepted", "refused"), SAMPLING_BOUNDS, ids=[b[0] for b in SAMPLING_BOUNDS]
)
def test_sampling_ranges_end_where_the_contract_says(
    name: str, accepted: list[float], refused: list[float]
) -> None:
    for value in accepted:
        prepared = prepare(_req(sampling=SamplingParams(**{name: value})), CAPS)
        assert getattr(prepared.sampling, name) == value
    for value in refused:
        assert _invalid(_req(sampling=SamplingParams(**{name: value}))) == [f"sampling.{name}"]


def test_a_range_says_whether_its_low_end_is_included() -> None:
    (temperature,) = _refusal(_req(sampling=SamplingParams(temperature=-1.0))).violations
    assert temperature.description == "must be in [0.0, 100.0], got -1.0"
    (top_p,) = _refusal(_req(sampling=SamplingParams(top_p=0.0))).violations
    assert top_p.description == "must be in (0.0, 1.0], got 0.0"


def test_every_bad_sampling_field_is_listed_at_once() -> None:
    bad = SamplingParams(
        temperature=-1, top_p=0, min_p=2, repetition_penalty=0, frequency_penalty=3, presence_penalty=-3
    )
    assert _invalid(_req(sampling=bad)) == [
        "sampling.temperature",
        "sampling.top_p",
        "sampling.min_p",
        "sampling.repetition_penalty",
        "sampling.frequency_penalty",
        "sampling.presence_penalty",
    ]


# --- stopping, n, logprobs, backend options ----------------------------------------------------------


def test_max_tokens_is_positive_and_within_the_context() -> None:
    for refused in (0, -1, 1001):
        assert _invalid(_req(stopping=StoppingCriteria(max_tokens=refused))) == ["stopping.max_tokens"]
    for accepted in (1, 1000):
        assert (
            prepare(_req(stopping=StoppingCriteria(max_tokens=accepted)), CAPS).stopping.max_tokens
            == accepted
        )
    # No context length declared: no upper bound.
    unbounded = ModelCapabilities()
    assert prepare(_req(stopping=StoppingCriteria(max_tokens=10**6)), unbounded).stopping.max_tokens == 10**6


def test_an_empty_stop_sequence_names_its_index() -> None:
    stopping = StoppingCriteria(stop=("end", "", "x", ""))
    assert _invalid(_req(stopping=stopping)) == ["stopping.stop[1]", "stopping.stop[3]"]
    assert prepare(_req(stopping=StoppingCriteria(stop=("end",))), CAPS).stopping.stop == ("end",)


def test_n_is_between_one_and_the_model_max() -> None:
    for refused in (0, -1, 5):
        assert _invalid(_req(n=refused)) == ["n"]
    for accepted in (1, 4):
        assert prepare(_req(n=accepted), CAPS).n == accepted


def test_logprobs_unsupported_is_unimplemented_and_too_many_is_invalid() -> None:
    error = _refusal(_req(logprobs=1), ModelCapabilities())
    assert type(error) is Unimplemented
    assert error.reason == "LOGPROBS_UNSUPPORTED"
    assert _fields(error) == ["logprobs"]
    assert _invalid(_req(logprobs=6)) == ["logprobs"]
    for accepted in (0, 5):
        assert prepare(_req(logprobs=accepted), CAPS).logprobs == accepted


def test_an_unknown_backend_option_is_named_and_a_known_one_passes() -> None:
    long_key = "k" * 100
    assert _invalid(_req(backend_options={"nope": 1})) == ["backend_options[nope]"]
    # The field path carries at most 64 characters of a caller's key.
    assert _invalid(_req(backend_options={long_key: 1})) == [f"backend_options[{'k' * 64}]"]
    assert prepare(_req(backend_options={"mirostat": 2}), CAPS).backend_options == {"mirostat": 2}
    for bad in (math.nan, math.inf, -math.inf):  # JSON has none of them
        assert _invalid(_req(backend_options={"mirostat": bad})) == ["backend_options[mirostat]"]
    assert prepare(_req(backend_options={"mirostat": 0.5}), CAPS).backend_options == {"mirostat": 0.5}


def test_every_violation_of_a_request_is_listed_in_one_refusal() -> None:
    request = GenerationRequest(
        model="m",
        sampling=SamplingParams(temperature=-1),
        stopping=StoppingCriteria(max_tokens=0),
        n=0,
        logprobs=9,
        backend_options={"nope": 1},
    )
    assert _invalid(request) == [
        "input",
        "sampling.temperature",
        "stopping.max_tokens",
        "n",
        "logprobs",
        "backend_options[nope]",
    ]


def test_limits_come_first_and_say_so_in_the_reason() -> None:
    request = _req(prompt="x" * 100, sampling=SamplingParams(temperature=-1))
    error = _refusal(request, limits=RequestLimits(max_prompt_bytes=10))
    assert type(error) is InvalidArgument
    assert error.reason == LIMIT_REASON
    assert _fields(error) == ["prompt"]
    assert error.message.startswith("prompt: ")


# --- structured output -----------------------------------------------------------------------------

UNSUPPORTED_KIND: list[tuple[Any, str]] = [
    (JsonSchemaConstraint({"type": "object"}), "json_schema"),
    (RegexConstraint("a+"), "regex"),
    (ChoiceConstraint(("a",)), "choice"),
    (GrammarConstraint(GrammarSyntax.LARK, "start: 'a'"), "grammar"),
    (JsonObjectConstraint(), "json_object"),
]


@pytest.mark.parametrize(("constraint", "kind"), UNSUPPORTED_KIND, ids=[k for _, k in UNSUPPORTED_KIND])
def test_a_constraint_kind_the_model_did_not_declare_is_unimplemented(constraint: Any, kind: str) -> None:
    others = {k: Enforcement.ENGINE for k in ConstraintKind if k.value != kind}
    error = _refusal(
        _req(structured_output=StructuredOutput(constraint)), ModelCapabilities(constraints=others)
    )
    assert type(error) is Unimplemented
    assert error.reason == "CONSTRAINT_UNSUPPORTED"
    assert _fields(error) == [f"structured_output.{kind}"]
    assert error.metadata == {"constraint_kind": kind}
    # The message names what the model does enforce.
    assert ", ".join(sorted(k.value for k in others)) in error.message
    error = _refusal(_req(structured_output=StructuredOutput(constraint)), ModelCapabilities())
    assert "(it enforces: none)" in error.message


MALFORMED: list[tuple[StructuredOutput, str, str]] = [
    (
        StructuredOutput(JsonObjectConstraint(), additional_properties=False),
        "structured_output.options.additional_properties",
        "INVALID_OPTIONS",
    ),
    (StructuredOutput(RegexConstraint("")), "structured_output.regex.pattern", "INVALID_REGEX"),
    (StructuredOutput(ChoiceConstraint(())), "structured_output.choice.choices", "EMPTY_CHOICES"),
    (StructuredOutput(ChoiceConstraint(("a", ""))), "structured_output.choice.choices", "EMPTY_CHOICES"),
    (
        StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, " \n\t")),
        "structured_output.grammar.definition",
        "INVALID_GRAMMAR",
    ),
]


@pytest.mark.parametrize(
    ("structured", "field", "reason"), MALFORMED, ids=[m[2] + ":" + m[1] for m in MALFORMED]
)
def test_a_malformed_constraint_names_its_field_and_reason(
    structured: StructuredOutput, field: str, reason: str
) -> None:
    error = _refusal(_req(structured_output=structured))
    assert type(error) is InvalidArgument
    assert error.reason == reason
    assert _fields(error) == [field]


def test_a_grammar_syntax_the_model_does_not_take_is_unimplemented() -> None:
    structured = StructuredOutput(GrammarConstraint(GrammarSyntax.GBNF, 'root ::= "a"'))
    error = _refusal(_req(structured_output=structured))
    assert type(error) is Unimplemented
    assert error.reason == "GRAMMAR_SYNTAX_UNSUPPORTED"
    assert _fields(error) == ["structured_output.grammar.syntax"]
    assert "(supported: lark)" in error.message
    error = _refusal(_req(structured_output=structured), ModelCapabilities(constraints=ALL_KINDS))
    assert "(supported: none)" in error.message


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutput(JsonObjectConstraint()),
        StructuredOutput(JsonObjectConstraint(), additional_properties=True),
        StructuredOutput(RegexConstraint("a+")),
        StructuredOutput(ChoiceConstraint(("a", "b"))),
        StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, "start: 'a'")),
    ],
    ids=["json_object", "json_object-additional", "regex", "choice", "grammar"],
)
def test_a_well_formed_declared_constraint_passes(structured: StructuredOutput) -> None:
    assert prepare(_req(structured_output=structured), CAPS).structured_output == structured


# --- defaults --------------------------------------------------------------------------------------


def test_a_seed_is_drawn_only_for_a_model_that_takes_one() -> None:
    seeds = {prepare(_req(), CAPS).sampling.seed for _ in range(64)}
    # every engine takes a non-negative 63-bit seed; 64 draws of a 64-bit one would all fit 1 in 2**64
    assert all(s is not None and 0 <= s < 2**63 for s in seeds) and len(seeds) > 60
    assert prepare(_req(sampling=SamplingParams(seed=7)), CAPS).sampling.seed == 7
    assert prepare(_req(), ModelCapabilities()).sampling.seed is None


def test_max_tokens_defaults_to_the_smaller_of_the_default_and_the_context() -> None:
    assert prepare(_req(), CAPS).stopping.max_tokens == DEFAULT_MAX_TOKENS == 256
    assert prepare(_req(), ModelCapabilities(context_length=100)).stopping.max_tokens == 100
    assert prepare(_req(), ModelCapabilities(context_length=0)).stopping.max_tokens == DEFAULT_MAX_TOKENS
    # A default never touches the stop sequences the caller gave.
    stopping = StoppingCriteria(stop=("end",))
    assert prepare(_req(stopping=stopping), CAPS).stopping == StoppingCriteria(max_tokens=256, stop=("end",))


def test_the_request_id_is_filled_only_when_missing() -> None:
    assert prepare(_req(), CAPS, request_id="gen-1").request_id == "gen-1"
    assert prepare(_req(request_id="mine"), CAPS, request_id="gen-1").request_id == "mine"
    assert prepare(_req(), CAPS).request_id == ""
