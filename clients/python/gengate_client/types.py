"""Typed values the client hands out and accepts: messages, results, stream frames, model info.

Plain frozen dataclasses over the protobuf messages; each result keeps its proto in `.raw` for
anything not surfaced here.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic
from gengate_proto.v1 import generation_pb2, types_pb2

from gengate_client.errors import OutputValidationError


class FinishReason(enum.StrEnum):
    """Why a generation ended; the same for every backend."""

    UNSPECIFIED = "UNSPECIFIED"
    STOP = "STOP"
    LENGTH = "LENGTH"
    STOP_SEQUENCE = "STOP_SEQUENCE"
    CONTENT_FILTER = "CONTENT_FILTER"
    CANCELLED = "CANCELLED"
    TIME_LIMIT = "TIME_LIMIT"
    ERROR = "ERROR"
    REFUSAL = "REFUSAL"
    TOOL_CALLS = "TOOL_CALLS"


class Enforcement(enum.StrEnum):
    """How a structured-output constraint was enforced (or can be, in ModelInfo)."""

    UNSPECIFIED = "UNSPECIFIED"
    NONE = "NONE"
    ENGINE = "ENGINE"
    NATIVE = "NATIVE"
    VALIDATED = "VALIDATED"


class ConstraintKind(enum.StrEnum):
    """A kind of structured output a model may serve."""

    UNSPECIFIED = "UNSPECIFIED"
    JSON_SCHEMA = "JSON_SCHEMA"
    REGEX = "REGEX"
    CHOICE = "CHOICE"
    GRAMMAR = "GRAMMAR"
    JSON_OBJECT = "JSON_OBJECT"


class GrammarSyntax(enum.StrEnum):
    """Notation of a grammar definition."""

    UNSPECIFIED = "UNSPECIFIED"
    LARK = "LARK"
    GBNF = "GBNF"
    EBNF = "EBNF"


class Modality(enum.StrEnum):
    """An input type a model accepts."""

    UNSPECIFIED = "UNSPECIFIED"
    TEXT = "TEXT"
    IMAGE = "IMAGE"


RoleName = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class TextPart:
    """Text content of a chat message."""

    text: str


@dataclass(frozen=True)
class ImagePart:
    """Image content of a chat message: inline bytes (with their MIME type) or a URL."""

    data: bytes | None = None
    url: str | None = None
    mime_type: str = ""


ContentPart = TextPart | ImagePart


@dataclass(frozen=True)
class Tool:
    """A function the model may call: `parameters` is its arguments' JSON Schema (None: none).

    Made by hand, or by `gengate_client.tools.tool()` from a pydantic model or a typed function,
    which also sets `arguments_type` (the pydantic model a call's arguments are parsed into) and
    `function` (what `ToolCall.invoke()` calls).
    """

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = None
    strict: bool = False
    arguments_type: type[pydantic.BaseModel] | None = field(default=None, repr=False, compare=False)
    function: Callable[..., Any] | None = field(default=None, repr=False, compare=False)


# What `tools=` takes: a Tool, a pydantic model class or a typed function (gengate_client.tools).
ToolLike = Tool | type[pydantic.BaseModel] | Callable[..., Any]


@dataclass(frozen=True)
class ToolCall:
    """One call the model made; the server has validated `arguments_json` against the tool's schema.

    `tool` is the offered Tool of that name (None when unknown, e.g. a call given back in a message).
    """

    id: str
    name: str
    arguments_json: str
    tool: Tool | None = field(default=None, repr=False, compare=False)

    def arguments(self) -> Any:
        """The arguments parsed: an instance of a pydantic-model tool, the keyword arguments (a dict,
        validated by the signature) of a function tool, the JSON object of any other tool.

        Raises OutputValidationError when they do not parse (the server checked the JSON Schema;
        pydantic may check more, such as custom validators).
        """
        model = self.tool.arguments_type if self.tool is not None else None
        try:
            if model is None:
                return json.loads(self.arguments_json or "{}")
            parsed = model.model_validate_json(self.arguments_json or "{}")
        except (ValueError, pydantic.ValidationError) as exc:
            raise OutputValidationError(
                f"arguments of tool call {self.id!r} ({self.name}) do not parse: {exc}",
                text=self.arguments_json,
            ) from exc
        if self.tool is not None and self.tool.function is not None:
            return {name: getattr(parsed, name) for name in type(parsed).model_fields}
        return parsed

    def invoke(self) -> Any:
        """Calls the tool's function with the parsed arguments (a coroutine for an async function)."""
        function = self.tool.function if self.tool is not None else None
        if function is None:
            raise TypeError(f"tool {self.name!r} has no Python function to invoke (give one as the tool)")
        arguments = self.arguments()
        return function(**arguments) if isinstance(arguments, dict) else function(arguments)


@dataclass(frozen=True)
class ToolCallDelta:
    """A fragment of tool call `index` of a generation, in a stream (id and name on its first)."""

    index: int
    id: str
    name: str
    arguments_fragment: str


@dataclass(frozen=True)
class Reasoning:
    """A reasoning model's thinking; `signatures` are provider-opaque, to be sent back unchanged."""

    text: str = ""
    signatures: tuple[str, ...] = ()


ReasoningEffortName = Literal["low", "medium", "high"]


@dataclass(frozen=True)
class ReasoningControl:
    """A reasoning model's thinking control (`reasoning=`); None fields are left to the model."""

    enabled: bool | None = None
    effort: ReasoningEffortName | None = None
    budget_tokens: int | None = None


@dataclass(frozen=True)
class Message:
    """One chat turn; `content` is plain text or a list of parts.

    An assistant turn may carry the `tool_calls` it made (and its `reasoning`, signatures included,
    which Anthropic-style providers need back); a "tool" turn answers the call `tool_call_id`.
    """

    role: RoleName
    content: str | Sequence[ContentPart | Mapping[str, Any]] = ""
    name: str = ""
    tool_calls: Sequence[ToolCall | Mapping[str, Any]] = ()
    tool_call_id: str = ""
    reasoning: Reasoning | None = None


MessageLike = Message | Mapping[str, Any] | types_pb2.ChatMessage

MAGPIE_PRESETS = ("llama3", "qwen2", "phi3", "gemma")


@dataclass(frozen=True)
class Magpie:
    """Ask the model to write the user turns itself (Magpie): `template` is a preset name
    (llama3, qwen2, phi3, gemma: that chat format's pre-query text) or a custom pre-query text sent
    as given. `conversation`: turns so far (user/assistant) the next user turn follows."""

    template: str
    system_prompt: str | None = None
    conversation: Sequence[MessageLike] = ()
    n_turns: int | None = None
    only_instruction: bool = False
    end_with_user: bool = False


@dataclass(frozen=True)
class Turn:
    """One turn of a Magpie conversation; output_tokens: generated for it (0 for given turns)."""

    role: RoleName
    text: str
    output_tokens: int = 0


@dataclass(frozen=True)
class Request:
    """One generation request, as `generate()` takes it: used as a `batch_generate()` item."""

    model: str
    prompt: str | None = None
    messages: Sequence[MessageLike] | None = None
    magpie: Magpie | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: Sequence[str] | None = None
    n: int | None = None
    logprobs: int | None = None
    output_type: Any = None
    backend_options: Mapping[str, str | int | float | bool] | None = None
    request_id: str | None = None
    tools: Sequence[ToolLike] | None = None
    # "auto" | "none" | "required" | a tool's name | the Tool, model class or function itself.
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningControl | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Usage:
    """Token counts; cached_input_tokens: of input_tokens, those served from a prompt cache."""

    input_tokens: int
    output_tokens: int
    cached_input_tokens: int = 0


@dataclass(frozen=True)
class Timings:
    """Server-measured durations in seconds; None where the server did not report one."""

    queue: float | None
    time_to_first_token: float | None
    total: float | None


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    token_id: int | None


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its most likely alternatives."""

    token: str
    logprob: float
    token_id: int | None
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True)
class Generation:
    """One finished generation; `parsed` holds the typed value when an output_type was given."""

    index: int
    text: str
    finish_reason: FinishReason
    matched_stop: str | None
    output_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None
    parsed: Any = None
    # A Magpie request's turns, oldest first (the given conversation, then the written turns).
    conversation: tuple[Turn, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()  # finish_reason TOOL_CALLS
    reasoning: Reasoning | None = None  # when the backend returns it


@dataclass(frozen=True)
class Response:
    """The result of `generate()`: every generation plus usage, enforcement and echoed params."""

    request_id: str
    model: str
    generations: tuple[Generation, ...]
    usage: Usage
    enforcement: Enforcement
    timings: Timings
    raw: generation_pb2.GenerateResponse = field(repr=False)

    @property
    def text(self) -> str:
        """Text of the first generation."""
        return self.generations[0].text if self.generations else ""

    @property
    def texts(self) -> list[str]:
        return [g.text for g in self.generations]

    @property
    def parsed(self) -> Any:
        """The first generation parsed into the requested output type (None without one)."""
        return self.generations[0].parsed if self.generations else None

    @property
    def parsed_all(self) -> list[Any]:
        return [g.parsed for g in self.generations]

    @property
    def finish_reason(self) -> FinishReason:
        return self.generations[0].finish_reason if self.generations else FinishReason.UNSPECIFIED

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The tool calls of the first generation."""
        return self.generations[0].tool_calls if self.generations else ()

    @property
    def seed(self) -> int | None:
        """The seed the backend used (drawn by the server when the request gave none)."""
        sampling = self.raw.effective_sampling
        return sampling.seed if sampling.HasField("seed") else None

    @property
    def effective_sampling(self) -> types_pb2.SamplingParams:
        return self.raw.effective_sampling


@dataclass(frozen=True)
class StreamStart:
    """First frame of a stream."""

    request_id: str
    model: str
    input_tokens: int
    enforcement: Enforcement
    seed: int | None
    raw: types_pb2.StreamStart = field(repr=False)


@dataclass(frozen=True)
class StreamDelta:
    """New text of generation `index`, with fragments of its tool calls and reasoning."""

    index: int
    text: str
    token_count: int
    logprobs: tuple[TokenLogprob, ...] | None = None
    raw: types_pb2.GenerationDelta | None = field(default=None, repr=False, compare=False)
    tool_calls: tuple[ToolCallDelta, ...] = ()
    reasoning: str = ""


@dataclass(frozen=True)
class StreamEnd:
    """Last frame of generation `index`: the complete, validated tool calls come here."""

    index: int
    finish_reason: FinishReason
    matched_stop: str | None
    usage: Usage
    timings: Timings
    raw: types_pb2.GenerationEnd | None = field(default=None, repr=False, compare=False)
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning_signatures: tuple[str, ...] = ()


StreamFrame = StreamStart | StreamDelta | StreamEnd


class StreamAccumulator:
    """Collects stream frames into per-generation texts: `acc.add(frame)` for each, then `acc.texts`."""

    def __init__(self) -> None:
        self.start: StreamStart | None = None
        self.parts: dict[int, list[str]] = {}
        self.reasoning_parts: dict[int, list[str]] = {}
        self.ends: dict[int, StreamEnd] = {}

    def add(self, frame: StreamFrame) -> StreamFrame:
        """Records a frame and returns it, so it can wrap a loop: `for f in stream: acc.add(f)`."""
        if isinstance(frame, StreamStart):
            self.start = frame
        elif isinstance(frame, StreamDelta):
            self.parts.setdefault(frame.index, []).append(frame.text)
            if frame.reasoning:
                self.reasoning_parts.setdefault(frame.index, []).append(frame.reasoning)
        else:
            self.parts.setdefault(frame.index, [])
            self.ends[frame.index] = frame
        return frame

    @property
    def texts(self) -> list[str]:
        """Texts ordered by generation index."""
        return ["".join(self.parts[i]) for i in sorted(self.parts)]

    @property
    def text(self) -> str:
        return "".join(self.parts.get(0, []))

    @property
    def finish_reasons(self) -> dict[int, FinishReason]:
        return {i: end.finish_reason for i, end in self.ends.items()}

    @property
    def output_tokens(self) -> int:
        return sum(end.usage.output_tokens for end in self.ends.values())

    @property
    def tool_calls(self) -> dict[int, tuple[ToolCall, ...]]:
        """Each ended generation's complete tool calls (from its end frame), by index."""
        return {i: end.tool_calls for i, end in self.ends.items()}

    @property
    def reasoning(self) -> dict[int, Reasoning]:
        """Each generation's reasoning (text from the deltas, signatures from the end frame)."""
        signed = {i for i, end in self.ends.items() if end.reasoning_signatures}
        indexes = sorted(set(self.reasoning_parts) | signed)
        return {
            i: Reasoning(
                "".join(self.reasoning_parts.get(i, [])),
                self.ends[i].reasoning_signatures if i in self.ends else (),
            )
            for i in indexes
        }


@dataclass(frozen=True)
class ItemResult:
    """Outcome of one batch item: exactly one of `response` and `error` is set."""

    index: int
    response: Response | None = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> Response:
        """The response, or raises the item's error."""
        if self.error is not None:
            raise self.error
        assert self.response is not None
        return self.response


@dataclass(frozen=True)
class ConstraintSupport:
    kind: ConstraintKind
    enforcement: Enforcement


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model can do, as the server declares it."""

    constraints: tuple[ConstraintSupport, ...]
    grammar_syntaxes: tuple[GrammarSyntax, ...]
    max_n: int
    logprobs: bool
    max_top_logprobs: int
    input_modalities: tuple[Modality, ...]
    context_length: int
    seed: bool
    chat: bool
    backend_options: tuple[str, ...] = ()  # keys accepted in `backend_options=`
    magpie: bool = False  # takes `magpie=` (a model that takes raw prompts)
    tools: Enforcement | None = None  # how tool calls are enforced; None: `tools=` is refused
    reasoning_control: bool = False  # takes `reasoning=`
    reasoning: bool = False  # returns Generation.reasoning

    def enforcement_of(self, kind: ConstraintKind) -> Enforcement | None:
        """How `kind` is enforced, or None when the model does not serve it."""
        return next((c.enforcement for c in self.constraints if c.kind == kind), None)


@dataclass(frozen=True)
class ModelInfo:
    """One served model."""

    name: str
    backend: str
    capabilities: ModelCapabilities
    raw: types_pb2.ModelInfo = field(repr=False)
