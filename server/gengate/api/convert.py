"""The one place where protobuf meets domain objects, in both directions.

Round trips are tested in tests/unit/test_convert.py. Presence matters: an unset optional
proto field becomes None, never 0.
"""

from __future__ import annotations

import json
from typing import Any

from gengate_proto.v1 import generation_pb2 as gpb
from gengate_proto.v1 import jobs_pb2 as jpb
from gengate_proto.v1 import types_pb2 as pb
from google.protobuf import duration_pb2, json_format, struct_pb2, timestamp_pb2
from google.protobuf.json_format import MessageToDict

from gengate import domain as d
from gengate.api import convert_tools as tc
from gengate.errors import InvalidArgument, brief
from gengate.jobs.model import Job, JobOptions, JobState

_ROLE_FROM_PB = {
    pb.ROLE_SYSTEM: d.Role.SYSTEM,
    pb.ROLE_USER: d.Role.USER,
    pb.ROLE_ASSISTANT: d.Role.ASSISTANT,
    pb.ROLE_TOOL: d.Role.TOOL,
}
_ROLE_TO_PB = {v: k for k, v in _ROLE_FROM_PB.items()}
_SYNTAX_FROM_PB = {
    pb.GRAMMAR_SYNTAX_LARK: d.GrammarSyntax.LARK,
    pb.GRAMMAR_SYNTAX_GBNF: d.GrammarSyntax.GBNF,
    pb.GRAMMAR_SYNTAX_EBNF: d.GrammarSyntax.EBNF,
}
_SYNTAX_TO_PB = {v: k for k, v in _SYNTAX_FROM_PB.items()}
_WHITESPACE_FROM_PB = {
    pb.WHITESPACE_COMPACT: d.Whitespace.COMPACT,
    pb.WHITESPACE_FLEXIBLE: d.Whitespace.FLEXIBLE,
}
_WHITESPACE_TO_PB = {v: k for k, v in _WHITESPACE_FROM_PB.items()}
_FINISH_TO_PB = {
    d.FinishReason.STOP: pb.FINISH_REASON_STOP,
    d.FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    d.FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    d.FinishReason.CONTENT_FILTER: pb.FINISH_REASON_CONTENT_FILTER,
    d.FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    d.FinishReason.TIME_LIMIT: pb.FINISH_REASON_TIME_LIMIT,
    d.FinishReason.ERROR: pb.FINISH_REASON_ERROR,
    d.FinishReason.REFUSAL: pb.FINISH_REASON_REFUSAL,
    d.FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
_ENFORCEMENT_TO_PB = {
    d.Enforcement.NONE: pb.ENFORCEMENT_NONE,
    d.Enforcement.ENGINE: pb.ENFORCEMENT_ENGINE,
    d.Enforcement.NATIVE: pb.ENFORCEMENT_NATIVE,
    d.Enforcement.VALIDATED: pb.ENFORCEMENT_VALIDATED,
}
_ENFORCEMENT_FROM_PB = {v: k for k, v in _ENFORCEMENT_TO_PB.items()}
_KIND_TO_PB = {
    d.ConstraintKind.JSON_SCHEMA: pb.CONSTRAINT_KIND_JSON_SCHEMA,
    d.ConstraintKind.REGEX: pb.CONSTRAINT_KIND_REGEX,
    d.ConstraintKind.CHOICE: pb.CONSTRAINT_KIND_CHOICE,
    d.ConstraintKind.GRAMMAR: pb.CONSTRAINT_KIND_GRAMMAR,
    d.ConstraintKind.JSON_OBJECT: pb.CONSTRAINT_KIND_JSON_OBJECT,
}
_PRESET_TO_PB = {
    d.MagpiePreset.LLAMA3: pb.MAGPIE_PRESET_LLAMA3,
    d.MagpiePreset.QWEN2: pb.MAGPIE_PRESET_QWEN2,
    d.MagpiePreset.PHI3: pb.MAGPIE_PRESET_PHI3,
    d.MagpiePreset.GEMMA: pb.MAGPIE_PRESET_GEMMA,
}
_PRESET_FROM_PB = {v: k for k, v in _PRESET_TO_PB.items()}
_MODALITY_TO_PB = {d.Modality.TEXT: pb.MODALITY_TEXT, d.Modality.IMAGE: pb.MODALITY_IMAGE}


# ---- requests: proto → domain -------------------------------------------------------------


def request_from_pb(
    msg: gpb.GenerateRequest,
    *,
    deadline: float | None = None,
    prefix: str = "",
    max_schema_json_bytes: int | None = None,
    wire_bytes: int | None = None,
) -> d.GenerationRequest:
    """Converts a GenerateRequest; malformed enums/oneofs raise InvalidArgument naming the field.

    `prefix` is prepended to field paths (e.g. "requests[3]." inside a batch). A `schema_json`
    longer than `max_schema_json_bytes` is refused before it is parsed. `wire_bytes`: the
    message's serialized size when the caller knows it (else measured: costly on huge messages).
    Each tool's `parameters_json` is bounded by `max_schema_json_bytes` like `schema_json`.
    """
    which = msg.WhichOneof("input")
    prompt: str | None = None
    messages: tuple[d.ChatMessage, ...] | None = None
    magpie: d.MagpieInput | None = None
    if which == "prompt":
        prompt = msg.prompt
    elif which == "messages":
        messages = tuple(
            _message_from_pb(m, f"{prefix}messages.messages[{i}]")
            for i, m in enumerate(msg.messages.messages)
        )
    elif which == "magpie":
        magpie = magpie_from_pb(msg.magpie, f"{prefix}magpie")
    tools, tool_choice, parallel_tool_calls = tc.tools_from_pb(msg, prefix, max_schema_json_bytes)
    return d.GenerationRequest(
        model=msg.model,
        prompt=prompt,
        messages=messages,
        magpie=magpie,
        sampling=sampling_from_pb(msg.sampling),
        stopping=stopping_from_pb(msg.stopping),
        n=msg.n if msg.HasField("n") else 1,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        structured_output=structured_from_pb(msg.structured_output, prefix, max_schema_json_bytes)
        if msg.HasField("structured_output")
        else None,
        backend_options={
            k: _option_from_pb(v, f"{prefix}backend_options[{k}]") for k, v in msg.backend_options.items()
        },
        request_id=msg.request_id,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        reasoning=tc.reasoning_control_from_pb(msg.reasoning, f"{prefix}reasoning")
        if msg.HasField("reasoning")
        else None,
        chat_template_kwargs=tc.chat_template_kwargs_from_pb(
            msg.chat_template_kwargs_json, f"{prefix}chat_template_kwargs_json"
        ),
        deadline=deadline,
        wire_bytes=msg.ByteSize() if wire_bytes is None else wire_bytes,
    )


def magpie_from_pb(msg: pb.Magpie, where: str) -> d.MagpieInput:
    """A Magpie input; an unknown preset is INVALID_ARGUMENT naming the field."""
    preset: d.MagpiePreset | None = None
    which = msg.WhichOneof("pre_query")
    if which == "preset":
        preset = _PRESET_FROM_PB.get(msg.preset)
        if preset is None:
            names = ", ".join(pb.MagpiePreset.Name(v) for v in _PRESET_FROM_PB)
            raise InvalidArgument.field(f"{where}.preset", f"must be one of {names}")
    return d.MagpieInput(
        preset=preset,
        template=msg.template if which == "template" else None,
        system_prompt=msg.system_prompt if msg.HasField("system_prompt") else None,
        conversation=tuple(
            _message_from_pb(m, f"{where}.conversation[{i}]") for i, m in enumerate(msg.conversation)
        ),
        n_turns=msg.n_turns if msg.HasField("n_turns") else 1,
        only_instruction=msg.only_instruction,
        end_with_user=msg.end_with_user,
    )


def magpie_to_pb(m: d.MagpieInput) -> pb.Magpie:
    msg = pb.Magpie(
        conversation=[_message_to_pb(c) for c in m.conversation],
        n_turns=m.n_turns,
        only_instruction=m.only_instruction,
        end_with_user=m.end_with_user,
    )
    if m.preset is not None:
        msg.preset = _PRESET_TO_PB[m.preset]
    elif m.template is not None:
        msg.template = m.template
    if m.system_prompt is not None:
        msg.system_prompt = m.system_prompt
    return msg


def _message_from_pb(msg: pb.ChatMessage, where: str) -> d.ChatMessage:
    role = _ROLE_FROM_PB.get(msg.role)
    if role is None:
        raise InvalidArgument.field(
            f"{where}.role", "must be ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT or ROLE_TOOL"
        )
    parts: list[d.ContentPart] = []
    for j, part in enumerate(msg.content):
        kind = part.WhichOneof("part")
        if kind == "text":
            parts.append(d.TextPart(part.text))
        elif kind == "image":
            source = part.image.WhichOneof("source")
            parts.append(
                d.ImagePart(
                    data=part.image.data if source == "data" else None,
                    url=part.image.url if source == "url" else None,
                    mime_type=part.image.mime_type,
                )
            )
        else:
            raise InvalidArgument.field(f"{where}.content[{j}]", "set text or image")
    return d.ChatMessage(role=role, content=tuple(parts), name=msg.name, **tc.message_extras_from_pb(msg))


def _optional(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


def sampling_from_pb(msg: pb.SamplingParams) -> d.SamplingParams:
    return d.SamplingParams(**{f: _optional(msg, f) for f in d.SAMPLING_FIELDS})


def stopping_from_pb(msg: pb.StoppingCriteria) -> d.StoppingCriteria:
    return d.StoppingCriteria(max_tokens=_optional(msg, "max_tokens"), stop=tuple(msg.stop))


def structured_from_pb(
    msg: pb.StructuredOutput, prefix: str = "", max_json_bytes: int | None = None
) -> d.StructuredOutput:
    kind = msg.WhichOneof("kind")
    where = f"{prefix}structured_output"
    constraint: d.Constraint
    if kind == "json_schema":
        constraint = d.JsonSchemaConstraint(
            schema=_schema_from_pb(msg.json_schema, f"{where}.json_schema", max_json_bytes),
            name=msg.json_schema.name,
            strict=msg.json_schema.strict,
        )
    elif kind == "regex":
        constraint = d.RegexConstraint(msg.regex.pattern)
    elif kind == "choice":
        constraint = d.ChoiceConstraint(tuple(msg.choice.choices))
    elif kind == "grammar":
        syntax = _SYNTAX_FROM_PB.get(msg.grammar.syntax)
        if syntax is None:
            raise InvalidArgument.field(
                f"{where}.grammar.syntax",
                "must be GRAMMAR_SYNTAX_LARK, _GBNF or _EBNF",
                reason="INVALID_GRAMMAR",
            )
        constraint = d.GrammarConstraint(syntax, msg.grammar.definition)
    elif kind == "json_object":
        constraint = d.JsonObjectConstraint()
    else:
        raise InvalidArgument.field(
            f"{where}.kind", "set one of json_schema, regex, choice, grammar, json_object"
        )
    options = msg.options
    if options.whitespace != pb.WHITESPACE_UNSPECIFIED and options.whitespace not in _WHITESPACE_FROM_PB:
        raise InvalidArgument.field(
            f"{where}.options.whitespace",
            f"unknown value {options.whitespace}: use WHITESPACE_COMPACT or WHITESPACE_FLEXIBLE",
            reason="INVALID_ENUM",
        )
    return d.StructuredOutput(
        constraint=constraint,
        whitespace=_WHITESPACE_FROM_PB.get(options.whitespace),
        additional_properties=_optional(options, "additional_properties"),
    )


def _schema_from_pb(msg: pb.JsonSchema, where: str, max_json_bytes: int | None = None) -> dict[str, Any]:
    """The schema from schema_json (order and integers kept) or from the Struct."""
    has_struct = msg.HasField("schema")
    if msg.schema_json and has_struct:
        raise InvalidArgument.field(f"{where}.schema_json", "set schema or schema_json, not both")
    if has_struct:
        return struct_to_dict(msg.schema)
    if not msg.schema_json:
        raise InvalidArgument.field(
            f"{where}.schema", "is required (or schema_json)", reason="INVALID_SCHEMA"
        )
    return tc.json_object(
        msg.schema_json,
        f"{where}.schema_json",
        max_bytes=max_json_bytes,
        limit_name="server.limits.max_constraint_bytes",
    )


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    """Struct → dict, turning integral floats back into ints (Struct stores every number as a double)."""
    return _restore_ints(MessageToDict(struct))  # type: ignore[no-any-return]


def _restore_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _restore_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore_ints(v) for v in value]
    return value


def _option_from_pb(value: pb.BackendOptionValue, where: str) -> d.BackendOptionValue:
    kind = value.WhichOneof("value")
    if kind is None:
        raise InvalidArgument.field(where, "has no value")
    result: d.BackendOptionValue = getattr(value, kind)
    return result


# ---- domain → proto -------------------------------------------------------------------------


def request_to_pb(req: d.GenerationRequest) -> gpb.GenerateRequest:
    """Domain request → proto (used by round-trip tests and composites that call over gRPC)."""
    msg = gpb.GenerateRequest(model=req.model, request_id=req.request_id)
    if req.prompt is not None:
        msg.prompt = req.prompt
    elif req.messages is not None:
        msg.messages.SetInParent()
        msg.messages.messages.extend(_message_to_pb(m) for m in req.messages)
    elif req.magpie is not None:
        msg.magpie.CopyFrom(magpie_to_pb(req.magpie))
    msg.sampling.CopyFrom(sampling_to_pb(req.sampling))
    msg.stopping.CopyFrom(stopping_to_pb(req.stopping))
    msg.n = req.n
    if req.logprobs is not None:
        msg.logprobs = req.logprobs
    if req.structured_output is not None:
        msg.structured_output.CopyFrom(structured_to_pb(req.structured_output))
    for key, value in req.backend_options.items():
        msg.backend_options[key].CopyFrom(_option_to_pb(value))
    tc.tools_to_pb(req, msg)
    return msg


def _message_to_pb(m: d.ChatMessage) -> pb.ChatMessage:
    out = pb.ChatMessage(role=_ROLE_TO_PB[m.role], name=m.name)
    for part in m.content:
        if isinstance(part, d.TextPart):
            out.content.add(text=part.text)
        elif part.data is not None:
            out.content.add(image=pb.Image(data=part.data, mime_type=part.mime_type))
        else:
            out.content.add(image=pb.Image(url=part.url or "", mime_type=part.mime_type))
    tc.message_extras_to_pb(m, out)
    return out


def _option_to_pb(value: d.BackendOptionValue) -> pb.BackendOptionValue:
    if isinstance(value, bool):
        return pb.BackendOptionValue(bool_value=value)
    if isinstance(value, int):
        return pb.BackendOptionValue(int_value=value)
    if isinstance(value, float):
        return pb.BackendOptionValue(double_value=value)
    return pb.BackendOptionValue(string_value=value)


def structured_to_pb(so: d.StructuredOutput) -> pb.StructuredOutput:
    msg = pb.StructuredOutput()
    c = so.constraint
    if isinstance(c, d.JsonSchemaConstraint):
        msg.json_schema.name = c.name
        msg.json_schema.strict = c.strict
        msg.json_schema.schema_json = json.dumps(c.schema)
    elif isinstance(c, d.RegexConstraint):
        msg.regex.pattern = c.pattern
    elif isinstance(c, d.ChoiceConstraint):
        msg.choice.choices.extend(c.choices)
    elif isinstance(c, d.GrammarConstraint):
        msg.grammar.syntax = _SYNTAX_TO_PB[c.syntax]
        msg.grammar.definition = c.definition
    else:
        msg.json_object.SetInParent()
    if so.whitespace is not None:
        msg.options.whitespace = _WHITESPACE_TO_PB[so.whitespace]
    if so.additional_properties is not None:
        msg.options.additional_properties = so.additional_properties
    return msg


def sampling_to_pb(s: d.SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams()
    for name in d.SAMPLING_FIELDS:
        value = getattr(s, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def stopping_to_pb(s: d.StoppingCriteria) -> pb.StoppingCriteria:
    msg = pb.StoppingCriteria(stop=list(s.stop))
    if s.max_tokens is not None:
        msg.max_tokens = s.max_tokens
    return msg


def _duration(seconds: float | None) -> duration_pb2.Duration | None:
    if seconds is None:
        return None
    out = duration_pb2.Duration()
    out.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return out


def timings_to_pb(t: d.Timings) -> pb.Timings:
    msg = pb.Timings()
    for field, value in (
        ("queue", t.queue_s),
        ("time_to_first_token", t.time_to_first_token_s),
        ("total", t.total_s),
    ):
        duration = _duration(value)
        if duration is not None:
            getattr(msg, field).CopyFrom(duration)
    return msg


def usage_to_pb(u: d.Usage) -> pb.Usage:
    return pb.Usage(
        input_tokens=u.input_tokens, output_tokens=u.output_tokens, cached_input_tokens=u.cached_input_tokens
    )


def logprobs_to_pb(entries: tuple[d.TokenLogprob, ...]) -> pb.Logprobs:
    msg = pb.Logprobs()
    for e in entries:
        token = msg.tokens.add(token=e.token, logprob=e.logprob)
        if e.token_id is not None:
            token.token_id = e.token_id
        for alt in e.top:
            top = token.top.add(token=alt.token, logprob=alt.logprob)
            if alt.token_id is not None:
                top.token_id = alt.token_id
    return msg


def generation_to_pb(g: d.Generation) -> pb.Generation:
    msg = pb.Generation(
        index=g.index,
        text=g.text,
        finish_reason=_FINISH_TO_PB[g.finish_reason],
        output_tokens=g.output_tokens,
    )
    if g.matched_stop is not None:
        msg.matched_stop = g.matched_stop
    if g.logprobs is not None:
        msg.logprobs.CopyFrom(logprobs_to_pb(g.logprobs))
    for turn in g.conversation:
        msg.conversation.add(role=_ROLE_TO_PB[turn.role], text=turn.text, output_tokens=turn.output_tokens)
    msg.tool_calls.extend(tc.tool_call_to_pb(c) for c in g.tool_calls)
    if g.reasoning is not None:
        msg.reasoning.CopyFrom(tc.reasoning_to_pb(g.reasoning))
    return msg


def result_to_pb(r: d.GenerationResult) -> gpb.GenerateResponse:
    return gpb.GenerateResponse(
        request_id=r.request_id,
        model=r.model,
        generations=[generation_to_pb(g) for g in r.generations],
        usage=usage_to_pb(r.usage),
        enforcement=_ENFORCEMENT_TO_PB[r.enforcement],
        effective_sampling=sampling_to_pb(r.effective_sampling),
        effective_stopping=stopping_to_pb(r.effective_stopping),
        timings=timings_to_pb(r.timings),
    )


def result_from_pb(msg: gpb.GenerateResponse) -> d.GenerationResult:
    """Proto → domain result (round-trip tests, composites)."""
    return d.GenerationResult(
        request_id=msg.request_id,
        model=msg.model,
        generations=tuple(
            d.Generation(
                index=g.index,
                text=g.text,
                finish_reason=_FINISH_FROM_PB[g.finish_reason],
                output_tokens=g.output_tokens,
                matched_stop=g.matched_stop if g.HasField("matched_stop") else None,
                logprobs=tuple(
                    d.TokenLogprob(
                        token=t.token,
                        logprob=t.logprob,
                        token_id=t.token_id if t.HasField("token_id") else None,
                        top=tuple(
                            d.TopLogprob(a.token, a.logprob, a.token_id if a.HasField("token_id") else None)
                            for a in t.top
                        ),
                    )
                    for t in g.logprobs.tokens
                )
                if g.HasField("logprobs")
                else None,
                conversation=tuple(
                    d.ConversationTurn(_ROLE_FROM_PB[t.role], t.text, t.output_tokens) for t in g.conversation
                ),
                tool_calls=tuple(tc.tool_call_from_pb(c) for c in g.tool_calls),
                reasoning=tc.reasoning_from_pb(g.reasoning) if g.HasField("reasoning") else None,
            )
            for g in msg.generations
        ),
        usage=d.Usage(msg.usage.input_tokens, msg.usage.output_tokens, msg.usage.cached_input_tokens),
        enforcement=_ENFORCEMENT_FROM_PB[msg.enforcement],
        effective_sampling=sampling_from_pb(msg.effective_sampling),
        effective_stopping=stopping_from_pb(msg.effective_stopping),
        timings=d.Timings(
            queue_s=msg.timings.queue.ToNanoseconds() / 1e9 if msg.timings.HasField("queue") else None,
            time_to_first_token_s=msg.timings.time_to_first_token.ToNanoseconds() / 1e9
            if msg.timings.HasField("time_to_first_token")
            else None,
            total_s=msg.timings.total.ToNanoseconds() / 1e9 if msg.timings.HasField("total") else None,
        ),
    )


def event_to_pb(event: d.StreamEvent) -> gpb.GenerateStreamResponse:
    if isinstance(event, d.StreamStart):
        return gpb.GenerateStreamResponse(
            start=pb.StreamStart(
                request_id=event.request_id,
                model=event.model,
                input_tokens=event.input_tokens,
                enforcement=_ENFORCEMENT_TO_PB[event.enforcement],
                effective_sampling=sampling_to_pb(event.effective_sampling),
                effective_stopping=stopping_to_pb(event.effective_stopping),
            )
        )
    if isinstance(event, d.GenerationDelta):
        delta = pb.GenerationDelta(
            index=event.index,
            text=event.text,
            token_count=event.token_count,
            tool_calls=[tc.tool_call_delta_to_pb(c) for c in event.tool_calls],
            reasoning=event.reasoning,
        )
        if event.logprobs is not None:
            delta.logprobs.CopyFrom(logprobs_to_pb(event.logprobs))
        return gpb.GenerateStreamResponse(delta=delta)
    end = pb.GenerationEnd(
        index=event.index,
        finish_reason=_FINISH_TO_PB[event.finish_reason],
        usage=usage_to_pb(event.usage),
        timings=timings_to_pb(event.timings),
        tool_calls=[tc.tool_call_to_pb(c) for c in event.tool_calls],
        reasoning_signatures=list(event.reasoning_signatures),
    )
    if event.matched_stop is not None:
        end.matched_stop = event.matched_stop
    return gpb.GenerateStreamResponse(end=end)


def model_info_to_pb(info: d.ModelInfo) -> pb.ModelInfo:
    caps = info.capabilities
    return pb.ModelInfo(
        name=info.name,
        backend=info.backend,
        capabilities=pb.ModelCapabilities(
            constraints=[
                pb.ConstraintSupport(kind=_KIND_TO_PB[k], enforcement=_ENFORCEMENT_TO_PB[e])
                for k, e in sorted(caps.constraints.items(), key=lambda kv: _KIND_TO_PB[kv[0]])
            ],
            grammar_syntaxes=sorted(_SYNTAX_TO_PB[s] for s in caps.grammar_syntaxes),
            max_n=caps.max_n,
            logprobs=caps.logprobs,
            max_top_logprobs=caps.max_top_logprobs,
            input_modalities=sorted(_MODALITY_TO_PB[m] for m in caps.input_modalities),
            context_length=caps.context_length,
            seed=caps.seed,
            chat=caps.chat,
            backend_options=sorted(caps.backend_options),
            magpie=caps.raw_prompt,
            tools=pb.ENFORCEMENT_UNSPECIFIED if caps.tools is None else _ENFORCEMENT_TO_PB[caps.tools],
            reasoning_control=caps.reasoning_control,
            reasoning=caps.reasoning,
        ),
    )


# -- batch jobs ------------------------------------------------------------------------------

_JOB_STATES = {
    JobState.QUEUED: jpb.BATCH_JOB_STATE_QUEUED,
    JobState.RUNNING: jpb.BATCH_JOB_STATE_RUNNING,
    JobState.SUCCEEDED: jpb.BATCH_JOB_STATE_SUCCEEDED,
    JobState.FAILED: jpb.BATCH_JOB_STATE_FAILED,
    JobState.CANCELLED: jpb.BATCH_JOB_STATE_CANCELLED,
}


def _timestamp(seconds: float | None) -> timestamp_pb2.Timestamp | None:
    if seconds is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def job_options_from_pb(msg: jpb.BatchJobOptions) -> JobOptions:
    return JobOptions(offline=msg.offline, priority=msg.priority, max_concurrency=msg.max_concurrency)


def job_to_pb(job: Job) -> jpb.BatchJob:
    return jpb.BatchJob(
        id=job.id,
        display_name=job.display_name,
        state=_JOB_STATES[job.state],
        total=job.total,
        done=job.done,
        failed=job.failed,
        create_time=_timestamp(job.create_time),
        start_time=_timestamp(job.start_time),
        end_time=_timestamp(job.end_time),
        usage=jpb.BatchJobUsage(
            input_tokens=job.usage.input_tokens,
            output_tokens=job.usage.output_tokens,
            cached_input_tokens=job.usage.cached_input_tokens,
        ),
        options=jpb.BatchJobOptions(
            offline=job.options.offline,
            priority=job.options.priority,
            max_concurrency=job.options.max_concurrency,
        ),
        idempotency_key=job.idempotency_key,
        error=job.error,
    )


_ROLES = {"system": "ROLE_SYSTEM", "user": "ROLE_USER", "assistant": "ROLE_ASSISTANT", "tool": "ROLE_TOOL"}
_TOP_LEVEL_SAMPLING = ("seed", "temperature", "top_p", "top_k")


def request_from_json_line(line: str, index: int) -> gpb.GenerateRequest:
    """A JSONL item of a batch job: GenerateRequest fields in protobuf's JSON mapping, with
    `prompt` text, `messages` as [{"role", "content"}] and sampling/max_tokens shorthands.
    InvalidArgument (field `requests[i]`) when the line is not one."""
    field = f"requests[{index}]"
    try:
        raw = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument.field(
            field, f"the line is not JSON: {brief(str(exc))}", reason="INVALID_JSON_LINE"
        ) from None
    if not isinstance(raw, dict):
        raise InvalidArgument.field(field, "the line must be a JSON object", reason="INVALID_JSON_LINE")
    sampling = dict(raw.pop("sampling", None) or {})
    for key in _TOP_LEVEL_SAMPLING:
        if key in raw:
            sampling[key] = raw.pop(key)
    if sampling:
        raw["sampling"] = sampling
    if "max_tokens" in raw or "maxTokens" in raw:
        stopping = dict(raw.pop("stopping", None) or {})
        stopping["maxTokens"] = raw.pop("max_tokens", raw.pop("maxTokens", None))
        raw["stopping"] = stopping
    if isinstance(raw.get("messages"), list):
        raw["messages"] = {"messages": [_friendly_message(m) for m in raw["messages"]]}
    try:
        return json_format.ParseDict(raw, gpb.GenerateRequest())
    except (json_format.ParseError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise InvalidArgument.field(
            field, f"not a GenerateRequest: {brief(str(exc))}", reason="INVALID_JSON_LINE"
        ) from None


def _friendly_message(message: Any) -> Any:
    """{"role": "user", "content": "text"} as protobuf JSON; anything else is left for ParseDict."""
    if not isinstance(message, dict):
        return message
    out = dict(message)
    role = out.get("role")
    if isinstance(role, str) and role.lower() in _ROLES:
        out["role"] = _ROLES[role.lower()]
    if isinstance(out.get("content"), str):
        out["content"] = [{"text": out["content"]}]
    return out


def merged_request(defaults: gpb.GenerateRequest, item: gpb.GenerateRequest) -> gpb.GenerateRequest:
    """`item` over `defaults`: fields the item sets win; lists (messages, stop strings, tools) and
    the structured output, tool choice and reasoning control are replaced whole rather than
    appended to or merged."""
    out = gpb.GenerateRequest()
    out.CopyFrom(defaults)
    out.MergeFrom(item)
    if item.HasField("messages"):
        out.messages.CopyFrom(item.messages)
    if item.HasField("magpie"):
        out.magpie.CopyFrom(item.magpie)
    if item.stopping.stop:
        del out.stopping.stop[:]
        out.stopping.stop.extend(item.stopping.stop)
    if item.HasField("structured_output"):
        out.structured_output.CopyFrom(item.structured_output)
    if item.tools:
        del out.tools[:]
        out.tools.extend(item.tools)
    for whole in ("tool_choice", "reasoning"):
        if item.HasField(whole):
            getattr(out, whole).CopyFrom(getattr(item, whole))
    return out
