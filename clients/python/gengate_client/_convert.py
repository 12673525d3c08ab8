"""Everything the sync and async clients share: request building and response conversion.

The two clients differ only at their call sites; all proto handling lives here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from gengate_proto.v1 import generation_pb2, types_pb2
from google.protobuf import duration_pb2

from gengate_client.errors import OutputError, TruncatedOutputError, error_from_status
from gengate_client.output_types import OutputSpec, resolve_output_type
from gengate_client.tools import build_tool, build_tool_choice, resolve_tools
from gengate_client.types import (
    MAGPIE_PRESETS,
    ConstraintKind,
    ConstraintSupport,
    Enforcement,
    FinishReason,
    Generation,
    GrammarSyntax,
    ImagePart,
    ItemResult,
    Magpie,
    Message,
    MessageLike,
    Modality,
    ModelCapabilities,
    ModelInfo,
    Reasoning,
    ReasoningControl,
    Request,
    Response,
    RoleName,
    StreamDelta,
    StreamEnd,
    StreamFrame,
    StreamStart,
    TextPart,
    Timings,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolLike,
    TopLogprob,
    Turn,
    Usage,
)

MetadataLike = Mapping[str, str] | Sequence[tuple[str, str | bytes]]


class BaseOptions(TypedDict, total=False):
    """Keyword arguments of `generate()` and friends other than `output_type`, for both clients."""

    messages: Sequence[MessageLike] | None
    magpie: Magpie | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    frequency_penalty: float | None
    presence_penalty: float | None
    seed: int | None
    stop: Sequence[str] | None
    n: int | None
    logprobs: int | None
    backend_options: Mapping[str, str | int | float | bool] | None
    request_id: str | None
    tools: Sequence[ToolLike] | None
    tool_choice: Any
    parallel_tool_calls: bool | None
    reasoning: ReasoningControl | None
    chat_template_kwargs: Mapping[str, Any] | None
    timeout: float | None
    metadata: MetadataLike | None


class GenerateOptions(BaseOptions, total=False):
    """All keyword arguments of `generate()`: BaseOptions plus the output type."""

    output_type: Any


_CALL_OPTIONS = ("timeout", "metadata")
_ROLES = {
    "system": types_pb2.ROLE_SYSTEM,
    "user": types_pb2.ROLE_USER,
    "assistant": types_pb2.ROLE_ASSISTANT,
    "tool": types_pb2.ROLE_TOOL,
}
_ROLE_NAMES: dict[int, RoleName] = {v: k for k, v in _ROLES.items()}  # type: ignore[misc]
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
)


def split_options(model: str, prompt: str | None, options: GenerateOptions) -> tuple[Request, CallSettings]:
    """Separates request fields from per-call options (timeout, metadata)."""
    fields: dict[str, Any] = {k: v for k, v in options.items() if k not in _CALL_OPTIONS}
    call = CallSettings(options.get("timeout"), options.get("metadata"))
    return Request(model=model, prompt=prompt, **fields), call


@dataclasses.dataclass(frozen=True)
class CallSettings:
    """Per-call deadline and metadata, before merging with the client's defaults."""

    timeout: float | None = None
    metadata: MetadataLike | None = None

    def kwargs(self, default_timeout: float | None, default_metadata: MetadataLike | None) -> dict[str, Any]:
        """Keyword arguments for a stub call: timeout and merged metadata."""
        timeout = self.timeout if self.timeout is not None else default_timeout
        metadata = call_metadata(default_metadata, self.metadata)
        trace = trace_context()
        if trace:
            metadata = [*(metadata or []), *trace]
        return {"timeout": timeout, "metadata": metadata}


_UNLOADED: Any = object()
_inject: Any = _UNLOADED


def trace_context() -> list[tuple[str, str]]:
    """W3C trace context of the current OpenTelemetry span (when opentelemetry is installed), so one
    trace spans client → server → backend. Empty without opentelemetry or an active span."""
    global _inject
    if _inject is _UNLOADED:
        try:
            from opentelemetry import propagate
        except ImportError:
            _inject = None
        else:
            _inject = propagate.inject
    if _inject is None:
        return []
    carrier: dict[str, str] = {}
    _inject(carrier)
    return [(k.lower(), v) for k, v in carrier.items()]


def as_request(item: Request | Mapping[str, Any]) -> Request:
    """A batch item given as a Request or as a dict of `generate()` keyword arguments."""
    if isinstance(item, Request):
        return item
    return Request(**item)


def call_metadata(
    default: MetadataLike | None, extra: MetadataLike | None
) -> list[tuple[str, str | bytes]] | None:
    """Client-wide metadata plus per-call metadata; a key given per call replaces the default."""
    extra_items = [(str(k).lower(), v) for k, v in _items(extra)]
    override = {k for k, _ in extra_items}
    pairs = [(str(k).lower(), v) for k, v in _items(default) if str(k).lower() not in override]
    return (pairs + extra_items) or None


def _items(source: MetadataLike | None) -> list[tuple[str, Any]]:
    if source is None:
        return []
    return list(source.items()) if isinstance(source, Mapping) else list(source)


def _content_part(part: TextPart | ImagePart | Mapping[str, Any]) -> types_pb2.ContentPart:
    if isinstance(part, TextPart):
        return types_pb2.ContentPart(text=part.text)
    if isinstance(part, ImagePart):
        return types_pb2.ContentPart(image=_image(part.data, part.url, part.mime_type))
    kind = part.get("type", "text")
    if kind == "text":
        return types_pb2.ContentPart(text=part["text"])
    if kind in ("image", "image_url"):
        url = part.get("url")
        if isinstance(url, Mapping):  # OpenAI style {"image_url": {"url": ...}}
            url = url.get("url")
        if url is None and isinstance(part.get("image_url"), Mapping):
            url = part["image_url"].get("url")
        return types_pb2.ContentPart(image=_image(part.get("data"), url, part.get("mime_type", "")))
    raise ValueError(f"unknown content part type {kind!r}; expected 'text' or 'image'")


def _image(data: bytes | None, url: str | None, mime_type: str) -> types_pb2.Image:
    if data is not None:
        return types_pb2.Image(data=data, mime_type=mime_type)
    if url is not None:
        return types_pb2.Image(url=url, mime_type=mime_type)
    raise ValueError("an image part needs 'data' (bytes) or 'url'")


def build_message(message: MessageLike) -> types_pb2.ChatMessage:
    """A chat message from a dict `{"role", "content"[, "name", "tool_calls", "tool_call_id",
    "reasoning"]}`, a `Message` or the proto itself."""
    if isinstance(message, types_pb2.ChatMessage):
        return message
    if not isinstance(message, Message):
        message = Message(
            role=message["role"],
            content=message.get("content") or "",
            name=message.get("name") or "",
            tool_calls=message.get("tool_calls") or (),
            tool_call_id=message.get("tool_call_id") or "",
            reasoning=_reasoning_of(message.get("reasoning")),
        )
    if message.role not in _ROLES:
        raise ValueError(f"unknown role {message.role!r}; expected one of {sorted(_ROLES)}")
    content = message.content
    if isinstance(content, str):
        # An assistant turn that only called tools has no text: no empty part for it.
        parts = [] if content == "" and message.tool_calls else [types_pb2.ContentPart(text=content)]
    else:
        parts = [_content_part(p) for p in content]
    pb = types_pb2.ChatMessage(
        role=_ROLES[message.role],
        content=parts,
        name=message.name or "",
        tool_calls=[build_tool_call(c) for c in message.tool_calls],
        tool_call_id=message.tool_call_id,
    )
    if message.reasoning is not None:
        pb.reasoning.CopyFrom(
            types_pb2.Reasoning(text=message.reasoning.text, signatures=message.reasoning.signatures)
        )
    return pb


def _reasoning_of(value: Reasoning | Mapping[str, Any] | None) -> Reasoning | None:
    if value is None or isinstance(value, Reasoning):
        return value
    return Reasoning(str(value.get("text", "")), tuple(value.get("signatures", ())))


def build_tool_call(call: ToolCall | Mapping[str, Any]) -> types_pb2.ToolCall:
    """A call an assistant message made: a ToolCall, a dict `{"id", "name", "arguments"}` or the
    OpenAI shape `{"id", "function": {"name", "arguments"}}`; arguments as JSON text or a dict."""
    if isinstance(call, ToolCall):
        return types_pb2.ToolCall(id=call.id, name=call.name, arguments_json=call.arguments_json)
    body = call.get("function", call)
    arguments = body.get("arguments", body.get("arguments_json", "{}"))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return types_pb2.ToolCall(id=call.get("id", ""), name=body["name"], arguments_json=arguments)


_EFFORTS = {
    "low": types_pb2.REASONING_EFFORT_LOW,
    "medium": types_pb2.REASONING_EFFORT_MEDIUM,
    "high": types_pb2.REASONING_EFFORT_HIGH,
}


def build_reasoning_control(control: ReasoningControl) -> types_pb2.ReasoningControl:
    pb = types_pb2.ReasoningControl()
    if control.enabled is not None:
        pb.enabled = control.enabled
    if control.effort is not None:
        if control.effort not in _EFFORTS:
            raise ValueError(f"reasoning effort must be one of {sorted(_EFFORTS)}, not {control.effort!r}")
        pb.effort = _EFFORTS[control.effort]
    if control.budget_tokens is not None:
        pb.budget_tokens = control.budget_tokens
    return pb


def _backend_value(value: str | int | float | bool) -> types_pb2.BackendOptionValue:
    if isinstance(value, bool):
        return types_pb2.BackendOptionValue(bool_value=value)
    if isinstance(value, int):
        return types_pb2.BackendOptionValue(int_value=value)
    if isinstance(value, float):
        return types_pb2.BackendOptionValue(double_value=value)
    return types_pb2.BackendOptionValue(string_value=str(value))


@dataclasses.dataclass(frozen=True)
class ResultSpec:
    """How to read a request's results: its output type's parser and its tools by name."""

    output: OutputSpec | None = None
    tools: Mapping[str, Tool] = dataclasses.field(default_factory=dict)


def build_request(request: Request) -> tuple[generation_pb2.GenerateRequest, ResultSpec]:
    """The proto request for `request`, and how to parse its results (output type, tools).

    Values go to the server as given: the server is the one judge of ranges and limits.
    """
    if sum(x is not None for x in (request.prompt, request.messages, request.magpie)) > 1:
        raise ValueError("give one of prompt, messages or magpie (not both)")
    pb = generation_pb2.GenerateRequest(model=request.model, request_id=request.request_id or "")
    if request.prompt is not None:
        pb.prompt = request.prompt
    elif request.messages is not None:
        pb.messages.messages.extend(build_message(m) for m in request.messages)
    elif request.magpie is not None:
        pb.magpie.CopyFrom(build_magpie(request.magpie))
    for name in _SAMPLING_FIELDS:
        value = getattr(request, name)
        if value is not None:
            setattr(pb.sampling, name, value)
    if request.max_tokens is not None:
        pb.stopping.max_tokens = request.max_tokens
    if request.stop:
        pb.stopping.stop.extend([request.stop] if isinstance(request.stop, str) else request.stop)
    if request.n is not None:
        pb.n = request.n
    if request.logprobs is not None:
        pb.logprobs = request.logprobs
    for key, value in (request.backend_options or {}).items():
        pb.backend_options[key].CopyFrom(_backend_value(value))
    spec = resolve_output_type(request.output_type)
    if spec is not None and spec.structured is not None:
        pb.structured_output.CopyFrom(spec.structured)
    tools = resolve_tools(request.tools)
    pb.tools.extend(build_tool(t) for t in tools)
    if request.tool_choice is not None:
        pb.tool_choice.CopyFrom(build_tool_choice(request.tool_choice))
    if request.parallel_tool_calls is not None:
        pb.parallel_tool_calls = request.parallel_tool_calls
    if request.reasoning is not None:
        pb.reasoning.CopyFrom(build_reasoning_control(request.reasoning))
    if request.chat_template_kwargs is not None:
        pb.chat_template_kwargs_json = json.dumps(dict(request.chat_template_kwargs))
    return pb, ResultSpec(spec, {t.name: t for t in tools})


def build_magpie(magpie: Magpie) -> types_pb2.Magpie:
    """The proto Magpie input: a preset name becomes the preset, any other text is the template."""
    pb = types_pb2.Magpie(
        conversation=[build_message(m) for m in magpie.conversation],
        only_instruction=magpie.only_instruction,
        end_with_user=magpie.end_with_user,
    )
    if magpie.template in MAGPIE_PRESETS:
        pb.preset = types_pb2.MagpiePreset.Value(f"MAGPIE_PRESET_{magpie.template.upper()}")
    else:
        pb.template = magpie.template
    if magpie.system_prompt is not None:
        pb.system_prompt = magpie.system_prompt
    if magpie.n_turns is not None:
        pb.n_turns = magpie.n_turns
    return pb


def _enum_name(value: int, enum_type: Any, prefix: str) -> str:
    try:
        return str(enum_type.Name(value)).removeprefix(prefix)
    except ValueError:
        return "UNSPECIFIED"


def _typed(enum_type: Any, prefix: str, typed: Any) -> dict[int, Any]:
    """Wire value -> typed value, made once instead of looked up by name each response; a value
    the typed enum lacks is left out (read as UNSPECIFIED, as an unknown wire value is)."""
    names = {v: _enum_name(v, enum_type, prefix) for v in enum_type.values()}
    return {int(v): typed(name) for v, name in names.items() if name in typed.__members__}


_FINISH_REASONS: dict[int, FinishReason] = _typed(types_pb2.FinishReason, "FINISH_REASON_", FinishReason)
_ENFORCEMENTS: dict[int, Enforcement] = _typed(types_pb2.Enforcement, "ENFORCEMENT_", Enforcement)


def finish_reason(value: int) -> FinishReason:
    return _FINISH_REASONS.get(value, FinishReason.UNSPECIFIED)


def enforcement(value: int) -> Enforcement:
    return _ENFORCEMENTS.get(value, Enforcement.UNSPECIFIED)


def _seconds(duration: duration_pb2.Duration, present: bool) -> float | None:
    """Duration.ToTimedelta().total_seconds(), whole microseconds, without building a timedelta."""
    if not present:
        return None
    micros = duration.seconds * 1_000_000 + int(duration.nanos / 1000)
    return micros / 1_000_000


def timings(pb: types_pb2.Timings) -> Timings:
    return Timings(
        queue=_seconds(pb.queue, pb.HasField("queue")),
        time_to_first_token=_seconds(pb.time_to_first_token, pb.HasField("time_to_first_token")),
        total=_seconds(pb.total, pb.HasField("total")),
    )


def usage(pb: types_pb2.Usage) -> Usage:
    return Usage(
        input_tokens=pb.input_tokens,
        output_tokens=pb.output_tokens,
        cached_input_tokens=pb.cached_input_tokens,
    )


def _optional_id(pb: Any) -> int | None:
    return int(pb.token_id) if pb.HasField("token_id") else None


def logprobs(pb: types_pb2.Logprobs) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            token=t.token,
            logprob=t.logprob,
            token_id=_optional_id(t),
            top=tuple(TopLogprob(a.token, a.logprob, _optional_id(a)) for a in t.top),
        )
        for t in pb.tokens
    )


def tool_calls(calls: Sequence[types_pb2.ToolCall], tools: Mapping[str, Tool]) -> tuple[ToolCall, ...]:
    """Typed calls, each linked to the offered tool of its name (to parse its arguments)."""
    return tuple(ToolCall(c.id, c.name, c.arguments_json, tools.get(c.name)) for c in calls)


def _generation(pb: types_pb2.Generation, spec: OutputSpec | None, tools: Mapping[str, Tool]) -> Generation:
    reason = finish_reason(pb.finish_reason)
    parsed = None
    if spec is not None:
        if reason == FinishReason.LENGTH:
            raise TruncatedOutputError(
                f"generation {pb.index} was cut at max_tokens ({pb.output_tokens} tokens) before the "
                "structured output was complete; raise max_tokens",
                text=pb.text,
            )
        parsed = spec.parse(pb.text)
    return Generation(
        index=pb.index,
        text=pb.text,
        finish_reason=reason,
        matched_stop=pb.matched_stop if pb.HasField("matched_stop") else None,
        output_tokens=pb.output_tokens,
        logprobs=logprobs(pb.logprobs) if pb.HasField("logprobs") else None,
        parsed=parsed,
        conversation=tuple(
            Turn(_ROLE_NAMES.get(t.role, "user"), t.text, t.output_tokens) for t in pb.conversation
        ),
        tool_calls=tool_calls(pb.tool_calls, tools),
        reasoning=(
            Reasoning(pb.reasoning.text, tuple(pb.reasoning.signatures)) if pb.HasField("reasoning") else None
        ),
    )


def _result_spec(spec: ResultSpec | OutputSpec | None) -> ResultSpec:
    return spec if isinstance(spec, ResultSpec) else ResultSpec(spec)


def response(pb: generation_pb2.GenerateResponse, spec: ResultSpec | OutputSpec | None) -> Response:
    """A typed Response; with an output type every generation is parsed, or an OutputError raised."""
    result = _result_spec(spec)

    def made(generations: tuple[Generation, ...]) -> Response:
        return Response(
            request_id=pb.request_id,
            model=pb.model,
            generations=generations,
            usage=usage(pb.usage),
            enforcement=enforcement(pb.enforcement),
            timings=timings(pb.timings),
            raw=pb,
        )

    try:
        generations = tuple(_generation(g, result.output, result.tools) for g in pb.generations)
    except OutputError as exc:
        exc.response = made(tuple(_generation(g, None, result.tools) for g in pb.generations))
        raise
    return made(generations)


def stream_frame(
    pb: generation_pb2.GenerateStreamResponse, tools: Mapping[str, Tool] | None = None
) -> StreamFrame:
    """A typed stream frame; end frames' tool calls are linked to `tools` (the request's, by name)."""
    kind = pb.WhichOneof("frame")
    if kind == "start":
        s = pb.start
        seed = s.effective_sampling.seed if s.effective_sampling.HasField("seed") else None
        return StreamStart(s.request_id, s.model, s.input_tokens, enforcement(s.enforcement), seed, s)
    if kind == "delta":
        d = pb.delta
        lp = logprobs(d.logprobs) if d.HasField("logprobs") else None
        fragments = tuple(ToolCallDelta(t.index, t.id, t.name, t.arguments_fragment) for t in d.tool_calls)
        return StreamDelta(
            d.index, d.text, d.token_count, lp, raw=d, tool_calls=fragments, reasoning=d.reasoning
        )
    if kind == "end":
        e = pb.end
        matched = e.matched_stop if e.HasField("matched_stop") else None
        return StreamEnd(
            e.index,
            finish_reason(e.finish_reason),
            matched,
            usage(e.usage),
            timings(e.timings),
            raw=e,
            tool_calls=tool_calls(e.tool_calls, tools or {}),
            reasoning_signatures=tuple(e.reasoning_signatures),
        )
    raise ValueError(f"stream frame without a known kind: {kind!r}")


def batch_item(
    pb: generation_pb2.BatchGenerateResponse, specs: Sequence[ResultSpec | OutputSpec | None]
) -> ItemResult:
    """One batch outcome; a parse failure of a structured result becomes that item's error."""
    if pb.WhichOneof("result") == "error":
        return ItemResult(index=pb.index, error=error_from_status(pb.error))
    spec = specs[pb.index] if pb.index < len(specs) else None
    try:
        return ItemResult(index=pb.index, response=response(pb.response, spec))
    except OutputError as exc:
        return ItemResult(index=pb.index, error=exc)


def build_batch(
    requests: Sequence[Request | Mapping[str, Any]],
) -> tuple[generation_pb2.BatchGenerateRequest, list[ResultSpec]]:
    built = [build_request(as_request(r)) for r in requests]
    return generation_pb2.BatchGenerateRequest(requests=[b[0] for b in built]), [b[1] for b in built]


def model_info(pb: types_pb2.ModelInfo) -> ModelInfo:
    c = pb.capabilities
    caps = ModelCapabilities(
        constraints=tuple(
            ConstraintSupport(
                ConstraintKind(_enum_name(s.kind, types_pb2.ConstraintKind, "CONSTRAINT_KIND_")),
                enforcement(s.enforcement),
            )
            for s in c.constraints
        ),
        grammar_syntaxes=tuple(
            GrammarSyntax(_enum_name(g, types_pb2.GrammarSyntax, "GRAMMAR_SYNTAX_"))
            for g in c.grammar_syntaxes
        ),
        max_n=c.max_n,
        logprobs=c.logprobs,
        max_top_logprobs=c.max_top_logprobs,
        input_modalities=tuple(
            Modality(_enum_name(m, types_pb2.Modality, "MODALITY_")) for m in c.input_modalities
        ),
        context_length=c.context_length,
        seed=c.seed,
        chat=c.chat,
        backend_options=tuple(c.backend_options),
        magpie=c.magpie,
        tools=enforcement(c.tools) if c.tools != types_pb2.ENFORCEMENT_UNSPECIFIED else None,
        reasoning_control=c.reasoning_control,
        reasoning=c.reasoning,
    )
    return ModelInfo(name=pb.name, backend=pb.backend, capabilities=caps, raw=pb)
