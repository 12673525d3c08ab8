"""OpenAI chat completions through the official `openai` SDK, and the OpenAI-compatible family:
Azure OpenAI, Together, Groq, Anyscale, vLLM server, SGLang, llama.cpp server, any other.

One adapter (`OpenAIChatBackend`) translates domain requests to the chat-completions wire format,
and, for servers with `raw_prompts` (vLLM's, llama.cpp's), a prompt to the completions format as
raw text; each family member only says how it takes structured output and which quirks it has.

Tools are native on every member (chat `tools`, `tool_choice`, `parallel_tool_calls`; calls in
`message.tool_calls` and streamed `delta.tool_calls`), each returned call validated by the base.
A tool asking for `strict` gets OpenAI's strict mode where the backend has it (`strict_schemas`)
and its schema can be made strict without loosening; elsewhere the schema goes as it is and
validation alone holds it. OpenAI's reasoning models take `reasoning_effort`; the compatible
servers' `reasoning_content` (vLLM, SGLang, DeepSeek, llama.cpp) or `reasoning` (Ollama, newer
vLLM) comes back as the generation's reasoning. Reasoning sent back in a chat is not put on the
wire (DeepSeek refuses it; the others ignore it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar

from pydantic import Field, field_validator

from gengate import errors
from gengate.backend import BatchOutcome, BatchStatus
from gengate.constraints.regex_dialect import ascii_shorthands
from gengate.domain import (
    SAMPLING_FIELDS,
    ChatMessage,
    ChoiceConstraint,
    ConstraintKind,
    Enforcement,
    FinishReason,
    Generation,
    GenerationRequest,
    GrammarConstraint,
    GrammarSyntax,
    JsonObjectConstraint,
    ModelCapabilities,
    Reasoning,
    ReasoningControl,
    RegexConstraint,
    Role,
    TextPart,
    Tool,
    ToolCall,
)
from gengate.providers import openai_batch, rawhttp
from gengate.providers import openai_wire as wire
from gengate.providers import structured as so
from gengate.providers import toolcalls as tc
from gengate.providers.base import (
    Chunk,
    ChunkEnd,
    ChunkText,
    ChunkUsage,
    Completion,
    ProviderBackend,
    ProviderCall,
    ProviderOptions,
    check_event_stream,
)
from gengate.providers.errors import UnreadableAnswer
from gengate.providers.stainless import PreparedPosts, aiohttp_client
from gengate.redaction import register_secret

log = logging.getLogger("gengate.providers")

N, V = Enforcement.NATIVE, Enforcement.VALIDATED
K = ConstraintKind


# Request fields gengate sets from the contract: not for backend_options.
CONTRACT_FIELDS = frozenset(SAMPLING_FIELDS) | {
    "model",
    "messages",
    "prompt",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}


_CREDENTIAL_HEADER = re.compile(r"(?i)auth|key|token|secret")


class OpenAIOptions(ProviderOptions):
    """Options of every OpenAI-family backend."""

    organization: str | None = None
    project: str | None = None
    extra_body: dict[str, Any] = Field(default_factory=dict, description="Merged into every request body.")
    extra_headers: dict[str, str] = Field(default_factory=dict)
    strict: bool = Field(default=True, description="Send JSON Schemas in strict mode (OpenAI, Azure).")
    request_options: list[str] = Field(
        default_factory=list,
        description="Request fields callers may set through backend_options, sent as they are in the "
        "request body (e.g. reasoning_effort, service_tier, user).",
    )

    @field_validator("request_options")
    @classmethod
    def _not_contract_fields(cls, value: list[str]) -> list[str]:
        taken = sorted(set(value) & CONTRACT_FIELDS)
        if taken:
            raise ValueError(f"{taken} are set from the request's own fields, not through backend_options")
        return value


class OpenAIChatBackend(ProviderBackend):
    """The adapter every member of the family shares (OpenAIBackend is OpenAI's own API;
    OpenAICompatibleBackend the servers speaking chat completions, some also raw completions)."""

    kind: ClassVar[str] = "openai"
    Options: ClassVar[type[ProviderOptions]] = OpenAIOptions
    label: ClassVar[str] = "OpenAI"
    structured_support: ClassVar[Mapping[ConstraintKind, Enforcement]] = {
        K.JSON_SCHEMA: N,
        K.JSON_OBJECT: N,
        K.CHOICE: N,
        K.REGEX: V,
    }
    logprobs_supported = True
    max_top_logprobs = 20
    image_input = True
    seed_supported = True
    default_base_url: ClassVar[str | None] = None
    # Body field for the output budget: OpenAI's newer models accept only max_completion_tokens.
    max_tokens_field: ClassVar[str] = "max_completion_tokens"
    # Sampling fields outside OpenAI's API, sent in the body only where the server takes them.
    extra_sampling: ClassVar[frozenset[str]] = frozenset()
    # The body name of an extra sampling field where the server spells it otherwise.
    sampling_wire_names: ClassVar[Mapping[str, str]] = {}
    stream_usage_option: ClassVar[bool] = True
    strict_schemas: ClassVar[bool] = True
    tools_support: ClassVar[Enforcement | None] = Enforcement.NATIVE
    # The compatible servers' reasoning parsers answer reasoning_content (see module docstring).
    reasoning_output: ClassVar[bool] = True

    options: OpenAIOptions

    def build_capabilities(self) -> ModelCapabilities:
        """The provider's capabilities, plus the request fields the config lets callers set."""
        caps = super().build_capabilities()
        return dataclasses.replace(caps, backend_options=frozenset(self.options.request_options))

    def __init__(self, name: str, options: ProviderOptions) -> None:
        super().__init__(name, options)
        self._client: Any = None
        self._posts: PreparedPosts | None = None
        for header, value in self.options.extra_headers.items():
            if _CREDENTIAL_HEADER.search(header):  # a proxy's key sent as a custom header
                register_secret(value)
                register_secret(value.partition(" ")[2])  # the token after a scheme ("Bearer x")

    # --- client --------------------------------------------------------------------------------

    async def start(self) -> None:
        await super().start()
        self._client = self._make_client()
        self._posts = PreparedPosts(self._client, "openai")

    def _make_client(self) -> Any:
        import openai

        return openai.AsyncOpenAI(
            api_key=self.api_key or "none",
            base_url=self.options.base_url or self.default_base_url,
            organization=self.options.organization,
            project=self.options.project,
            timeout=self.options.timeout,
            max_retries=0,  # one retry policy: providers.retry
            default_headers=self.options.extra_headers or None,
            http_client=aiohttp_client(openai, self.options.timeout),
        )

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = self._posts = None

    # --- structured output ---------------------------------------------------------------------

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        assert req.structured_output is not None
        strict = self.strict_schemas and self.options.strict
        return so.plan_openai_style(req.structured_output, level, strict_transform=strict)

    def structured_params(self, plan: so.StructuredPlan) -> dict[str, Any]:
        """Request fields that ask for the plan's constraint natively (OpenAI `response_format`)."""
        if isinstance(plan.structured.constraint, JsonObjectConstraint):
            return {"response_format": {"type": "json_object"}}
        if plan.native_schema is None:
            return {}
        json_schema: dict[str, Any] = {"name": _schema_name(plan), "schema": plan.native_schema}
        if plan.strict:
            json_schema["strict"] = True
        return {"response_format": {"type": "json_schema", "json_schema": json_schema}}

    # --- request building ----------------------------------------------------------------------

    def _raw_route(self, call: ProviderCall) -> bool:
        """Whether the call goes to the completions route, the prompt as raw text: a prompt request
        on a raw-prompt server, the call being that prompt alone (a validated constraint's
        instructions and a re-ask's feedback are chat turns, which only chat can carry), with no
        chat-only field (`response_format`, `tools`) in it."""
        req = call.request
        if not self.raw_prompts or req.prompt is None or req.messages is not None or req.tools:
            return False
        if call.messages != req.as_messages():
            return False
        plan = call.plan
        return plan is None or not plan.native or "response_format" not in self.structured_params(plan)

    def _params(self, call: ProviderCall, *, stream: bool, raw: bool = False) -> dict[str, Any]:
        """The SDK call's keyword arguments: a chat-completions request, or with `raw` a completions
        one. The two differ only in messages vs prompt, the output-budget field and the logprobs
        shape; sampling, stop, n, structured output, backend_options and timeout are the same."""
        req = call.request
        s = req.sampling
        params: dict[str, Any] = {"model": self.options.model}
        if raw:
            params["prompt"] = req.prompt
        else:
            params["messages"] = wire.messages(call)
        extra: dict[str, Any] = dict(self.options.extra_body)
        if call.n != 1:
            params["n"] = call.n
        for field_name in ("temperature", "top_p", "frequency_penalty", "presence_penalty", "seed"):
            value = getattr(s, field_name)
            if value is not None:
                params[field_name] = value
        for field_name in ("top_k", "min_p", "repetition_penalty"):
            value = getattr(s, field_name)
            if value is None:
                continue
            if field_name not in self.extra_sampling:
                raise errors.InvalidArgument.field(
                    f"sampling.{field_name}", f"not supported by {self.label} model {self.name!r}"
                )
            extra[self.sampling_wire_names.get(field_name, field_name)] = value
        if req.stopping.max_tokens is not None:
            # The completions API has only max_tokens; chat's newer name is OpenAI's own.
            params["max_tokens" if raw else self.max_tokens_field] = req.stopping.max_tokens
        if req.stopping.stop:
            params["stop"] = list(req.stopping.stop)
        if req.logprobs is not None:
            if raw:
                params["logprobs"] = req.logprobs  # completions: the count of top alternatives
            else:
                params["logprobs"] = True
                if req.logprobs > 0:
                    params["top_logprobs"] = req.logprobs
        extra.update(req.backend_options)  # over the config's extra_body, under what gengate sets
        if not raw:
            params.update(self._tool_params(req))
        if req.reasoning is not None and req.reasoning.effort is not None:
            if "reasoning_effort" in req.backend_options:
                raise errors.InvalidArgument.field(
                    "backend_options[reasoning_effort]", "is set beside reasoning.effort: set one"
                )
            extra.pop("reasoning_effort", None)  # the SDK's extra_body would win over the field
            params["reasoning_effort"] = req.reasoning.effort.value
        if call.plan is not None and call.plan.native:
            native = self.structured_params(call.plan)
            extra.update(native.pop("extra_body", {}))
            params.update(native)
        if stream:
            params["stream"] = True
            if self.stream_usage_option:
                params["stream_options"] = {"include_usage": True}
        if extra:
            params["extra_body"] = extra
        params["timeout"] = call.timeout
        return params

    # --- tools and reasoning -------------------------------------------------------------------

    def _tool_params(self, req: GenerationRequest) -> dict[str, Any]:
        """The request's tools, choice and parallel flag as chat-completions fields."""
        params: dict[str, Any] = {}
        if req.tools:
            params["tools"] = [self._wire_tool(t) for t in req.tools]
        if req.tool_choice is not None:
            params["tool_choice"] = wire.tool_choice(req.tool_choice)
        if req.parallel_tool_calls is not None:
            params["parallel_tool_calls"] = req.parallel_tool_calls
        return params

    def _strict_parameters(self, tool: Tool) -> dict[str, Any] | None:
        """The tool's schema in OpenAI strict form when the tool asks for strict and this backend
        has it, and the strict form loses nothing (else None: sent as it is, not strict)."""
        if not (self.strict_schemas and self.options.strict):
            return None
        return wire.strict_parameters(tool)

    def _wire_tool(self, tool: Tool) -> dict[str, Any]:
        return wire.tool(tool, self._strict_parameters(tool))

    def final_tool_call(self, request: GenerationRequest, call: ToolCall) -> ToolCall:
        """A strict tool's call without the nulls strict mode forced into its optional fields."""
        return wire.without_forced_nulls(request, call, self._strict_parameters)

    # --- upstream calls ------------------------------------------------------------------------

    async def _create(self, call: ProviderCall, *, stream: bool) -> Any:
        """One upstream request, on the completions route where `_raw_route` says, else on chat:
        a copy of the SDK's own request (providers.stainless), answered unread (providers.rawhttp)."""
        raw = self._raw_route(call)
        body, options = rawhttp.sdk_request(self._params(call, stream=stream, raw=raw))
        options["security"] = {"bearer_auth": True}  # as the SDK's create() asks for its key
        if self._posts is None:
            raise RuntimeError(f"model {self.name!r} used before start()")
        return await self._posts.post("/completions" if raw else "/chat/completions", body, options)

    async def _complete(self, call: ProviderCall) -> Completion:
        return self._completion(call, await rawhttp.read_object(await self._create(call, stream=False)))

    def _completion(self, call: ProviderCall, response: Any) -> Completion:
        """A chat completion or a text completion (its JSON, or an SDK object) as choices and usage."""
        stops = call.request.stopping.stop
        top = call.request.logprobs or 0
        gens: list[Generation] = []
        for position, choice in enumerate(rawhttp.objects(response, "choices")):
            text, refusal = wire.choice_text(choice)
            finish, matched = wire.choice_finish(choice, stops) or wire.finish(None, None, stops)
            if refusal:
                text, finish = refusal, FinishReason.REFUSAL
            logprobs = wire.logprobs(rawhttp.member(choice, "logprobs"), top)
            count = len(logprobs) if logprobs is not None else 0
            message = rawhttp.member(choice, "message")
            thought = wire.reasoning_text(message)
            index = rawhttp.integer(choice, "index")
            gens.append(
                Generation(
                    position if index is None else index,
                    text,
                    finish,
                    count,
                    matched,
                    logprobs,
                    tool_calls=wire.tool_calls(message),
                    reasoning=Reasoning(thought) if thought else None,
                )
            )
        gens.sort(key=lambda g: g.index)
        usage = wire.usage(response)
        if usage is not None and len(gens) == 1:
            gens[0] = _with_tokens(gens[0], usage.output_tokens)
        return Completion(gens, usage)

    async def _stream(self, call: ProviderCall) -> AsyncIterator[Chunk]:
        response = await self._create(call, stream=True)
        stops = call.request.stopping.stop
        top = call.request.logprobs or 0
        try:
            check_event_stream(self.label, response.headers.get("content-type"))
            async for event in rawhttp.events(response, end=rawhttp.DONE):
                if event.name is not None and event.name != "error":
                    continue  # not a chunk (the SDK's stream would yield it with no choices)
                chunk = rawhttp.loads_object(event.data, "an event of its stream")
                if event.name == "error" or chunk.get("error"):
                    raise UnreadableAnswer(_stream_error(chunk))
                for choice in rawhttp.objects(chunk, "choices"):
                    index = rawhttp.integer(choice, "index") or 0
                    text, refusal = wire.choice_text(choice)
                    logprobs = wire.logprobs(rawhttp.member(choice, "logprobs"), top)
                    delta = rawhttp.member(choice, "delta")
                    calls = wire.tool_call_deltas(delta)
                    thought = wire.reasoning_text(delta)
                    if text or refusal or logprobs or calls or thought:
                        count = len(logprobs) if logprobs else 1
                        yield ChunkText(index, text or refusal or "", logprobs, count, calls, thought)
                    finished = wire.choice_finish(choice, stops)
                    if finished is not None:
                        finish, matched = finished
                        yield ChunkEnd(index, FinishReason.REFUSAL if refusal else finish, matched)
                usage = wire.usage(chunk)
                if usage is not None:
                    yield ChunkUsage(usage.input_tokens, usage.output_tokens)
        finally:
            await response.aclose()


def _stream_error(chunk: dict[str, Any]) -> str:
    """The message of an error event inside a stream (the openai SDK's words when it has none)."""
    error = chunk.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) and message else "An error occurred during streaming"


def _with_tokens(g: Generation, tokens: int) -> Generation:
    from dataclasses import replace

    return replace(g, output_tokens=tokens)


def _schema_name(plan: so.StructuredPlan) -> str:
    name = getattr(plan.structured.constraint, "name", "") or "output"
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64]


class OpenAIBackend(OpenAIChatBackend):
    """OpenAI's chat completions API (api.openai.com or a compatible proxy at `base_url`), and
    its Batch API for offline jobs (backend.OfflineBatches; providers/openai_batch.py)."""

    batch_url: ClassVar[str] = "/v1/chat/completions"  # the batch's endpoint and each line's url
    max_batch_items: int = openai_batch.MAX_BATCH_ITEMS
    reasoning_controls: ClassVar[bool] = True  # reasoning_effort (o-series, gpt-5)
    reasoning_output: ClassVar[bool] = False  # chat completions never return the reasoning text

    def check_reasoning(self, control: ReasoningControl) -> None:
        """OpenAI has only reasoning_effort: no switch, no token budget."""
        provider = f"{self.label} model {self.name!r}"
        if control.budget_tokens is not None:
            raise tc.reasoning_refused(
                provider,
                "reasoning.budget_tokens",
                f"{self.label} takes no reasoning token budget (use reasoning.effort)",
            )
        if control.enabled is not None:
            raise tc.reasoning_refused(
                provider,
                "reasoning.enabled",
                f"{self.label} has no reasoning switch: its reasoning models always reason "
                "(use reasoning.effort)",
            )

    @property
    def _wire(self) -> openai_batch.ChatWire:
        if self._client is None:
            raise RuntimeError(f"model {self.name!r} used before start()")
        return openai_batch.ChatWire(
            self, self._client, lambda call: self._params(call, stream=False), self._completion
        )

    async def submit_batch(self, items: Sequence[tuple[int, GenerationRequest]]) -> str:
        return await openai_batch.submit(self._wire, items, url=self.batch_url)

    async def batch_status(self, batch_id: str) -> BatchStatus:
        return await openai_batch.status(self._wire, batch_id)

    def batch_results(
        self, batch_id: str, items: Mapping[int, GenerationRequest]
    ) -> AsyncIterator[BatchOutcome]:
        return openai_batch.results(self._wire, batch_id, items)

    async def cancel_batch(self, batch_id: str) -> None:
        await openai_batch.cancel(self._wire, batch_id)


# --- Azure ---------------------------------------------------------------------------------------


class AzureOpenAIOptions(OpenAIOptions):
    """Azure: `model` is the deployment name; `base_url` the resource endpoint."""

    api_version: str = "2024-10-21"
    azure_endpoint: str | None = Field(default=None, description="https://<resource>.openai.azure.com")


class AzureOpenAIBackend(OpenAIBackend):
    """Azure OpenAI: same wire format, a deployment instead of a model, an api-version query.
    Its Batch API (a Global Batch deployment) takes `/chat/completions` as the endpoint and url,
    with the deployment as each line's `model`."""

    kind: ClassVar[str] = "azure_openai"
    Options: ClassVar[type[ProviderOptions]] = AzureOpenAIOptions
    label: ClassVar[str] = "Azure OpenAI"
    batch_url: ClassVar[str] = "/chat/completions"
    options: AzureOpenAIOptions

    def _make_client(self) -> Any:
        import openai

        endpoint = self.options.azure_endpoint or self.options.base_url
        if not endpoint:
            raise errors.ConfigError(f"model {self.name!r}: azure_openai needs azure_endpoint (or base_url)")
        return openai.AsyncAzureOpenAI(
            azure_endpoint=endpoint,
            azure_deployment=self.options.model,
            api_version=self.options.api_version,
            api_key=self.api_key,
            organization=self.options.organization,
            timeout=self.options.timeout,
            max_retries=0,
            default_headers=self.options.extra_headers or None,
            http_client=aiohttp_client(openai, self.options.timeout),
        )


# --- OpenAI-compatible servers ------------------------------------------------------------------


class OpenAICompatibleBackend(OpenAIChatBackend):
    """Any server speaking chat completions at `base_url`. Nothing is assumed enforced: every
    constraint is prompted and validated unless a specific kind below says otherwise."""

    kind: ClassVar[str] = "openai_compatible"
    label: ClassVar[str] = "OpenAI-compatible server"
    structured_support: ClassVar[Mapping[ConstraintKind, Enforcement]] = {
        K.JSON_SCHEMA: V,
        K.JSON_OBJECT: V,
        K.CHOICE: V,
        K.REGEX: V,
    }
    max_tokens_field = "max_tokens"
    requires_api_key = False
    strict_schemas = False
    logprobs_supported = True
    max_top_logprobs = 20

    async def start(self) -> None:
        if not (self.options.base_url or self.default_base_url):
            raise errors.ConfigError(f"model {self.name!r}: backend {self.kind!r} needs base_url")
        await super().start()


class TogetherBackend(OpenAICompatibleBackend):
    """Together AI: JSON Schema and regex natively (`response_format` type json_schema / regex)."""

    kind: ClassVar[str] = "together"
    label: ClassVar[str] = "Together"
    default_base_url = "https://api.together.xyz/v1"
    requires_api_key = True
    structured_support: ClassVar[Mapping[ConstraintKind, Enforcement]] = {
        K.JSON_SCHEMA: N,
        K.JSON_OBJECT: N,
        K.CHOICE: N,
        K.REGEX: N,
    }
    extra_sampling = frozenset({"top_k", "min_p", "repetition_penalty"})
    image_input = True
    seed_supported = True

    def structured_params(self, plan: so.StructuredPlan) -> dict[str, Any]:
        c = plan.structured.constraint
        if isinstance(c, RegexConstraint):
            return {"response_format": {"type": "regex", "pattern": ascii_shorthands(c.pattern)}}
        return super().structured_params(plan)


class GroqBackend(OpenAICompatibleBackend):
    """Groq: JSON Schema on its structured-output models; n = 1 only (fanned out)."""

    kind: ClassVar[str] = "groq"
    label: ClassVar[str] = "Groq"
    default_base_url = "https://api.groq.com/openai/v1"
    requires_api_key = True
    structured_support: ClassVar[Mapping[ConstraintKind, Enforcement]] = {
        K.JSON_SCHEMA: N,
        K.JSON_OBJECT: N,
        K.CHOICE: N,
        K.REGEX: V,
    }
    native_n = False
    logprobs_supported = False
    max_top_logprobs = 0
    seed_supported = True


class AnyscaleBackend(OpenAICompatibleBackend):
    """Anyscale Endpoints: JSON mode with a schema (`response_format` json_object + schema)."""

    kind: ClassVar[str] = "anyscale"
    label: ClassVar[str] = "Anyscale"
    default_base_url = "https://api.endpoints.anyscale.com/v1"
    requires_api_key = True
    structured_support: ClassVar[Mapping[ConstraintKind, Enforcement]] = {
        K.JSON_SCHEMA: N,
        K.JSON_OBJECT: N,
        K.CHOICE: N,
        K.REGEX: V,
    }
    extra_sampling = frozenset({"top_k", "repetition_penalty"})

    def structured_params(self, plan: so.StructuredPlan) -> dict[str, Any]:
        return _json_object_schema(plan)


def _json_object_schema(plan: so.StructuredPlan) -> dict[str, Any]:
    """`response_format: {type: json_object, schema: ...}` (Anyscale, llama.cpp servers)."""
    if plan.native_schema is None:
        return {"response_format": {"type": "json_object"}}
    return {"response_format": {"type": "json_object", "schema": plan.native_schema}}


def _gbnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class LlamaCppServerBackend(OpenAICompatibleBackend):
    """llama.cpp's server and llama-cpp-python's: schema through json_object + schema (its
    json_schema response format answers HTTP 500), choices as a GBNF grammar, GBNF grammars.
    It ignores `n` (fanned out) and sends no usage in streams (counted by the base). Its schema
    conversion skips keywords such as minimum/maximum, so JSON Schema is reported VALIDATED.
    A prompt goes raw to /v1/completions, `grammar` (choices, grammars) with it; a JSON Schema or
    JSON object takes `response_format`, which that route does not read, so such a prompt request
    stays on chat (`_raw_route`): converting the schema to GBNF here would be a second converter
    beside the server's own."""

    kind: ClassVar[str] = "llamacpp_server"
    label: ClassVar[str] = "llama.cpp server"
    structured_support: ClassVar[Mapping[ConstraintKind, Enforcement]] = {
        K.JSON_SCHEMA: V,
        K.JSON_OBJECT: N,
        K.CHOICE: N,
        K.REGEX: V,
        K.GRAMMAR: N,
    }
    grammar_syntaxes = frozenset({GrammarSyntax.GBNF})
    native_n = False
    extra_sampling = frozenset({"top_k", "min_p", "repetition_penalty"})
    # llama.cpp's server and llama-cpp-python's read `repeat_penalty`; another name is ignored.
    sampling_wire_names: ClassVar[Mapping[str, str]] = {"repetition_penalty": "repeat_penalty"}
    seed_supported = True
    raw_prompts = True  # a prompt goes to /v1/completions as it is

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        assert req.structured_output is not None
        s = req.structured_output
        if s.constraint.kind == K.JSON_SCHEMA:
            plan = so.plan_openai_style(s, N, strict_transform=False)
            return so.StructuredPlan(s, V, native=True, native_schema=plan.native_schema)
        if s.constraint.kind in (K.CHOICE, K.GRAMMAR, K.JSON_OBJECT):
            return so.StructuredPlan(s, N, native=True)
        return super().plan_structured(req, level)

    def structured_params(self, plan: so.StructuredPlan) -> dict[str, Any]:
        c = plan.structured.constraint
        if isinstance(c, ChoiceConstraint):
            return {"extra_body": {"grammar": "root ::= " + " | ".join(_gbnf_literal(x) for x in c.choices)}}
        if isinstance(c, GrammarConstraint):
            return {"extra_body": {"grammar": c.definition}}
        return _json_object_schema(plan)


class SGLangBackend(OpenAICompatibleBackend):
    """SGLang's server: json_schema response format, `regex` and `ebnf` in the body."""

    kind: ClassVar[str] = "sglang"
    label: ClassVar[str] = "SGLang server"
    structured_support: ClassVar[Mapping[ConstraintKind, Enforcement]] = {
        K.JSON_SCHEMA: N,
        K.JSON_OBJECT: N,
        K.CHOICE: N,
        K.REGEX: N,
        K.GRAMMAR: N,
    }
    grammar_syntaxes = frozenset({GrammarSyntax.EBNF})
    extra_sampling = frozenset({"top_k", "min_p", "repetition_penalty"})
    seed_supported = True

    def structured_params(self, plan: so.StructuredPlan) -> dict[str, Any]:
        c = plan.structured.constraint
        if isinstance(c, RegexConstraint):
            return {"extra_body": {"regex": ascii_shorthands(c.pattern)}}
        if isinstance(c, ChoiceConstraint):
            return {"extra_body": {"regex": "|".join(re.escape(x) for x in c.choices)}}
        if isinstance(c, GrammarConstraint):
            return {"extra_body": {"ebnf": c.definition}}
        return super().structured_params(plan)

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        assert req.structured_output is not None
        if req.structured_output.constraint.kind in (K.CHOICE, K.REGEX, K.GRAMMAR):
            return so.StructuredPlan(req.structured_output, level, native=level == N)
        return super().plan_structured(req, level)


class VLLMServerOptions(OpenAIOptions):
    canary: bool = Field(default=True, description="Check at start-up that constraints are enforced.")


class VLLMServerBackend(OpenAICompatibleBackend):
    """A vLLM OpenAI-compatible server: every kind through `structured_outputs` in the body
    (vLLM ≥ 0.12 silently ignores the old guided_* fields), on chat and on /v1/completions, where
    a prompt goes raw. start() sends a canary choice request; if the answer is not one of the
    choices, native kinds fall back to validated."""

    kind: ClassVar[str] = "vllm_server"
    Options: ClassVar[type[ProviderOptions]] = VLLMServerOptions
    label: ClassVar[str] = "vLLM server"
    structured_support: ClassVar[Mapping[ConstraintKind, Enforcement]] = {
        K.JSON_SCHEMA: N,
        K.JSON_OBJECT: N,
        K.CHOICE: N,
        K.REGEX: N,
        K.GRAMMAR: N,
    }
    grammar_syntaxes = frozenset({GrammarSyntax.GBNF, GrammarSyntax.EBNF, GrammarSyntax.LARK})
    extra_sampling = frozenset({"top_k", "min_p", "repetition_penalty"})
    seed_supported = True
    raw_prompts = True  # a prompt goes to /v1/completions as it is
    options: VLLMServerOptions
    CANARY_CHOICES: ClassVar[tuple[str, ...]] = ("zq7", "xv9")

    def __init__(self, name: str, options: ProviderOptions) -> None:
        self._enforcement_verified: bool | None = None
        super().__init__(name, options)

    def supported_constraints(self) -> dict[ConstraintKind, Enforcement]:
        if self._enforcement_verified is False:
            return {K.JSON_SCHEMA: V, K.JSON_OBJECT: V, K.CHOICE: V, K.REGEX: V}
        return dict(self.structured_support)

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        assert req.structured_output is not None
        if level == N:
            return so.StructuredPlan(req.structured_output, N, native=True)
        return so.plan_openai_style(req.structured_output, level, strict_transform=False)

    def structured_params(self, plan: so.StructuredPlan) -> dict[str, Any]:
        c = plan.structured.constraint
        spec: dict[str, Any]
        if isinstance(c, ChoiceConstraint):
            spec = {"choice": list(c.choices)}
        elif isinstance(c, RegexConstraint):
            spec = {"regex": ascii_shorthands(c.pattern)}
        elif isinstance(c, GrammarConstraint):
            spec = {"grammar": c.definition}
        elif isinstance(c, JsonObjectConstraint):
            spec = {"json_object": True}
        else:
            spec = {"json": c.schema}
        return {"extra_body": {"structured_outputs": spec}}

    async def start(self) -> None:
        await super().start()
        if self.options.canary:
            await self._check_enforcement()

    async def _check_enforcement(self) -> None:
        """Asks for one of two unlikely strings; an unconstrained answer means the server drops
        structured_outputs, and then nothing is declared native."""
        from gengate.domain import StructuredOutput

        structured = StructuredOutput(ChoiceConstraint(self.CANARY_CHOICES))
        req = GenerationRequest(
            model=self.name,
            messages=(ChatMessage(Role.USER, (TextPart("Write one sentence about the sea."),)),),
            structured_output=structured,
        )
        plan = so.StructuredPlan(structured, N, native=True)
        call = ProviderCall(req, req.messages or (), 1, plan, self.options.timeout)
        try:
            answer = await self._complete_retrying(call)
            text = answer.generations[0].text.strip() if answer.generations else ""
            ok = text in self.CANARY_CHOICES
            why = f"answered {text[:40]!r}"
        except errors.GengateError as exc:
            ok, why = False, f"failed: {exc.message}"
        self._enforcement_verified = ok
        if not ok:
            log.warning(
                "%s (%s): structured_outputs canary %s; constraints will be prompted and validated, "
                "grammars refused",
                self.name,
                self.label,
                why,
            )
        self.capabilities = self.build_capabilities()
