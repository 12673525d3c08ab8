"""Cohere v2 Chat API through the official `cohere` SDK (AsyncClientV2): its HTTP client sends
the request (base URL, auth, timeout), gengate reads the answer raw (providers.rawhttp).

JSON Schema and choices are native through `response_format` {"type": "json_object",
"json_schema": ...} (object root; others wrapped), JSON object natively; regex is prompted and
validated; grammars are refused. Cohere has no `n`: the base fans out.

Tools are native (`tools`, `tool_choice` REQUIRED / NONE, `strict_tools`, tool turns); a named
tool choice is emulated by offering that tool alone with REQUIRED, and there is no parallel
switch (the server's validation allows at most one call when parallel calls are off). A tool
plan is the generation's text. Thinking (command-a-reasoning) is set by `thinking` (enabled,
disabled, `token_budget`) and comes back as the generation's reasoning; effort is refused. The
wire forms: providers.cohere_wire.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import cohere
import httpx
import orjson

from gengate import errors
from gengate.domain import (
    ConstraintKind,
    Enforcement,
    FinishReason,
    Generation,
    GenerationRequest,
    JsonObjectConstraint,
    ReasoningControl,
    TokenLogprob,
    ToolCall,
    Usage,
)
from gengate.providers import cohere_wire as wire
from gengate.providers import rawhttp, transport
from gengate.providers import structured as so
from gengate.providers import toolcalls as tc
from gengate.providers.base import (
    Chunk,
    ChunkEnd,
    ChunkUsage,
    Completion,
    ProviderBackend,
    ProviderCall,
    ProviderOptions,
    check_event_stream,
    map_finish_reason,
)
from gengate.providers.errors import UnreadableAnswer
from gengate.tools import TOOLS_UNSUPPORTED


class CohereOptions(ProviderOptions):
    """Config keys of a `cohere` model."""

    safety_mode: str | None = None


def _finish(raw: str | None) -> FinishReason:
    """Cohere's finish reason: TOOL_CALL and TIMEOUT are its own, the rest the usual names."""
    if raw == "TIMEOUT":
        return FinishReason.TIME_LIMIT
    if raw == "TOOL_CALL":
        return FinishReason.TOOL_CALLS
    return map_finish_reason(raw)


def _usage(usage: Any) -> Usage | None:
    """Cohere reports `tokens` (what the model saw) and `billed_units`; prefer `tokens`."""
    if usage is None:
        return None
    for key in ("tokens", "billed_units"):
        counts = rawhttp.member(usage, key)
        output = rawhttp.number(counts, "output_tokens") if counts is not None else None
        if output is not None:
            return Usage(int(rawhttp.number(counts, "input_tokens") or 0), int(output))
    return None


class CohereBackend(ProviderBackend):
    """Command models over the v2 Chat API."""

    kind: ClassVar[str] = "cohere"
    Options: ClassVar[type[ProviderOptions]] = CohereOptions
    label: ClassVar[str] = "Cohere"
    structured_support: ClassVar[dict[ConstraintKind, Enforcement]] = {
        ConstraintKind.JSON_SCHEMA: Enforcement.NATIVE,
        ConstraintKind.CHOICE: Enforcement.NATIVE,
        ConstraintKind.JSON_OBJECT: Enforcement.NATIVE,
        ConstraintKind.REGEX: Enforcement.VALIDATED,
    }
    native_n: ClassVar[bool] = False
    logprobs_supported: ClassVar[bool] = True
    image_input: ClassVar[bool] = True
    seed_supported: ClassVar[bool] = True
    tools_support: ClassVar[Enforcement | None] = Enforcement.NATIVE
    reasoning_controls: ClassVar[bool] = True
    reasoning_output: ClassVar[bool] = True

    def __init__(self, name: str, options: ProviderOptions) -> None:
        super().__init__(name, options)
        self._client: cohere.AsyncClientV2 | None = None
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        await super().start()
        # Our own HTTP client, so that aclose() really closes the connections.
        self._http = transport.httpx_client(timeout=self.options.timeout, follow_redirects=True)
        kwargs: dict[str, Any] = {
            "api_key": self.api_key,
            "timeout": self.options.timeout,
            "httpx_client": self._http,
        }
        if self.options.base_url:
            kwargs["base_url"] = self.options.base_url
        self._client = cohere.AsyncClientV2(**kwargs)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        self._client = self._http = None

    @property
    def client(self) -> cohere.AsyncClientV2:
        if self._client is None:
            raise RuntimeError(f"model {self.name!r} used before start()")
        return self._client

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        assert req.structured_output is not None
        return so.plan_object_root(req.structured_output, level)

    def _prepare(self, req: GenerationRequest) -> ProviderCall:
        """The base's checks, then what only Cohere refuses: an image in a tool result."""
        call = super()._prepare(req)
        violations = wire.history_violations(req.messages or ())
        if violations:
            raise errors.Unimplemented(
                "; ".join(f"{v.field}: {v.description}" for v in violations),
                reason=TOOLS_UNSUPPORTED,
                violations=violations,
            )
        return call

    def check_reasoning(self, control: ReasoningControl) -> None:
        """Thinking on, off or with a token budget maps; an effort level has no Cohere form."""
        if control.effort is not None:
            raise tc.reasoning_refused(
                f"{self.label} model {self.name!r}",
                "reasoning.effort",
                f"{self.label} takes a thinking token budget, not an effort level",
            )

    def final_tool_call(self, request: GenerationRequest, call: ToolCall) -> ToolCall:
        """A call to a tool without parameters may carry no arguments text: `{}`."""
        if call.arguments.strip():
            return call
        return dataclasses.replace(call, arguments="{}")

    def _params(self, call: ProviderCall) -> dict[str, Any]:
        req = call.request
        params: dict[str, Any] = {
            "model": self.options.model,
            "messages": wire.messages(call.messages),
            # The SDK's own retries stay off: the base retries with the caller's deadline in mind.
            "request_options": {"timeout_in_seconds": call.timeout, "max_retries": 0},
        }
        s = req.sampling
        for key, value in (
            ("temperature", s.temperature),
            ("p", s.top_p),
            ("k", s.top_k),
            ("seed", s.seed),
            ("frequency_penalty", s.frequency_penalty),
            ("presence_penalty", s.presence_penalty),
            ("max_tokens", req.stopping.max_tokens),
        ):
            if value is not None:
                params[key] = value
        if req.stopping.stop:
            params["stop_sequences"] = list(req.stopping.stop)
        if req.logprobs is not None:
            params["logprobs"] = True
        if isinstance(self.options, CohereOptions) and self.options.safety_mode:
            params["safety_mode"] = self.options.safety_mode
        params.update(wire.tool_params(req))
        thinking = wire.thinking(req.reasoning)
        if thinking is not None:
            params["thinking"] = thinking
        plan = call.plan
        if plan is not None and plan.native:
            response_format: dict[str, Any] = {"type": "json_object"}
            if plan.native_schema is not None:
                response_format["json_schema"] = plan.native_schema
            elif not isinstance(plan.structured.constraint, JsonObjectConstraint):
                raise AssertionError("native plan without a schema")
            params["response_format"] = response_format
        return params

    @contextlib.asynccontextmanager
    async def _post(self, call: ProviderCall, *, stream: bool) -> AsyncIterator[httpx.Response]:
        """One v2 Chat request sent by the SDK's own HTTP client (its base URL, auth headers and
        request_options timeout), answered unread (providers.rawhttp); a non-2xx answer raises
        the SDK's ApiError as its chat() would, so errors map as before."""
        params = self._params(call)
        request_options = params.pop("request_options")
        params["stream"] = stream
        http = self.client._client_wrapper.httpx_client
        async with http.stream(
            "v2/chat",
            method="POST",
            json=params,
            headers={"content-type": "application/json"},
            request_options=request_options,
        ) as response:
            if not 200 <= response.status_code < 300:
                raise _api_error(response, await rawhttp.read_error_body(response))
            yield response

    async def _complete(self, call: ProviderCall) -> Completion:
        async with self._post(call, stream=False) as raw:
            response = await rawhttp.read_object(raw)
        text, calls, reasoning = wire.message_parts(rawhttp.member(response, "message"))
        logprobs = None
        items = rawhttp.objects(response, "logprobs")
        if items:
            logprobs = tuple(
                TokenLogprob(
                    token=rawhttp.text(item, "text"),
                    logprob=rawhttp.as_number((rawhttp.items(item, "logprobs") or [0.0])[0], "logprobs"),
                    token_id=_first_id(item),
                )
                for item in items
            )
        usage = _usage(rawhttp.member(response, "usage"))
        generation = Generation(
            index=0,
            text=text,
            finish_reason=_finish(rawhttp.optional_text(response, "finish_reason")),
            output_tokens=usage.output_tokens if usage else 0,
            logprobs=logprobs,
            tool_calls=calls,
            reasoning=reasoning,
        )
        return Completion([generation], usage)

    async def _stream(self, call: ProviderCall) -> AsyncIterator[Chunk]:
        calls = wire.StreamState()
        async with self._post(call, stream=True) as response:
            check_event_stream(self.label, response.headers.get("content-type"))
            async for sse in rawhttp.events(response, end=rawhttp.DONE):
                event = rawhttp.loads_object(sse.data, "an event of its stream")
                if event.get("type") != "message-end":
                    for chunk in calls.chunks(event):
                        yield chunk
                    continue
                delta = rawhttp.member(event, "delta")
                yield ChunkEnd(0, _finish(rawhttp.optional_text(delta, "finish_reason") if delta else None))
                usage = _usage(rawhttp.member(delta, "usage") if delta else None)
                if usage is not None:
                    yield ChunkUsage(usage.input_tokens, usage.output_tokens)


def _first_id(item: Any) -> int | None:
    ids = rawhttp.items(item, "token_ids")
    if not ids:
        return None
    if isinstance(ids[0], bool) or not isinstance(ids[0], int):
        raise UnreadableAnswer("an entry of `token_ids` is not a whole number")
    return ids[0]


def _api_error(response: httpx.Response, body: bytes) -> Exception:
    """The SDK's ApiError for a non-2xx answer, as its chat() raises it (body as JSON, else text)."""
    from cohere.core.api_error import ApiError

    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = body.decode("utf-8", "replace")
    return ApiError(status_code=response.status_code, headers=dict(response.headers), body=parsed)
