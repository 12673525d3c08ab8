"""Mistral chat completions through the official `mistralai` SDK.

JSON Schema and choices are native through `response_format` {"type": "json_schema", strict}
(object root; others wrapped), JSON object natively; regex is prompted and validated; grammars
are refused. `n` is native.

Tools are native: `tools` (function tools, `strict` passed on), `tool_choice` (auto, none, any
for required, or the named function), `parallel_tool_calls`; calls come back in
`message.tool_calls` (finish reason `tool_calls`) and whole in stream deltas. Call ids sent are
mapped to Mistral's nine letters and digits (providers.mistral_wire). `reasoning.effort` is
`reasoning_effort`; thinking chunks come back as the generation's reasoning and go back in the
assistant turns that carry it. Mistral has no reasoning switch or token budget: those are
refused.

The SDK sends each request through its generated BaseSDK (`_build_request_async` and
`do_request_async`, as its own chat methods do: server URL, bearer auth, user agent, its hooks,
the timeout) and hands back the HTTP response unread; gengate reads the JSON body and the event
stream itself, bounded (providers.rawhttp). A non-2xx answer raises the SDK's SDKError, as
`chat.complete_async` would. Both hooks are private to the generated code, so the SDK's major
version is pinned and tests/providers/test_raw_sdks.py fails by name if either goes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import httpx
from mistralai.client import Mistral

from gengate.domain import (
    ConstraintKind,
    Enforcement,
    Generation,
    GenerationRequest,
    JsonSchemaConstraint,
    ReasoningControl,
    Usage,
)
from gengate.providers import mistral_wire as wire
from gengate.providers import rawhttp, transport
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
    map_finish_reason,
)
from gengate.providers.errors import UnreadableAnswer

# The operation ids the SDK's own chat methods give its hooks.
_OPERATION = {False: "chat_completion_v1_chat_completions_post", True: "stream_chat"}


class MistralOptions(ProviderOptions):
    """Config keys of a `mistral` model."""

    safe_prompt: bool | None = None


class MistralBackend(ProviderBackend):
    """Mistral models over /v1/chat/completions."""

    kind: ClassVar[str] = "mistral"
    Options: ClassVar[type[ProviderOptions]] = MistralOptions
    label: ClassVar[str] = "Mistral"
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
    reasoning_controls: ClassVar[bool] = True  # reasoning_effort
    reasoning_output: ClassVar[bool] = True  # thinking chunks

    def __init__(self, name: str, options: ProviderOptions) -> None:
        super().__init__(name, options)
        self._client: Mistral | None = None
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        await super().start()
        self._http = transport.httpx_client(follow_redirects=True)
        self._client = Mistral(
            api_key=self.api_key,
            server_url=self.options.base_url,
            async_client=self._http,
            timeout_ms=int(self.options.timeout * 1000),
        )

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        self._client = self._http = None

    @property
    def client(self) -> Mistral:
        if self._client is None:
            raise RuntimeError(f"model {self.name!r} used before start()")
        return self._client

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        assert req.structured_output is not None
        return so.plan_object_root(req.structured_output, level)

    def check_reasoning(self, control: ReasoningControl) -> None:
        """Mistral has only reasoning_effort: its reasoning models always think (no switch), and
        it takes no thinking token budget."""
        provider = f"{self.label} model {self.name!r}"
        if control.budget_tokens is not None:
            raise tc.reasoning_refused(
                provider, "reasoning.budget_tokens", f"{self.label} takes no thinking token budget"
            )
        if control.enabled is not None:
            raise tc.reasoning_refused(
                provider, "reasoning.enabled", f"{self.label} has no reasoning switch (use reasoning.effort)"
            )

    def _tool_params(self, req: GenerationRequest) -> dict[str, Any]:
        """The request's tools, choice, parallel switch and reasoning effort as Mistral fields."""
        params: dict[str, Any] = {}
        if req.tools:
            params["tools"] = [wire.tool(t) for t in req.tools]
        if req.tool_choice is not None:
            params["tool_choice"] = wire.tool_choice(req.tool_choice)
        if req.parallel_tool_calls is not None:
            params["parallel_tool_calls"] = req.parallel_tool_calls
        if req.reasoning is not None and req.reasoning.effort is not None:
            params["reasoning_effort"] = req.reasoning.effort.value
        return params

    def _params(self, call: ProviderCall) -> dict[str, Any]:
        req = call.request
        params: dict[str, Any] = {
            "model": self.options.model,
            "messages": wire.messages(call.messages),
            "retries": None,  # the base retries, with the caller's deadline in mind
            "timeout_ms": max(1, int(call.timeout * 1000)),
        }
        if call.n > 1:
            params["n"] = call.n
        s = req.sampling
        for key, value in (
            ("temperature", s.temperature),
            ("top_p", s.top_p),
            ("random_seed", s.seed),
            ("frequency_penalty", s.frequency_penalty),
            ("presence_penalty", s.presence_penalty),
            ("max_tokens", req.stopping.max_tokens),
        ):
            if value is not None:
                params[key] = value
        if req.stopping.stop:
            params["stop"] = list(req.stopping.stop)
        params.update(self._tool_params(req))
        if isinstance(self.options, MistralOptions) and self.options.safe_prompt is not None:
            params["safe_prompt"] = self.options.safe_prompt
        plan = call.plan
        if plan is not None and plan.native:
            if plan.native_schema is None:
                params["response_format"] = {"type": "json_object"}
            else:
                c = plan.structured.constraint
                name = (c.name if isinstance(c, JsonSchemaConstraint) else "") or "output"
                params["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": name, "schema": plan.native_schema, "strict": True},
                }
        return params

    @contextlib.asynccontextmanager
    async def _post(self, call: ProviderCall, *, stream: bool) -> AsyncIterator[rawhttp.RawResponse]:
        """One chat-completions request sent by the SDK (module docstring), answered unread; the
        response is closed on leaving. A non-2xx answer raises the SDK's SDKError (body read
        bounded), so status errors map as before."""
        from mistralai.client import errors as sdk_errors
        from mistralai.client import models, utils
        from mistralai.client._hooks import HookContext

        params = self._params(call)
        params.pop("retries")  # the SDK's retries stay off (retry_config None below)
        timeout_ms = params.pop("timeout_ms")
        params["stream"] = stream
        chat = self.client.chat
        config = chat.sdk_configuration
        base_url = chat._get_url(None, None)  # type: ignore[no-untyped-call]
        # The SDK's own request model serializes the body, as its chat methods do (its defaults
        # included, such as an assistant message's `prefix`): the request bytes stay the SDK's
        # (request_json).
        kind = models.ChatCompletionStreamRequest if stream else models.ChatCompletionRequest
        model = kind.model_validate(params)
        request = chat._build_request_async(
            method="POST",
            path="/v1/chat/completions",
            base_url=base_url,
            url_variables=None,
            request=None,
            request_body_required=True,
            request_has_path_params=False,
            request_has_query_params=False,
            user_agent_header="user-agent",
            accept_header_value="text/event-stream" if stream else "application/json",
            security=config.security,
            get_serialized_body=lambda: utils.SerializedRequestBody("application/json", request_json(model)),
            timeout_ms=timeout_ms,
        )
        context = HookContext(
            config=config,
            base_url=base_url or "",
            operation_id=_OPERATION[stream],
            oauth2_scopes=None,
            security_source=utils.get_security_from_env(config.security, models.Security),
            tags=["chat"],
            extensions=None,
        )
        response = await chat.do_request_async(
            hook_ctx=context,
            request=request,
            is_error_status_code=lambda code: utils.match_status_codes(["4XX", "5XX"], code),
            stream=True,
            retry_config=None,
        )
        try:
            if not 200 <= response.status_code < 300:
                text = (await rawhttp.read_error_body(response)).decode("utf-8", "replace")
                # An empty body as " ": SDKError reads the unread stream's `.text` for "".
                raise sdk_errors.SDKError("API error occurred", response, text or " ")
            yield response
        finally:
            await response.aclose()

    async def _complete(self, call: ProviderCall) -> Completion:
        async with self._post(call, stream=False) as raw:
            response = await rawhttp.read_object(raw)
        generations: list[Generation] = []
        for position, choice in enumerate(rawhttp.objects(response, "choices")):
            message = rawhttp.member(choice, "message")
            text, thoughts = wire.parts(message)
            index = rawhttp.integer(choice, "index")
            generations.append(
                Generation(
                    index=position if index is None else index,
                    text=text,
                    finish_reason=map_finish_reason(rawhttp.optional_text(choice, "finish_reason")),
                    tool_calls=wire.tool_calls(message),
                    reasoning=wire.reasoning(thoughts),
                )
            )
        return Completion(sorted(generations, key=lambda g: g.index), _usage(response))

    async def _stream(self, call: ProviderCall) -> AsyncIterator[Chunk]:
        state = wire.StreamState()
        async with self._post(call, stream=True) as response:
            check_event_stream(self.label, response.headers.get("content-type"))
            async for event in rawhttp.events(response, end=rawhttp.DONE):
                chunk = rawhttp.loads_object(event.data, "an event of its stream")
                if "error" in chunk or chunk.get("object") == "error":
                    raise UnreadableAnswer(f"its stream sent an error: {_stream_error(chunk)}")
                for choice in rawhttp.objects(chunk, "choices"):
                    i = rawhttp.integer(choice, "index") or 0
                    delta = rawhttp.member(choice, "delta")
                    text, thoughts = wire.parts(delta)
                    for thought in thoughts:
                        state.think(i, thought)
                    if text:
                        state.said(i)
                    calls = state.fragments(i, delta)
                    thinking = "".join(t.text for t in thoughts)
                    if text or calls or thinking:
                        yield ChunkText(i, text, tool_calls=calls, reasoning=thinking)
                    finish = rawhttp.optional_text(choice, "finish_reason")
                    if finish:
                        yield ChunkEnd(i, map_finish_reason(finish), None, state.signatures(i))
                usage = _usage(chunk)
                if usage is not None:
                    yield ChunkUsage(usage.input_tokens, usage.output_tokens)


def _usage(answer: dict[str, Any]) -> Usage | None:
    usage = rawhttp.member(answer, "usage")
    if usage is None:
        return None
    prompt = rawhttp.integer(usage, "prompt_tokens") or 0
    return Usage(prompt, rawhttp.integer(usage, "completion_tokens") or 0)


def _stream_error(chunk: dict[str, Any]) -> str:
    """An error event's message (Mistral: `message`, or an OpenAI-style `error` object)."""
    error = chunk.get("error", chunk)
    message = error.get("message") if isinstance(error, dict) else error
    return str(message or chunk)[:500]


def request_json(model: Any) -> str:
    """A request model's JSON as the SDK's `utils.serialize_request_body` writes it (its field
    aliases, None left out, compact, ASCII-escaped), without the pydantic model class it creates
    to wrap every body (`marshal_json`: about a third of a call's CPU); a test holds the bytes equal."""
    return json.dumps(model.model_dump(by_alias=True, mode="json", exclude_none=True), separators=(",", ":"))
