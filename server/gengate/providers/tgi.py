"""Hugging Face Text Generation Inference (TGI) and Inference Endpoints through the official
`huggingface_hub` AsyncInferenceClient.

A prompt goes to TGI's own /generate route (text_generation) and chat messages to its
/v1/chat/completions route; both take TGI's `grammar` ({"type": "json" | "regex", "value"}),
so JSON Schema, JSON object, choices (as a regex) and regex are all NATIVE. Lark/GBNF grammars
are refused. TGI has no `n`: the base fans out.

Tools are native on the chat route (TGI compiles the offered tools into its grammar, so a call's
arguments follow their schema): `tools`, `tool_choice` (auto / none / required, a named tool as
`{"type": "function", "function": {"name"}}`), assistant turns with `tool_calls` and `tool`
results, all in the chat-completions form (providers.openai_wire). TGI has no
`parallel_tool_calls` and makes one call per answer; the base's validation holds the switch.
Calls come back with arguments as text, or as a JSON object from older TGI (serialized). TGI's
tool stream ends without a finish reason: a stream that made calls ends with TOOL_CALLS. What TGI
cannot take is refused before any request: tools on a prompt (the raw /generate route has none),
tools beside a structured output (TGI: "Grammar and tools are mutually exclusive"), and an
assistant turn with both text and calls (TGI would read the text and drop the calls). The
endpoint's `reasoning` (or `reasoning_content`) comes back as the generation's reasoning; there
is no reasoning control.

The SDK builds each request (its provider helper's `prepare_request`: the endpoint URL and route,
the payload, the token and Hugging Face headers) and sends it through its own HTTP session
(`AsyncInferenceClient._get_async_client`, with the session's event hooks; gengate builds that
session on aiohttp, providers.transport) with the call's timeout; its `hf_raise_for_status`
(and, for /generate, `raise_text_generation_error`) raises its errors as before. gengate reads
the JSON and the event stream itself, bounded (providers.rawhttp). `_get_async_client` and the
error parser of stream error events are private to the SDK, so its major version is pinned and
tests/providers/test_raw_sdks.py names them.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar

from huggingface_hub import AsyncInferenceClient
from huggingface_hub.errors import HfHubHTTPError, TextGenerationError

from gengate import errors
from gengate.constraints.regex_dialect import ascii_shorthands
from gengate.domain import (
    ChoiceConstraint,
    ConstraintKind,
    Enforcement,
    FinishReason,
    Generation,
    GenerationRequest,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    Role,
    TokenLogprob,
    TopLogprob,
)
from gengate.providers import openai_wire as wire
from gengate.providers import rawhttp, transport
from gengate.providers import structured as so
from gengate.providers.base import (
    Chunk,
    ChunkEnd,
    ChunkText,
    Completion,
    ProviderBackend,
    ProviderCall,
    ProviderOptions,
    check_event_stream,
    map_finish_reason,
)
from gengate.providers.errors import UnreadableAnswer, from_status
from gengate.tools import TOOLS_UNSUPPORTED, first_tool_field

_TGI_ERROR_STATUS = {"OverloadedError": 429, "ValidationError": 422, "IncompleteGenerationError": 500}


class TGIOptions(ProviderOptions):
    """Config keys of a `tgi` model; `base_url` is the endpoint URL, `model` a label for it."""

    model: str = "tgi"
    base_url: str | None = None


def tgi_grammar(plan: so.StructuredPlan) -> dict[str, Any]:
    """The request's constraint as TGI's grammar parameter."""
    c = plan.structured.constraint
    if isinstance(c, JsonSchemaConstraint):
        return {"type": "json", "value": c.schema}
    if isinstance(c, JsonObjectConstraint):
        return {"type": "json", "value": {"type": "object"}}
    if isinstance(c, ChoiceConstraint):
        return {"type": "regex", "value": "|".join(f"(?:{re.escape(choice)})" for choice in c.choices)}
    if isinstance(c, RegexConstraint):
        return {"type": "regex", "value": ascii_shorthands(c.pattern)}
    raise errors.Unimplemented(
        f"TGI cannot enforce a {c.kind.value} constraint", reason="CONSTRAINT_UNSUPPORTED"
    )


def _token_logprob(token: Any, top: Any = None) -> TokenLogprob:
    """A token (a dict or an SDK object) and its top alternatives as logprobs."""
    tops = tuple(
        TopLogprob(rawhttp.text(t, "text"), logprob, rawhttp.integer(t, "id"))
        for t in top or ()
        if (logprob := rawhttp.number(t, "logprob")) is not None
    )
    logprob = rawhttp.number(token, "logprob") or 0.0
    return TokenLogprob(rawhttp.text(token, "text"), logprob, rawhttp.integer(token, "id"), tops)


class TGIBackend(ProviderBackend):
    """A TGI server or Hugging Face Inference Endpoint."""

    kind: ClassVar[str] = "tgi"
    Options: ClassVar[type[ProviderOptions]] = TGIOptions
    label: ClassVar[str] = "TGI"
    structured_support: ClassVar[dict[ConstraintKind, Enforcement]] = {
        ConstraintKind.JSON_SCHEMA: Enforcement.NATIVE,
        ConstraintKind.JSON_OBJECT: Enforcement.NATIVE,
        ConstraintKind.CHOICE: Enforcement.NATIVE,
        ConstraintKind.REGEX: Enforcement.NATIVE,
    }
    native_n: ClassVar[bool] = False
    logprobs_supported: ClassVar[bool] = True
    max_top_logprobs: ClassVar[int] = 5
    raw_prompts: ClassVar[bool] = True  # a prompt goes to /generate as it is
    seed_supported: ClassVar[bool] = True
    requires_api_key: ClassVar[bool] = False  # a local TGI needs none; Inference Endpoints do
    tools_support: ClassVar[Enforcement | None] = Enforcement.NATIVE
    reasoning_output: ClassVar[bool] = True

    def __init__(self, name: str, options: ProviderOptions) -> None:
        super().__init__(name, options)
        self._client: AsyncInferenceClient | None = None

    async def start(self) -> None:
        await super().start()
        if not self.options.base_url:
            raise errors.ConfigError(f"model {self.name!r}: a tgi model needs base_url (the endpoint URL)")
        self._client = self._new_client(self.options.timeout)

    def _new_client(self, timeout: float) -> AsyncInferenceClient:
        # With no key configured the SDK would fall back to a Hugging Face token stored on this
        # machine (`hf auth login`) and send it to whatever endpoint the config names: an explicit
        # empty Authorization header overrides that fallback.
        headers = None if self.api_key else {"authorization": ""}
        return _InferenceClient(
            model=self.options.base_url, token=self.api_key, timeout=timeout, headers=headers
        )

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()  # type: ignore[no-untyped-call]
            self._client = None

    @property
    def client(self) -> AsyncInferenceClient:
        if self._client is None:
            raise RuntimeError(f"model {self.name!r} used before start()")
        return self._client

    def plan_structured(self, req: GenerationRequest, level: Enforcement) -> so.StructuredPlan:
        assert req.structured_output is not None
        return so.StructuredPlan(req.structured_output, level, native=True)

    def _prepare(self, req: GenerationRequest) -> ProviderCall:
        """The base's checks, then the tool requests TGI cannot take (see the module docstring)."""
        call = super()._prepare(req)
        where = first_tool_field(req)
        if where is None:
            return call
        if req.messages is None:
            raise _refused(
                where, "TGI's raw prompt route (/generate) takes no tools: send the prompt as messages"
            )
        if req.tools and call.plan is not None:
            raise _refused(
                "structured_output", "TGI cannot take tools and a structured output in one request"
            )
        for i, m in enumerate(req.messages):
            if m.role is Role.ASSISTANT and m.tool_calls and m.text:
                raise errors.InvalidArgument.field(
                    f"messages.messages[{i}].content",
                    "is set beside tool_calls: TGI takes an assistant turn's calls or its text, not both",
                )
        return call

    def normalize_error(self, exc: BaseException) -> errors.GengateError:
        # text_generation re-raises TGI's typed errors without the HTTP status: use the cause.
        if isinstance(exc, TextGenerationError):
            cause = exc.__cause__
            response = getattr(cause, "response", None) if isinstance(cause, HfHubHTTPError) else None
            status = getattr(response, "status_code", None) or _TGI_ERROR_STATUS.get(type(exc).__name__, 500)
            headers = {str(k): str(v) for k, v in dict(getattr(response, "headers", {}) or {}).items()}
            return from_status(
                status, str(exc), headers=headers, provider=self.label, error_type=type(exc).__name__
            )
        return super().normalize_error(exc)

    def _generate_params(self, call: ProviderCall) -> dict[str, Any]:
        req = call.request
        s = req.sampling
        params: dict[str, Any] = {
            "details": True,
            "max_new_tokens": req.stopping.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seed": s.seed,
            "repetition_penalty": s.repetition_penalty,
            "frequency_penalty": s.frequency_penalty,
            "stop": list(req.stopping.stop) or None,
            "top_n_tokens": req.logprobs or None,
        }
        if s.temperature is not None and s.temperature > 0:
            params["do_sample"] = True
        if call.plan is not None:
            params["grammar"] = tgi_grammar(call.plan)
        return {k: v for k, v in params.items() if v is not None}

    def _chat_params(self, call: ProviderCall) -> dict[str, Any]:
        req = call.request
        s = req.sampling
        params: dict[str, Any] = {
            "messages": wire.messages(call),
            "max_tokens": req.stopping.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
            "frequency_penalty": s.frequency_penalty,
            "presence_penalty": s.presence_penalty,
            "stop": list(req.stopping.stop) or None,
            "logprobs": True if req.logprobs is not None else None,
            "top_logprobs": req.logprobs or None,
        }
        if call.plan is not None:
            params["response_format"] = tgi_grammar(call.plan)
        if req.tools:
            params["tools"] = [wire.tool(t) for t in req.tools]
        if req.tool_choice is not None:
            params["tool_choice"] = wire.tool_choice(req.tool_choice)
        return {k: v for k, v in params.items() if v is not None}

    @contextlib.asynccontextmanager
    async def _post(self, call: ProviderCall, *, stream: bool) -> AsyncIterator[rawhttp.RawResponse]:
        """One request built and sent by the SDK (module docstring), answered unread: /generate
        for a prompt, the chat route for messages. The response is closed on leaving."""
        from huggingface_hub.inference._common import raise_text_generation_error
        from huggingface_hub.inference._providers import get_provider_helper
        from huggingface_hub.utils._http import hf_raise_for_status

        sdk = self.client
        inputs: Any
        if call.request.messages is None:
            task, inputs, extra = "text-generation", call.request.prompt or "", {"stream": stream}
            parameters = self._generate_params(call)
        else:
            parameters = {"model": sdk.model, **self._chat_params(call), "stream": stream}
            task, inputs, extra = "conversational", parameters.pop("messages"), None
        helper = get_provider_helper(sdk.provider, task=task, model=sdk.model)
        request = helper.prepare_request(
            inputs=inputs,
            parameters=parameters,
            extra_payload=extra,
            headers=sdk.headers,
            model=sdk.model,
            api_key=sdk.token,
        )
        http = await sdk._get_async_client()  # type: ignore[no-untyped-call]
        async with http.stream(
            "POST",
            request.url,
            json=request.json,
            data=request.data,
            headers=request.headers,
            cookies=sdk.cookies,
            timeout=call.timeout,
        ) as response:
            if response.status_code >= 400:
                response = await rawhttp.read_error(response)
            try:
                hf_raise_for_status(response)
            except HfHubHTTPError as exc:
                if exc.response.status_code == 422 and exc.response.text:  # as the SDK's _inner_post adds it
                    exc.args = (f"{exc.args[0]}\n{exc.response.text}\n", *exc.args[1:])
                if task == "text-generation":
                    raise_text_generation_error(exc)
                raise
            yield response

    async def _complete(self, call: ProviderCall) -> Completion:
        async with self._post(call, stream=False) as raw:
            body = await rawhttp.read_body(raw)
        if call.request.messages is not None:
            response = rawhttp.loads_object(body)
            generations = [wire.chat_generation(c) for c in rawhttp.objects(response, "choices")]
            return Completion(generations, wire.usage(response))
        data = rawhttp.loads(body)
        if isinstance(data, list):  # some servers answer a list of one
            data = data[0] if data else None
        if not isinstance(data, dict):
            raise UnreadableAnswer("its body is no JSON object")
        details = rawhttp.member(data, "details")
        logprobs = None
        if call.request.logprobs is not None and details is not None:
            tokens = rawhttp.objects(details, "tokens")
            tops = list(rawhttp.items(details, "top_tokens")) or [None] * len(tokens)
            logprobs = tuple(_token_logprob(t, top) for t, top in zip(tokens, tops, strict=False))
        generation = Generation(
            index=0,
            text=rawhttp.text(data, "generated_text"),
            finish_reason=map_finish_reason(
                rawhttp.optional_text(details, "finish_reason") if details is not None else None
            ),
            output_tokens=(rawhttp.integer(details, "generated_tokens") or 0) if details is not None else 0,
            logprobs=logprobs,
        )
        return Completion([generation])

    async def _stream(self, call: ProviderCall) -> AsyncIterator[Chunk]:
        async with self._post(call, stream=True) as response:
            check_event_stream(self.label, response.headers.get("content-type"))
            if call.request.messages is None:
                async for payload in _payloads(response):
                    token = rawhttp.member(payload, "token")
                    if token is None:
                        raise UnreadableAnswer("a stream event has no `token`")
                    if not rawhttp.field(token, "special"):
                        logprobs = (_token_logprob(token),) if call.request.logprobs is not None else None
                        yield ChunkText(0, rawhttp.text(token, "text"), logprobs)
                    details = rawhttp.member(payload, "details")
                    if details is not None:
                        yield ChunkEnd(0, map_finish_reason(rawhttp.optional_text(details, "finish_reason")))
                return
            called: set[int] = set()
            ended: set[int] = set()
            async for chunk in _payloads(response):
                for choice in rawhttp.objects(chunk, "choices"):
                    index = rawhttp.integer(choice, "index") or 0
                    delta = rawhttp.member(choice, "delta")
                    calls = wire.tool_call_deltas(delta) if delta is not None else ()
                    thought = wire.reasoning_text(delta) if delta is not None else ""
                    content = rawhttp.text(delta, "content") if delta is not None else ""
                    if calls:
                        called.add(index)
                    if content or calls or thought:
                        yield ChunkText(index, content, tool_calls=calls, reasoning=thought)
                    finish = rawhttp.optional_text(choice, "finish_reason")
                    if finish:
                        ended.add(index)
                        yield ChunkEnd(index, map_finish_reason(finish))
            for index in sorted(called - ended):  # TGI ends a tool stream without a finish reason
                yield ChunkEnd(index, FinishReason.TOOL_CALLS)


class _InferenceClient(AsyncInferenceClient):
    """The SDK's client with its HTTP session (`_get_async_client`'s: the SDK's event hooks, its
    redirects, no default timeout) on aiohttp (providers.transport), closed with the client."""

    async def _get_async_client(self) -> Any:
        from huggingface_hub.utils import _http

        if self._async_client is None:
            session = transport.httpx2_client(
                event_hooks={
                    "request": [_http.async_hf_request_event_hook],
                    "response": [_http.async_hf_response_event_hook],
                },
                follow_redirects=True,
                timeout=None,
            )
            self._async_client = await self.exit_stack.enter_async_context(session)
        return self._async_client


async def _payloads(response: rawhttp.RawResponse) -> AsyncIterator[Mapping[str, Any]]:
    """The stream's events as JSON objects until `[DONE]`; an error event raises the SDK's
    typed TGI error (OverloadedError, ValidationError...), as its stream did."""
    from huggingface_hub.inference._common import _parse_text_generation_error

    async for event in rawhttp.events(response, end=rawhttp.DONE):
        payload = rawhttp.loads_object(event.data, "an event of its stream")
        if payload.get("error") is not None:
            raise _parse_text_generation_error(payload["error"], payload.get("error_type"))
        yield payload


def _refused(field_name: str, why: str) -> errors.Unimplemented:
    """UNIMPLEMENTED TOOLS_UNSUPPORTED for a tool request TGI cannot take, naming the field."""
    return errors.Unimplemented(
        why, reason=TOOLS_UNSUPPORTED, violations=[errors.FieldViolation(field_name, why)]
    )
