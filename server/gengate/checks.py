"""Checks a request against the contract and a model's declared capabilities, and fills defaults.

Backends receive only requests that passed here: n within max_n, a seed when the model takes
one, max_tokens set, and a constraint kind the model declared. Field paths name proto fields.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from gengate import tools
from gengate.constraints.kinds import constraint_violations, spec_of
from gengate.domain import (
    GenerationRequest,
    ImagePart,
    MagpieInput,
    Modality,
    ModelCapabilities,
    Role,
    SamplingParams,
    StoppingCriteria,
    evolve,
)
from gengate.errors import FieldViolation, InvalidArgument, Unimplemented, echo
from gengate.limits import LIMIT_REASON, RequestLimits, text_violations
from gengate.magpie import PRESETS

DEFAULT_MAX_TOKENS = 256
DEFAULT_LIMITS = RequestLimits()

# (field, lowest, highest, lowest inclusive) for the float sampling fields.
_SAMPLING_RANGES: tuple[tuple[str, float, float, bool], ...] = (
    ("temperature", 0.0, 100.0, True),
    ("top_p", 0.0, 1.0, False),
    ("min_p", 0.0, 1.0, True),
    ("repetition_penalty", 0.0, 100.0, False),
    ("frequency_penalty", -2.0, 2.0, True),
    ("presence_penalty", -2.0, 2.0, True),
)


def prepare(
    request: GenerationRequest,
    caps: ModelCapabilities,
    *,
    request_id: str | None = None,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> GenerationRequest:
    """Returns the request with defaults filled, or raises with every bad field listed.

    Limits come first: a request over one is refused before anything reads its content.
    `request_id` is set when the request has none (one copy of the request instead of two).
    Checks that read a constraint's content run in the sandbox (gengate.constraints.sandbox).
    """
    over = request_violations(request, limits)
    if over:
        raise InvalidArgument(
            "; ".join(f"{v.field}: {v.description}" for v in over), reason=LIMIT_REASON, violations=over
        )
    _check_tool_support(request, caps)
    violations: list[FieldViolation] = []
    violations += _input_violations(request, caps)
    violations += _sampling_violations(request.sampling)
    violations += _stopping_violations(request.stopping, caps)
    if not 1 <= request.n <= caps.max_n:
        violations.append(
            FieldViolation("n", f"must be between 1 and {caps.max_n} for this model, got {request.n}")
        )
    if request.logprobs is not None:
        if not caps.logprobs:
            raise Unimplemented(
                "this model does not return logprobs",
                reason="LOGPROBS_UNSUPPORTED",
                violations=[FieldViolation("logprobs", "not supported by this model")],
            )
        if request.logprobs > caps.max_top_logprobs:
            violations.append(FieldViolation("logprobs", f"at most {caps.max_top_logprobs} top alternatives"))
    for key, value in request.backend_options.items():
        if key not in caps.backend_options:
            known = ", ".join(sorted(caps.backend_options)) or "none"
            violations.append(
                FieldViolation(
                    f"backend_options[{key[:64]}]",
                    f"unknown option {echo(key, 64)} (this model takes: {known})",
                )
            )
        elif isinstance(value, float) and not math.isfinite(value):
            # JSON has no NaN or infinity: a provider's body would carry null, or not be sent.
            violations.append(FieldViolation(f"backend_options[{key[:64]}]", "must be a finite number"))
    violations += tools.shape_violations(request)
    violations += _reasoning_violations(request)
    if violations:
        raise InvalidArgument(
            "; ".join(f"{v.field}: {v.description}" for v in violations),
            reason="INVALID_REQUEST",
            violations=violations,
        )
    _check_structured_output(request, caps)
    changes: dict[str, Any] = {}
    sampling = request.sampling
    if sampling.seed is None and caps.seed:
        changes["sampling"] = evolve(sampling, seed=secrets.randbits(63))
    stopping = request.stopping
    if stopping.max_tokens is None:
        limit = (
            DEFAULT_MAX_TOKENS if caps.context_length == 0 else min(DEFAULT_MAX_TOKENS, caps.context_length)
        )
        changes["stopping"] = evolve(stopping, max_tokens=limit)
    if request_id is not None and not request.request_id:
        changes["request_id"] = request_id
    return evolve(request, **changes) if changes else request


def request_violations(
    request: GenerationRequest, limits: RequestLimits, prefix: str = ""
) -> list[FieldViolation]:
    """Every limit the request exceeds (empty when none); cheap and linear in the request size:
    its texts' (gengate.limits), its constraint's (its kind's spec) and its tools' (gengate.tools)."""
    out = text_violations(request, limits)
    if request.structured_output is not None:
        out += constraint_violations(request.structured_output.constraint, limits)
    if request.tools or request.messages:
        out += tools.limit_violations(request, limits)
    return [FieldViolation(prefix + v.field, v.description) for v in out] if prefix else out


def _input_violations(request: GenerationRequest, caps: ModelCapabilities) -> list[FieldViolation]:
    if request.magpie is not None:
        return _magpie_violations(request, caps)
    if request.prompt is None and request.messages is None:
        return [FieldViolation("input", "set either prompt or messages")]
    if request.messages is None:
        return []
    if not caps.chat:
        return [FieldViolation("messages", "this model takes a raw prompt, not chat messages")]
    if not request.messages:
        return [FieldViolation("messages.messages", "must contain at least one message")]
    out: list[FieldViolation] = []
    for i, message in enumerate(request.messages):
        if not message.content and not message.tool_calls:  # a call may come without text
            out.append(FieldViolation(f"messages.messages[{i}].content", "must have at least one part"))
        for j, part in enumerate(message.content):
            if isinstance(part, ImagePart):
                where = f"messages.messages[{i}].content[{j}].image"
                if Modality.IMAGE not in caps.input_modalities:
                    out.append(FieldViolation(where, "this model does not take image input"))
                elif part.data is None and not part.url:
                    out.append(FieldViolation(where, "set data or url"))
                elif part.data is not None and not part.mime_type:
                    out.append(FieldViolation(f"{where}.mime_type", "is required with data"))
    return out


def _check_custom_pre_query(magpie: MagpieInput, caps: ModelCapabilities) -> None:
    """Refuses (UNIMPLEMENTED) a custom pre-query template where the server could not write a
    turn it asks for: a user turn after earlier ones needs the model's chat template to render
    them (chat continuation), an answer needs a chat model. Found before the first call, not
    as an unexpected error halfway through the conversation."""
    answers = not magpie.only_instruction and (magpie.n_turns > 1 or not magpie.end_with_user)
    later_user_turn = not magpie.only_instruction and magpie.n_turns > 1
    if (magpie.conversation or magpie.system_prompt or later_user_turn) and not caps.chat_continuation:
        raise Unimplemented(
            "a custom pre-query template after a system prompt, a conversation or an earlier turn "
            "needs the model's chat template, which this server cannot render for this model; use "
            "a preset",
            reason="MAGPIE_UNSUPPORTED",
            violations=[FieldViolation("magpie.template", "needs a preset on this model")],
        )
    if answers and not caps.chat:
        raise Unimplemented(
            "this model has no chat template to answer the written turn with; use a preset or "
            "only_instruction",
            reason="MAGPIE_UNSUPPORTED",
            violations=[FieldViolation("magpie.template", "needs a preset on this model")],
        )


def _magpie_violations(request: GenerationRequest, caps: ModelCapabilities) -> list[FieldViolation]:
    """A Magpie input on this model: refused (UNIMPLEMENTED) where prompts are not raw text, or
    (INVALID_ARGUMENT) for a preset whose special tokens the model's tokenizer lacks; else its
    fields' violations."""
    magpie = request.magpie
    assert magpie is not None
    if not caps.raw_prompt:
        raise Unimplemented(
            "this model takes no raw prompt (its provider applies the chat template), so it cannot "
            "write a user turn from a pre-query template (Magpie)",
            reason="MAGPIE_UNSUPPORTED",
            violations=[FieldViolation("magpie", "not supported by this model")],
        )
    out: list[FieldViolation] = []
    if magpie.preset is None and not magpie.template:
        out.append(FieldViolation("magpie.pre_query", "set a preset or a template"))
    if magpie.preset is not None and caps.special_tokens is not None:
        missing = sorted(PRESETS[magpie.preset].tokens - caps.special_tokens)
        if missing:
            raise InvalidArgument.field(
                "magpie.preset",
                f"the {magpie.preset.value} chat format needs special tokens this model's tokenizer "
                f"does not have: {', '.join(missing)}",
                reason="MAGPIE_TOKENS_MISSING",
            )
    if magpie.n_turns < 1:
        out.append(FieldViolation("magpie.n_turns", "must be at least 1"))
    for i, message in enumerate(magpie.conversation):
        if message.role is Role.SYSTEM:
            out.append(
                FieldViolation(f"magpie.conversation[{i}].role", "use system_prompt for the system turn")
            )
        if message.has_images:
            out.append(
                FieldViolation(f"magpie.conversation[{i}].content", "Magpie conversations are text only")
            )
        if message.role is Role.TOOL or message.tool_calls:
            out.append(
                FieldViolation(
                    f"magpie.conversation[{i}]", "Magpie conversations are user and assistant text turns"
                )
            )
    if magpie.preset is None:
        _check_custom_pre_query(magpie, caps)
    if request.structured_output is not None:
        out.append(FieldViolation("structured_output", "is not supported with magpie"))
    if request.logprobs is not None:
        out.append(FieldViolation("logprobs", "is not supported with magpie"))
    return out


def _sampling_violations(sampling: SamplingParams) -> list[FieldViolation]:
    out: list[FieldViolation] = []
    for name, low, high, low_inclusive in _SAMPLING_RANGES:
        value = getattr(sampling, name)
        if value is None:
            continue
        too_low = value < low if low_inclusive else value <= low
        if math.isnan(value) or too_low or value > high:
            bracket = "[" if low_inclusive else "("
            out.append(FieldViolation(f"sampling.{name}", f"must be in {bracket}{low}, {high}], got {value}"))
    return out


def _stopping_violations(stopping: StoppingCriteria, caps: ModelCapabilities) -> list[FieldViolation]:
    out: list[FieldViolation] = []
    if stopping.max_tokens is not None:
        if stopping.max_tokens <= 0:
            out.append(FieldViolation("stopping.max_tokens", "must be greater than 0"))
        elif caps.context_length and stopping.max_tokens > caps.context_length:
            out.append(
                FieldViolation("stopping.max_tokens", f"exceeds the context length {caps.context_length}")
            )
    for i, stop in enumerate(stopping.stop):
        if not stop:
            out.append(FieldViolation(f"stopping.stop[{i}]", "must not be empty"))
    return out


def _check_structured_output(request: GenerationRequest, caps: ModelCapabilities) -> None:
    """Refuses a constraint the model did not declare, or one that is malformed on its face (its
    kind's shape checks). Backend-specific checks (what a grammar engine can compile) happen in
    the backend.
    """
    structured = request.structured_output
    if structured is None:
        return
    spec = spec_of(structured)
    kind = spec.kind
    if kind not in caps.constraints:
        served = ", ".join(sorted(k.value for k in caps.constraints)) or "none"
        raise Unimplemented(
            f"model {request.model!r} cannot enforce {kind.value} output (it enforces: {served})",
            reason="CONSTRAINT_UNSUPPORTED",
            violations=[FieldViolation(spec.field, "not supported by this model")],
            metadata={"constraint_kind": kind.value},
        )
    spec.check_shape(structured, caps)


def _check_tool_support(request: GenerationRequest, caps: ModelCapabilities) -> None:
    """Refuses (UNIMPLEMENTED) tools, a tool conversation, reasoning control or chat-template
    variables sent to a model that declared no support for them: never dropped on the way."""
    where = tools.first_tool_field(request)
    if where is not None and caps.tools is None:
        raise Unimplemented(
            f"model {request.model!r} does not take tools (its backend maps no tool calling)",
            reason=tools.TOOLS_UNSUPPORTED,
            violations=[FieldViolation(where, "not supported by this model")],
        )
    if request.reasoning is not None and not caps.reasoning_control:
        raise Unimplemented(
            f"model {request.model!r} has no reasoning control",
            reason=tools.REASONING_UNSUPPORTED,
            violations=[FieldViolation("reasoning", "not supported by this model")],
        )
    if request.chat_template_kwargs and not caps.chat_template_kwargs:
        raise Unimplemented(
            f"model {request.model!r} does not pass variables to a chat template of its own",
            reason="CHAT_TEMPLATE_KWARGS_UNSUPPORTED",
            violations=[FieldViolation("chat_template_kwargs_json", "not supported by this model")],
        )


def _reasoning_violations(request: GenerationRequest) -> list[FieldViolation]:
    control = request.reasoning
    if control is None or control.enabled is not False:
        return []
    return [
        FieldViolation(f"reasoning.{name}", "is set but reasoning.enabled is false")
        for name in ("effort", "budget_tokens")
        if getattr(control, name) is not None
    ]
