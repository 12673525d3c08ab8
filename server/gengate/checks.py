"""Checks a request against the contract and a model's declared capabilities, and fills defaults.

Backends receive only requests that passed here: n within max_n, a seed when the model takes
one, max_tokens set, and a constraint kind the model declared. Field paths name proto fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import threading
from collections import OrderedDict
from typing import Any

import jsonschema

from gengate.constraints.validation import regex_syntax_error
from gengate.domain import (
    ChoiceConstraint,
    GenerationRequest,
    GrammarConstraint,
    ImagePart,
    JsonSchemaConstraint,
    Modality,
    ModelCapabilities,
    RegexConstraint,
    SamplingParams,
    StoppingCriteria,
)
from gengate.errors import FieldViolation, InvalidArgument, Unimplemented

DEFAULT_MAX_TOKENS = 256
MAX_STOP_SEQUENCES = 16

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
    request: GenerationRequest, caps: ModelCapabilities, *, request_id: str | None = None
) -> GenerationRequest:
    """Returns the request with defaults filled, or raises with every bad field listed.

    `request_id` is set when the request has none (one copy of the request instead of two).
    """
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
    for key in request.backend_options:
        if key not in caps.backend_options:
            known = ", ".join(sorted(caps.backend_options)) or "none"
            violations.append(
                FieldViolation(f"backend_options[{key}]", f"unknown option (this model takes: {known})")
            )
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
        changes["sampling"] = dataclasses.replace(sampling, seed=secrets.randbits(63))
    stopping = request.stopping
    if stopping.max_tokens is None:
        limit = (
            DEFAULT_MAX_TOKENS if caps.context_length == 0 else min(DEFAULT_MAX_TOKENS, caps.context_length)
        )
        changes["stopping"] = dataclasses.replace(stopping, max_tokens=limit)
    if request_id is not None and not request.request_id:
        changes["request_id"] = request_id
    return dataclasses.replace(request, **changes) if changes else request


def _input_violations(request: GenerationRequest, caps: ModelCapabilities) -> list[FieldViolation]:
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
        if not message.content:
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
    if len(stopping.stop) > MAX_STOP_SEQUENCES:
        out.append(FieldViolation("stopping.stop", f"at most {MAX_STOP_SEQUENCES} stop sequences"))
    for i, stop in enumerate(stopping.stop):
        if not stop:
            out.append(FieldViolation(f"stopping.stop[{i}]", "must not be empty"))
    return out


_VALID_SCHEMAS_MAX = 256
_valid_schemas: OrderedDict[str, None] = OrderedDict()  # JSON text of schemas that passed
_valid_schemas_lock = threading.Lock()


def _check_schema(schema: dict[str, Any]) -> None:
    """Checks a schema against its metaschema (raises jsonschema.SchemaError), remembering the
    last schemas that passed: the check costs ~2 ms, and clients send the same schema again and
    again. Failures are not remembered, so their error is always the one found for that schema."""
    try:
        key: str | None = json.dumps(schema)
    except (TypeError, ValueError):
        key = None
    if key is not None:
        with _valid_schemas_lock:
            if key in _valid_schemas:
                _valid_schemas.move_to_end(key)
                return
    jsonschema.validators.validator_for(schema).check_schema(schema)
    if key is not None:
        with _valid_schemas_lock:
            _valid_schemas[key] = None
            while len(_valid_schemas) > _VALID_SCHEMAS_MAX:
                _valid_schemas.popitem(last=False)


def _check_structured_output(request: GenerationRequest, caps: ModelCapabilities) -> None:
    """Refuses a constraint the model did not declare, or one that is malformed on its face.

    Backend-specific checks (what a grammar engine can compile) happen in the backend.
    """
    if request.structured_output is None:
        return
    constraint = request.structured_output.constraint
    kind = constraint.kind
    if kind not in caps.constraints:
        served = ", ".join(sorted(k.value for k in caps.constraints)) or "none"
        raise Unimplemented(
            f"model {request.model!r} cannot enforce {kind.value} output (it enforces: {served})",
            reason="CONSTRAINT_UNSUPPORTED",
            violations=[FieldViolation(f"structured_output.{kind.value}", "not supported by this model")],
            metadata={"constraint_kind": kind.value},
        )
    if isinstance(constraint, JsonSchemaConstraint):
        try:
            _check_schema(constraint.schema)
        except jsonschema.SchemaError as exc:
            path = "/".join(str(p) for p in exc.path) or "<root>"
            raise InvalidArgument.field(
                "structured_output.json_schema.schema",
                f"not a valid JSON Schema at {path}: {exc.message}",
                reason="INVALID_SCHEMA",
            ) from exc
    elif isinstance(constraint, RegexConstraint):
        if not constraint.pattern:
            raise InvalidArgument.field(
                "structured_output.regex.pattern", "must not be empty", reason="INVALID_REGEX"
            )
        problem = regex_syntax_error(constraint.pattern)
        if problem is not None:
            raise InvalidArgument.field(
                "structured_output.regex.pattern",
                f"invalid regular expression: {problem}",
                reason="INVALID_REGEX",
            )
    elif isinstance(constraint, ChoiceConstraint):
        if not constraint.choices:
            raise InvalidArgument.field(
                "structured_output.choice.choices", "must list at least one choice", reason="EMPTY_CHOICES"
            )
        if any(c == "" for c in constraint.choices):
            raise InvalidArgument.field(
                "structured_output.choice.choices",
                "choices must not be empty strings",
                reason="EMPTY_CHOICES",
            )
    elif isinstance(constraint, GrammarConstraint):
        if not constraint.definition.strip():
            raise InvalidArgument.field(
                "structured_output.grammar.definition", "must not be empty", reason="INVALID_GRAMMAR"
            )
        if constraint.syntax not in caps.grammar_syntaxes:
            served = ", ".join(sorted(s.value for s in caps.grammar_syntaxes)) or "none"
            raise Unimplemented(
                f"grammar syntax {constraint.syntax.value} is not supported by this model "
                f"(supported: {served})",
                reason="GRAMMAR_SYNTAX_UNSUPPORTED",
                violations=[
                    FieldViolation("structured_output.grammar.syntax", "not supported by this model")
                ],
            )
