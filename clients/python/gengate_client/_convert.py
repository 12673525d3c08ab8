"""Everything the sync and async clients share: request building and response conversion.

The two clients differ only at their call sites; all proto handling lives here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from gengate_proto.v1 import generation_pb2, types_pb2
from google.protobuf import duration_pb2

from gengate_client.errors import OutputError, TruncatedOutputError, error_from_status
from gengate_client.output_types import OutputSpec, resolve_output_type
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
    """A chat message from a dict `{"role", "content"[, "name"]}`, a `Message` or the proto itself."""
    if isinstance(message, types_pb2.ChatMessage):
        return message
    if isinstance(message, Message):
        role, content, name = message.role, message.content, message.name
    else:
        role, content, name = message["role"], message["content"], message.get("name", "")
    if role not in _ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {sorted(_ROLES)}")
    parts = (
        [types_pb2.ContentPart(text=content)]
        if isinstance(content, str)
        else [_content_part(p) for p in content]
    )
    return types_pb2.ChatMessage(role=_ROLES[role], content=parts, name=name or "")


def _backend_value(value: str | int | float | bool) -> types_pb2.BackendOptionValue:
    if isinstance(value, bool):
        return types_pb2.BackendOptionValue(bool_value=value)
    if isinstance(value, int):
        return types_pb2.BackendOptionValue(int_value=value)
    if isinstance(value, float):
        return types_pb2.BackendOptionValue(double_value=value)
    return types_pb2.BackendOptionValue(string_value=str(value))


def build_request(request: Request) -> tuple[generation_pb2.GenerateRequest, OutputSpec | None]:
    """The proto request for `request`, and the resolved output type used to parse the result.

    Values go to the server as given: the server is the one judge of ranges and limits.
    """
    if sum(x is not None for x in (request.prompt, request.messages, request.magpie)) > 1:
        raise ValueError("give one of prompt, messages or magpie")
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
    return pb, spec


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


def finish_reason(value: int) -> FinishReason:
    return FinishReason(_enum_name(value, types_pb2.FinishReason, "FINISH_REASON_"))


def enforcement(value: int) -> Enforcement:
    return Enforcement(_enum_name(value, types_pb2.Enforcement, "ENFORCEMENT_"))


def _seconds(duration: duration_pb2.Duration, present: bool) -> float | None:
    return duration.ToTimedelta().total_seconds() if present else None


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


def _generation(pb: types_pb2.Generation, spec: OutputSpec | None) -> Generation:
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
    )


def response(pb: generation_pb2.GenerateResponse, spec: OutputSpec | None) -> Response:
    """A typed Response; with an output type every generation is parsed, or an OutputError raised."""
    base = Response(
        request_id=pb.request_id,
        model=pb.model,
        generations=(),
        usage=usage(pb.usage),
        enforcement=enforcement(pb.enforcement),
        timings=timings(pb.timings),
        raw=pb,
    )
    try:
        generations = tuple(_generation(g, spec) for g in pb.generations)
    except OutputError as exc:
        plain = tuple(_generation(g, None) for g in pb.generations)
        exc.response = dataclasses.replace(base, generations=plain)
        raise
    return dataclasses.replace(base, generations=generations)


def stream_frame(pb: generation_pb2.GenerateStreamResponse) -> StreamFrame:
    """A typed stream frame."""
    kind = pb.WhichOneof("frame")
    if kind == "start":
        s = pb.start
        seed = s.effective_sampling.seed if s.effective_sampling.HasField("seed") else None
        return StreamStart(s.request_id, s.model, s.input_tokens, enforcement(s.enforcement), seed, s)
    if kind == "delta":
        d = pb.delta
        lp = logprobs(d.logprobs) if d.HasField("logprobs") else None
        return StreamDelta(d.index, d.text, d.token_count, lp, raw=d)
    if kind == "end":
        e = pb.end
        matched = e.matched_stop if e.HasField("matched_stop") else None
        return StreamEnd(
            e.index, finish_reason(e.finish_reason), matched, usage(e.usage), timings(e.timings), raw=e
        )
    raise ValueError(f"stream frame without a known kind: {kind!r}")


def batch_item(pb: generation_pb2.BatchGenerateResponse, specs: Sequence[OutputSpec | None]) -> ItemResult:
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
) -> tuple[generation_pb2.BatchGenerateRequest, list[OutputSpec | None]]:
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
    )
    return ModelInfo(name=pb.name, backend=pb.backend, capabilities=caps, raw=pb)
