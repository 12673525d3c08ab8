"""Domain objects of gengate: what every layer below the api speaks. No protobuf here.

The api layer converts protobuf to these (api/convert.py) and back; backends, the router and
the constraint engine only ever see these types.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeAlias, TypeVar

_D = TypeVar("_D")


def evolve(obj: _D, **changes: Any) -> _D:
    """`dataclasses.replace` for the per-request path: the same copy with fields changed, at a
    fifth of the cost (no field introspection). Domain objects have no __post_init__ to rerun."""
    assert changes.keys() <= obj.__dataclass_fields__.keys(), f"not fields: {set(changes)}"  # type: ignore[attr-defined]
    new = object.__new__(type(obj))
    state = new.__dict__
    state.update(obj.__dict__)
    state.update(changes)
    return new


class Role(enum.StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    """Image input: inline bytes (with mime_type) or a URL."""

    data: bytes | None = None
    url: str | None = None
    mime_type: str = ""


ContentPart: TypeAlias = TextPart | ImagePart


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is its arguments' JSON Schema (an object)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    strict: bool = False


class ToolChoiceMode(enum.StrEnum):
    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"


@dataclass(frozen=True)
class ToolChoice:
    """Whether a tool must be called: a mode, or exactly the tool `name`."""

    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """One call a model made; `arguments` is JSON text (validated before it is returned)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A fragment of tool call `index` of a generation in a stream (id and name on the first)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class Reasoning:
    """A reasoning model's thinking; `signatures` are provider-opaque, sent back unchanged."""

    text: str = ""
    signatures: tuple[str, ...] = ()


class ReasoningEffort(enum.StrEnum):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


@dataclass(frozen=True)
class ReasoningControl:
    enabled: bool | None = None
    effort: ReasoningEffort | None = None
    budget_tokens: int | None = None


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: tuple[ContentPart, ...]
    name: str = ""
    # An assistant message's calls; a tool message's call id; an assistant message's reasoning.
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    reasoning: Reasoning | None = None

    @property
    def text(self) -> str:
        """The message's text parts joined; images are left out."""
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    @property
    def has_images(self) -> bool:
        return any(isinstance(p, ImagePart) for p in self.content)


class MagpiePreset(enum.StrEnum):
    """A chat format whose pre-query text gengate knows (gengate.magpie.PRESETS)."""

    LLAMA3 = "llama3"
    QWEN2 = "qwen2"
    PHI3 = "phi3"
    GEMMA = "gemma"


@dataclass(frozen=True)
class MagpieInput:
    """Magpie: the model writes the user turns itself, from the pre-query text of its chat format
    (a preset's, or `template` verbatim), after an optional system prompt and the turns so far."""

    preset: MagpiePreset | None = None
    template: str | None = None
    system_prompt: str | None = None
    conversation: tuple[ChatMessage, ...] = ()
    n_turns: int = 1
    only_instruction: bool = False
    end_with_user: bool = False


@dataclass(frozen=True)
class ConversationTurn:
    """One turn of a Magpie conversation, with the tokens generated for it (0 for given turns)."""

    role: Role
    text: str
    output_tokens: int = 0


def with_system_text(messages: tuple[ChatMessage, ...], text: str) -> tuple[ChatMessage, ...]:
    """`text` added to the first system message (after a blank line), or a system message put
    first: how instructions reach a model that only takes chat messages."""
    if messages and messages[0].role is Role.SYSTEM:
        first = messages[0]
        merged = ChatMessage(Role.SYSTEM, (*first.content, TextPart("\n\n" + text)), first.name)
        return (merged, *messages[1:])
    return (ChatMessage(Role.SYSTEM, (TextPart(text),)), *messages)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling fields; None means "not set" (the backend's default applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None


# The sampling fields by name, in the contract's order (conversions and engine mappings walk them).
SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))


@dataclass(frozen=True)
class StoppingCriteria:
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()


class GrammarSyntax(enum.StrEnum):
    LARK = "lark"
    GBNF = "gbnf"
    EBNF = "ebnf"


class ConstraintKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    JSON_OBJECT = "json_object"


@dataclass(frozen=True)
class JsonSchemaConstraint:
    schema: dict[str, Any]
    name: str = ""
    strict: bool = False
    kind: ConstraintKind = field(default=ConstraintKind.JSON_SCHEMA, init=False)


@dataclass(frozen=True)
class RegexConstraint:
    pattern: str
    kind: ConstraintKind = field(default=ConstraintKind.REGEX, init=False)


@dataclass(frozen=True)
class ChoiceConstraint:
    choices: tuple[str, ...]
    kind: ConstraintKind = field(default=ConstraintKind.CHOICE, init=False)


@dataclass(frozen=True)
class GrammarConstraint:
    syntax: GrammarSyntax
    definition: str
    kind: ConstraintKind = field(default=ConstraintKind.GRAMMAR, init=False)


@dataclass(frozen=True)
class JsonObjectConstraint:
    kind: ConstraintKind = field(default=ConstraintKind.JSON_OBJECT, init=False)


Constraint: TypeAlias = (
    JsonSchemaConstraint | RegexConstraint | ChoiceConstraint | GrammarConstraint | JsonObjectConstraint
)


class Whitespace(enum.StrEnum):
    COMPACT = "compact"
    FLEXIBLE = "flexible"


@dataclass(frozen=True)
class StructuredOutput:
    """The shape the output must have, plus compile options."""

    constraint: Constraint
    whitespace: Whitespace | None = None
    additional_properties: bool | None = None


class Enforcement(enum.StrEnum):
    NONE = "none"
    ENGINE = "engine"
    NATIVE = "native"
    VALIDATED = "validated"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    STOP_SEQUENCE = "stop_sequence"
    CONTENT_FILTER = "content_filter"
    CANCELLED = "cancelled"
    TIME_LIMIT = "time_limit"
    ERROR = "error"
    REFUSAL = "refusal"
    TOOL_CALLS = "tool_calls"


class Modality(enum.StrEnum):
    TEXT = "text"
    IMAGE = "image"


BackendOptionValue: TypeAlias = str | int | float | bool


@dataclass(frozen=True)
class GenerationRequest:
    """One request for n generations from one model. Exactly one of prompt / messages / magpie
    is set (the service turns a Magpie request into prompt and messages requests)."""

    model: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    magpie: MagpieInput | None = None
    # With messages: the text the model continues from, after the messages rendered by its chat
    # template WITHOUT the generation prompt (Magpie's pre-query after a conversation). Only for
    # models with `raw_prompt`.
    continuation: str | None = None
    sampling: SamplingParams = SamplingParams()
    stopping: StoppingCriteria = StoppingCriteria()
    n: int = 1
    logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    backend_options: dict[str, BackendOptionValue] = field(default_factory=dict)
    request_id: str = ""
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None  # None: auto when tools are given
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningControl | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Absolute time.monotonic() by which the caller needs the answer (from the gRPC deadline).
    deadline: float | None = None
    # The request's size as received (serialized bytes; 0 when unknown): a large one is checked
    # off the event loop.
    wire_bytes: int = field(default=0, compare=False)

    def as_messages(self) -> tuple[ChatMessage, ...]:
        """The request as a chat: a bare prompt becomes one user message."""
        if self.messages is not None:
            return self.messages
        return (ChatMessage(Role.USER, (TextPart(self.prompt or ""),)),)

    def time_left(self) -> float | None:
        """Seconds until the caller's deadline, or None when there is none."""
        if self.deadline is None:
            return None
        import time

        return self.deadline - time.monotonic()


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    token_id: int | None = None


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    token_id: int | None = None
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0  # of input_tokens, served from a prompt (prefix) cache

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cached_input_tokens + other.cached_input_tokens,
        )


@dataclass(frozen=True)
class Timings:
    """Seconds since the request arrived; None where not measured."""

    queue_s: float | None = None
    time_to_first_token_s: float | None = None
    total_s: float | None = None

    def later(self, seconds: float, *, queued: bool = False) -> Timings:
        """These timings seen from `seconds` earlier (a queue, or work that came first): the
        first token and the end come that much later; `queued` counts the seconds as queue_s."""
        ttft, total = self.time_to_first_token_s, self.total_s
        return Timings(
            queue_s=(self.queue_s or 0.0) + seconds if queued else self.queue_s,
            time_to_first_token_s=None if ttft is None else ttft + seconds,
            total_s=None if total is None else total + seconds,
        )


@dataclass(frozen=True)
class Generation:
    index: int
    text: str
    finish_reason: FinishReason
    output_tokens: int = 0
    matched_stop: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    # A Magpie request's turns, oldest first (empty otherwise).
    conversation: tuple[ConversationTurn, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: Reasoning | None = None


@dataclass(frozen=True)
class GenerationResult:
    """Every generation of one request, as the api returns it."""

    request_id: str
    model: str
    generations: tuple[Generation, ...]
    usage: Usage
    enforcement: Enforcement = Enforcement.NONE
    effective_sampling: SamplingParams = SamplingParams()
    effective_stopping: StoppingCriteria = StoppingCriteria()
    timings: Timings = Timings()


@dataclass(frozen=True)
class StreamStart:
    """First event of every stream."""

    request_id: str
    model: str
    input_tokens: int
    enforcement: Enforcement = Enforcement.NONE
    effective_sampling: SamplingParams = SamplingParams()
    effective_stopping: StoppingCriteria = StoppingCriteria()


@dataclass(frozen=True)
class GenerationDelta:
    """New text of generation `index`."""

    index: int
    text: str
    token_count: int = 1
    logprobs: tuple[TokenLogprob, ...] | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    reasoning: str = ""


def merge_deltas(deltas: Sequence[GenerationDelta]) -> GenerationDelta:
    """One delta carrying what several consecutive deltas of one generation carry: their text,
    token counts, logprobs, tool-call fragments and reasoning, in order."""
    if len(deltas) == 1:
        return deltas[0]
    with_logprobs = any(d.logprobs is not None for d in deltas)
    return GenerationDelta(
        index=deltas[0].index,
        text="".join(d.text for d in deltas),
        token_count=sum(d.token_count for d in deltas),
        logprobs=tuple(lp for d in deltas for lp in (d.logprobs or ())) if with_logprobs else None,
        tool_calls=tuple(call for d in deltas for call in d.tool_calls),
        reasoning="".join(d.reasoning for d in deltas),
    )


@dataclass(frozen=True)
class GenerationEnd:
    """Last event for generation `index`."""

    index: int
    finish_reason: FinishReason
    usage: Usage
    matched_stop: str | None = None
    timings: Timings = Timings()
    tool_calls: tuple[ToolCall, ...] = ()  # complete and validated
    reasoning_signatures: tuple[str, ...] = ()


StreamEvent: TypeAlias = StreamStart | GenerationDelta | GenerationEnd


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model can do, declared up front; the router refuses what is not here."""

    constraints: dict[ConstraintKind, Enforcement] = field(default_factory=dict)
    grammar_syntaxes: frozenset[GrammarSyntax] = frozenset()
    max_n: int = 1
    logprobs: bool = False
    max_top_logprobs: int = 0
    input_modalities: frozenset[Modality] = frozenset({Modality.TEXT})
    context_length: int = 0
    seed: bool = False
    chat: bool = True
    # Keys accepted in GenerateRequest.backend_options; anything else is refused.
    backend_options: frozenset[str] = frozenset()
    # The prompt reaches the model as raw text, no chat template around it: Magpie can be served.
    raw_prompt: bool = False
    # GenerationRequest.continuation is honoured (the server renders the chat template itself).
    chat_continuation: bool = False
    # The chat-format tokens (of gengate.magpie.PRESET_TOKENS) the model's tokenizer has; None
    # when the server cannot see the tokenizer (a remote model).
    special_tokens: frozenset[str] | None = None
    # How tool calls are enforced; None: tools are refused (UNIMPLEMENTED).
    tools: Enforcement | None = None
    # Takes GenerationRequest.reasoning / returns Generation.reasoning.
    reasoning_control: bool = False
    reasoning: bool = False
    # Passes GenerationRequest.chat_template_kwargs to the chat template it renders itself.
    chat_template_kwargs: bool = False


@dataclass(frozen=True)
class ModelInfo:
    name: str
    backend: str
    capabilities: ModelCapabilities
