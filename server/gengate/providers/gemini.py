"""Google Gemini API and Vertex AI through the official `google-genai` SDK.

JSON Schema is native through `response_json_schema` (Gemini enforces a subset of keywords;
a schema using others is still sent, and reported VALIDATED), choices through the
`text/x.enum` MIME type, JSON object through `application/json`; regex is prompted and
validated; grammars are refused. `n` is native (`candidate_count`).

Tools are native: function declarations with their full JSON Schema (`parametersJsonSchema`),
`functionCallingConfig` for the choice (a named tool: ANY limited to it), functionCall parts in,
functionResponse parts out. Gemini has no parallel-calls switch: with parallel_tool_calls false
the server's validation (at most one call) and its re-ask enforce it. Thinking is set by
`thinkingConfig` (budget, level, off) and comes back as the generation's reasoning, with the
thought signatures Gemini requires back beside its calls (the wire forms: providers.gemini_wire).

The SDK builds and sends each request; gengate reads the answer's JSON and event stream itself,
bounded, and follows continuation hops as google-genai 3.x would (providers.gemini_raw).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar

import httpx
from google import genai
from google.genai import errors as genai_errors
from google.genai import types
from pydantic import Field

from gengate import errors
from gengate.domain import (
    ChoiceConstraint,
    ConstraintKind,
    Enforcement,
    GenerationRequest,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    ReasoningControl,
    Role,
    StructuredOutput,
)
from gengate.providers import gemini_raw as raw
from gengate.providers import gemini_wire as wire
from gengate.providers import structured as so
from gengate.providers import toolcalls as tc
from gengate.providers import transport
from gengate.providers.base import (
    Chunk,
    Completion,
    ProviderBackend,
    ProviderCall,
    ProviderOptions,
)
from gengate.providers.errors import from_status, parse_retry_after

# The JSON Schema keywords Gemini's `response_json_schema` enforces; others are ignored by it.
_GEMINI_KEYWORDS = frozenset(
    {
        "$id",
        "$defs",
        "$ref",
        "$anchor",
        "$schema",
        "type",
        "format",
        "title",
        "description",
        "enum",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "minimum",
        "maximum",
        "anyOf",
        "oneOf",
        "properties",
        "additionalProperties",
        "required",
        "propertyOrdering",
    }
)
_CHILD_MAPS = ("properties", "$defs")
_CHILD_LISTS = ("anyOf", "oneOf", "prefixItems")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s$")


class GeminiOptions(ProviderOptions):
    """Config keys of a `gemini` model; set `vertexai` (with project/location) for Vertex AI."""

    vertexai: bool = Field(default=False, description="Use Vertex AI instead of the Gemini API.")
    project: str | None = Field(
        default=None, description="Vertex AI project (default: from the environment)."
    )
    location: str | None = Field(default=None, description="Vertex AI location, e.g. us-central1.")
    api_version: str | None = Field(default=None, description="API version path, e.g. v1beta.")


def outside_gemini_subset(node: Any) -> bool:
    """Whether a schema uses keywords Gemini does not enforce (so the result is only VALIDATED)."""
    if isinstance(node, list):
        return any(outside_gemini_subset(v) for v in node)
    if not isinstance(node, dict):
        return False
    for key, value in node.items():
        if key not in _GEMINI_KEYWORDS:
            return True
        if key in _CHILD_MAPS and isinstance(value, dict):
            if any(outside_gemini_subset(v) for v in value.values()):
                return True
        elif key in (*_CHILD_LISTS, "items", "additionalProperties") and outside_gemini_subset(value):
            return True
    return False


def gemini_plan(structured: StructuredOutput, level: Enforcement) -> so.StructuredPlan:
    """Native schema as-is (any root), choices through text/x.enum; the rest prompted."""
    c = structured.constraint
    if level != Enforcement.NATIVE:
        return so.StructuredPlan(
            structured, level, native=False, instructions=so.constraint_instructions(structured)
        )
    if isinstance(c, JsonSchemaConstraint):
        enforcement = Enforcement.VALIDATED if outside_gemini_subset(c.schema) else Enforcement.NATIVE
        return so.StructuredPlan(structured, enforcement, native=True, native_schema=c.schema)
    return so.StructuredPlan(structured, Enforcement.NATIVE, native=True)


def _retry_delay(details: Any) -> float | None:
    """RetryInfo.retryDelay ("12s") from a google.rpc error body, if any."""
    error = details.get("error", details) if isinstance(details, Mapping) else None
    for item in (error or {}).get("details", ()) if isinstance(error, Mapping) else ():
        if isinstance(item, Mapping) and str(item.get("@type", "")).endswith("RetryInfo"):
            match = _DURATION.match(str(item.get("retryDelay", "")))
            if match:
                return float(match.group(1))
    return None


class GeminiBackend(ProviderBackend):
    """Gemini models over generateContent / streamGenerateContent (Gemini API or Vertex AI)."""

    kind: ClassVar[str] = "gemini"
    Options: ClassVar[type[ProviderOptions]] = GeminiOptions
    label: ClassVar[str] = "Gemini"
    structured_support: ClassVar[dict[ConstraintKind, Enforcement]] = {
        ConstraintKind.JSON_SCHEMA: Enforcement.NATIVE,
        ConstraintKind.CHOICE: Enforcement.NATIVE,
        ConstraintKind.JSON_OBJECT: Enforcement.NATIVE,
        ConstraintKind.REGEX: Enforcement.VALIDATED,
    }
    native_n: ClassVar[bool] = True
    image_input: ClassVar[bool] = True
    seed_supported: ClassVar[bool] = True
    tools_support: ClassVar[Enforcement | None] = Enforcement.NATIVE
    reasoning_controls: ClassVar[bool] = True
    reasoning_output: ClassVar[bool] = True

    def __init__(self, name: str, options: ProviderOptions) -> None:
        super().__init__(name, options)
        self._client: genai.Client | None = None
        self._http: httpx.AsyncClient | None = None

    @property
    def opts(self) -> GeminiOptions:
        assert isinstance(self.options, GeminiOptions)
        return self.options

    async def start(self) -> None:
        if not self.opts.vertexai:  # Vertex AI authenticates with Google credentials, keys optional
            await super().start()
        # One pool for unary and streamed calls (gengate closes each response it reads); no
        # connection cap, as each stream had its own client before.
        self._http = transport.httpx_client(
            raw.BoundedClient, limits=httpx.Limits(max_connections=None, max_keepalive_connections=20)
        )
        self._client = genai.Client(**self._client_kwargs(self._http))

    def _client_kwargs(self, http_client: httpx.AsyncClient | None = None) -> dict[str, Any]:
        http_kwargs: dict[str, Any] = {
            "base_url": self.options.base_url,
            "api_version": self.opts.api_version,
            "timeout": int(self.options.timeout * 1000),
            "httpx_async_client": http_client,
        }
        http = types.HttpOptions(**{k: v for k, v in http_kwargs.items() if v is not None})
        kwargs: dict[str, Any] = {"http_options": http}
        if self.opts.vertexai:
            kwargs.update(vertexai=True, project=self.opts.project, location=self.opts.location)
        if self.api_key:
            kwargs["api_key"] = self.api_key
        return kwargs

    async def aclose(self) -> None:
        try:
            if self._client is not None:
                await self._client.aio.aclose()
        finally:
            if self._http is not None:
                await self._http.aclose()
            self._client = self._http = None

    @property
    def client(self) -> genai.Client:
        if self._client is None:
            raise RuntimeError(f"model {self.name!r} used before start()")
        return self._client

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        assert req.structured_output is not None
        return gemini_plan(req.structured_output, level)

    # --- tools and thinking ----------------------------------------------------------------

    def check_reasoning(self, control: ReasoningControl) -> None:
        """Budget, effort (thinkingLevel) and on/off all map; a budget and an effort together
        do not: Gemini takes a thinking level or a thinking budget, never both."""
        if control.effort is not None and control.budget_tokens is not None:
            raise tc.reasoning_refused(
                f"{self.label} model {self.name!r}",
                "reasoning.effort",
                "Gemini takes a thinking level (effort) or a thinking budget (budget_tokens), not both",
            )

    def _prepare(self, req: GenerationRequest) -> ProviderCall:
        """The base's checks, then the conversation's tool turns Gemini cannot take back."""
        call = super()._prepare(req)
        violations = wire.history_violations(req.messages or ())
        if violations:
            raise errors.InvalidArgument(
                "; ".join(f"{v.field}: {v.description}" for v in violations), violations=violations
            )
        return call

    def normalize_error(self, exc: BaseException) -> errors.GengateError:
        if isinstance(exc, genai_errors.APIError) and isinstance(exc.code, int) and exc.code >= 400:
            headers = getattr(exc.response, "headers", None)
            header_map = {str(k): str(v) for k, v in dict(headers).items()} if headers else None
            error = from_status(
                exc.code,
                exc.details or exc.message,
                headers=header_map,
                provider=self.label,
                error_type=exc.status,
            )
            if error.retry_after_s is not None and parse_retry_after(header_map) is None:
                error.retry_after_s = _retry_delay(exc.details) or error.retry_after_s
            return error
        return super().normalize_error(exc)

    def _request(self, call: ProviderCall) -> dict[str, Any]:
        req = call.request
        system = "\n\n".join(m.text for m in call.messages if m.role == Role.SYSTEM)
        contents = wire.contents(call.messages)
        s = req.sampling
        config: dict[str, Any] = {
            "system_instruction": system or None,
            "candidate_count": call.n if call.n > 1 else None,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seed": s.seed,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "max_output_tokens": req.stopping.max_tokens,
            "stop_sequences": list(req.stopping.stop) or None,
            "http_options": types.HttpOptions(timeout=max(1, int(call.timeout * 1000))),
            "tools": wire.tools(req.tools) if req.tools else None,
            "tool_config": wire.tool_config(req.tool_choice),
            "thinking_config": wire.thinking_config(req.reasoning),
        }
        plan = call.plan
        if plan is not None and plan.native:
            c = plan.structured.constraint
            if isinstance(c, ChoiceConstraint):
                config["response_mime_type"] = "text/x.enum"
                config["response_schema"] = {"type": "STRING", "enum": list(c.choices)}
            elif isinstance(c, JsonObjectConstraint):
                config["response_mime_type"] = "application/json"
            else:
                config["response_mime_type"] = "application/json"
                config["response_json_schema"] = plan.native_schema
        generation_config = types.GenerateContentConfig(**{k: v for k, v in config.items() if v is not None})
        return {"model": self.options.model, "contents": contents, "config": generation_config}

    async def _complete(self, call: ProviderCall) -> Completion:
        return await raw.complete(self.client, self._request(call), call.timeout)

    def _stream(self, call: ProviderCall) -> AsyncIterator[Chunk]:
        return raw.stream(self.client, self._request(call), call.timeout, self.label)
