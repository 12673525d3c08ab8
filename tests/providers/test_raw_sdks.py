"""The raw provider path of the Mistral, TGI and Gemini backends: their SDKs build and send the
request, gengate reads the answer (providers.rawhttp). First the SDK hooks each backend relies on,
checked by name (a pinned SDK that drops one fails here, saying which); then each backend against
its fake answering malformed, oversized and failing upstreams: UPSTREAM_BAD_RESPONSE naming the
field, the size limits holding, and non-2xx answers still mapped through the SDK's own errors."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import contract_checks as cc
import pytest
from fakehttp import FakeServer, Fault
from gengate import errors
from gengate.domain import ChatMessage, GenerationDelta, GenerationRequest, Role, TextPart
from gengate.providers import rawhttp
from gengate.providers.errors import UPSTREAM_BAD_RESPONSE, UPSTREAM_PROTOCOL
from pydantic import SecretStr

# --- the SDK hooks, by name ----------------------------------------------------------------------


_has = cc.sdk_hook


def test_mistralai_hooks_are_there() -> None:
    pytest.importorskip("mistralai", reason="the mistralai SDK is not installed")
    from mistralai.client import basesdk, errors, models, utils
    from mistralai.client._hooks import HookContext

    _has(
        basesdk.BaseSDK,
        "_build_request_async",
        "method",
        "path",
        "base_url",
        "url_variables",
        "request",
        "request_body_required",
        "request_has_path_params",
        "request_has_query_params",
        "user_agent_header",
        "accept_header_value",
        "security",
        "get_serialized_body",
        "timeout_ms",
    )
    _has(basesdk.BaseSDK, "do_request_async", "hook_ctx", "request", "is_error_status_code", "stream")
    _has(basesdk.BaseSDK, "_get_url", "base_url", "url_variables")
    _has(HookContext, "__init__", "config", "base_url", "operation_id", "security_source", "tags")
    for name in (
        "serialize_request_body",
        "SerializedRequestBody",
        "match_status_codes",
        "get_security_from_env",
    ):
        _has(utils, name)
    for name in ("ChatCompletionRequest", "ChatCompletionStreamRequest", "Security"):
        _has(models, name)
    _has(errors.SDKError, "__init__", "message", "raw_response", "body")


def test_huggingface_hub_hooks_are_there() -> None:
    pytest.importorskip("huggingface_hub", reason="the huggingface_hub SDK is not installed")
    from huggingface_hub import AsyncInferenceClient
    from huggingface_hub.inference import _common
    from huggingface_hub.inference._providers import _common as providers_common
    from huggingface_hub.inference._providers import get_provider_helper
    from huggingface_hub.utils import _http

    _has(AsyncInferenceClient, "_get_async_client")
    assert callable(get_provider_helper), "huggingface_hub.inference._providers.get_provider_helper is gone"
    _has(
        providers_common.TaskProviderHelper,
        "prepare_request",
        "inputs",
        "parameters",
        "headers",
        "model",
        "api_key",
        "extra_payload",
    )
    _has(_http, "hf_raise_for_status")
    _has(_common, "raise_text_generation_error")
    _has(_common, "_parse_text_generation_error")


def test_google_genai_hooks_are_there() -> None:
    """The request path providers.gemini_raw drives, and the continuation it re-implements."""
    pytest.importorskip("google.genai", reason="the google-genai SDK is not installed")
    from gengate.providers import gemini_raw
    from google import genai
    from google.genai import _api_client, _common, _extra_utils, models, types
    from google.genai import errors as genai_errors

    converter = ("api_client", "from_object", "parent_object", "root_object")
    _has(models, "_GenerateContentParameters_to_mldev", *converter)
    _has(models, "_GenerateContentParameters_to_vertex", *converter)
    _has(types, "_GenerateContentParameters")
    assert {"model", "contents", "config"} <= set(types._GenerateContentParameters.model_fields)
    _has(_common, "convert_to_dict", "obj")
    _has(_common, "encode_unserializable_types", "data")
    _has(_api_client.BaseApiClient, "_build_request", "http_method", "path", "request_dict", "http_options")
    _has(_api_client.BaseApiClient, "_async_request", "http_request", "http_options", "stream")
    _has(_api_client.BaseApiClient, "_async_request_once", "http_request", "stream")
    _has(_api_client.HttpResponse, "__init__", "headers", "response_stream")
    _has(genai_errors.APIError, "raise_error_async", "status_code", "response_json", "response")
    client = genai.Client(api_key="k")
    assert isinstance(client.aio.models._api_client, _api_client.BaseApiClient)
    assert {"continuation_token", "automatic_continuation"} <= set(types.GenerateContentConfig.model_fields)
    assert types.FinishReason.CONTINUATION.value == gemini_raw.CONTINUATION
    # The SDK's own continuation, which the raw path does in its place: still there, still so.
    _has(models.AsyncModels, "_generate_content_with_continuation", "model", "contents", "config")
    _has(models.AsyncModels, "_generate_content_stream_with_continuation", "model", "contents", "config")
    for name in ("should_continue_generation", "merge_continuation_responses", "is_resumable_finish_reason"):
        _has(_extra_utils, name)
    _has(_extra_utils.StreamContinuation, "end_hop", "error")
    assert _extra_utils.MAX_STREAM_RECONNECTS_WITHOUT_PROGRESS == gemini_raw.MAX_STALLS


def _gemini_requests() -> list[GenerationRequest]:
    """Requests using every part of the Gemini request gengate builds."""
    import base64

    from gengate.domain import (
        ImagePart,
        JsonSchemaConstraint,
        Reasoning,
        ReasoningControl,
        SamplingParams,
        StoppingCriteria,
        StructuredOutput,
        ToolCall,
        ToolChoice,
    )
    from tool_requests import CLOCK, PARIS, WEATHER, ask

    signed = Reasoning("thinking", ("call:0:" + base64.urlsafe_b64encode(b"\xfb\xffsig").decode(),))
    turns = (
        ChatMessage(Role.SYSTEM, (TextPart("Be brief."),)),
        ChatMessage(Role.USER, (TextPart("Weather?"), ImagePart(data=b"\x89PNG", mime_type="image/png"))),
        ChatMessage(Role.ASSISTANT, (), tool_calls=(ToolCall("c1", "get_weather", PARIS),), reasoning=signed),
        ChatMessage(Role.TOOL, (TextPart('{"temp": 21}'),), tool_call_id="c1"),
        ChatMessage(Role.USER, (ImagePart(url="gs://b/cat.png", mime_type="image/png"),)),
    )
    sampling = SamplingParams(temperature=0.5, top_p=0.9, top_k=40, seed=7, presence_penalty=0.1)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    return [
        chat(),
        ask(
            WEATHER,
            CLOCK,
            tool_choice=ToolChoice(name="get_time"),
            reasoning=ReasoningControl(budget_tokens=64),
        ),
        GenerationRequest(
            model="m",
            messages=turns,
            n=2,
            sampling=sampling,
            stopping=StoppingCriteria(max_tokens=50, stop=("END",)),
            tools=(WEATHER,),
            reasoning=ReasoningControl(enabled=True),
        ),
        GenerationRequest(
            model="m",
            messages=turns[:2],
            structured_output=StructuredOutput(JsonSchemaConstraint(schema)),
        ),
    ]


@pytest.mark.parametrize("vertexai", [False, True])
async def test_gemini_request_bodies_are_the_sdks(vertexai: bool) -> None:
    """The converters fed the parameters as a dict (gemini_raw.hop_request) build the body and
    path the SDK's own `_generate_content` builds from its pydantic parameters."""
    pytest.importorskip("google.genai", reason="the google-genai SDK is not installed")
    from gengate.providers import gemini_raw
    from gengate.providers.gemini import GeminiBackend
    from google.genai import _common, models, types

    options: dict[str, Any] = {"model": "gemini-test", "api_key": SecretStr("k"), "vertexai": vertexai}
    backend = GeminiBackend("gemini", GeminiBackend.Options(**options))
    await backend.start()
    try:
        api = backend.client.aio.models._api_client
        convert = (
            models._GenerateContentParameters_to_vertex
            if vertexai
            else models._GenerateContentParameters_to_mldev
        )
        for req in _gemini_requests():
            request = backend._request(backend._prepare(req))
            for token in (None, b"\xfftoken"):
                path, body, http_options = gemini_raw.hop_request(
                    api, request, stream=True, token=token, timeout_s=2.5
                )
                update: dict[str, Any] = {"http_options": types.HttpOptions(timeout=2500)}
                if token:
                    update["continuation_token"] = token
                config = request["config"].model_copy(update=update)
                params = types._GenerateContentParameters(
                    model=request["model"], contents=request["contents"], config=config
                )
                want = convert(api, params, None, params)
                assert path == "{model}:streamGenerateContent?alt=sse".format_map(want["_url"])
                want.pop("config", None)
                assert body == _common.encode_unserializable_types(_common.convert_to_dict(want))
                assert params.config is not None and http_options == params.config.http_options
                assert ("continuationToken" in body) is (token is not None)
    finally:
        await backend.aclose()


# --- the backends against their fakes ------------------------------------------------------------


def answer_with(server: FakeServer, body: Any, content_type: str = "application/json") -> None:
    text = body if isinstance(body, str) else json.dumps(body)
    server.fail_next(Fault(status=200, body=text, content_type=content_type))


def sse(*events: Any) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


def chat(text: str = "Say hello") -> GenerationRequest:
    return GenerationRequest(model="m", messages=(ChatMessage(Role.USER, (TextPart(text),)),))


@dataclass
class Case:
    """One backend's fake, its answers' shapes and what it answers wrong."""

    name: str
    backend: Callable[[], Any]
    fake: Callable[[], Any]
    options: Callable[[Any], dict[str, Any]]
    request: Callable[[], GenerationRequest]
    malformed: dict[str, tuple[Any, str]]
    # Stream events: a good text event, and one malformed in a named field.
    good_event: dict[str, Any]
    bad_event: tuple[dict[str, Any], str]
    error_body: dict[str, Any]


def _mistral_choice(**message: Any) -> dict[str, Any]:
    good = {"role": "assistant", "content": "hi"} | message
    return {"id": "x", "choices": [{"index": 0, "message": good, "finish_reason": "stop"}]}


def _mistral() -> Case:
    pytest.importorskip("mistralai", reason="the mistralai SDK is not installed")
    from fake_mistral import API_KEY, FakeMistral
    from gengate.providers.mistral import MistralBackend

    def delta(content: Any) -> dict[str, Any]:
        return {"id": "x", "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}

    return Case(
        name="Mistral",
        backend=lambda: MistralBackend,
        fake=FakeMistral,
        options=lambda f: {"model": "mistral-test", "base_url": f.server.base_url, "api_key": API_KEY},
        request=cc.prompt,
        malformed={
            "no JSON": ('{"choices": [', "is no JSON"),
            "choices an object": ({"choices": {"0": {}}}, "`choices` is a object, not a list"),
            "content a number": (_mistral_choice(content=7), "`content` is a number"),
            "a thinking chunk's text a list": (
                _mistral_choice(content=[{"type": "thinking", "thinking": [{"type": "text", "text": []}]}]),
                "`text` is a list",
            ),
            "tool call name a number": (
                _mistral_choice(tool_calls=[{"id": "abcdefghi", "function": {"name": 5, "arguments": "{}"}}]),
                "`name` is a number",
            ),
            "tool call without function": (_mistral_choice(tool_calls=[{"id": "abcdefghi"}]), "`function`"),
            "usage text": (
                _mistral_choice() | {"usage": {"prompt_tokens": "3", "completion_tokens": 1}},
                "`prompt_tokens` is a string",
            ),
        },
        good_event=delta("Hey"),
        bad_event=(delta(["not", "chunks"]), "an entry of `content` is a string"),
        error_body={"message": "slow down"},
    )


def _tgi() -> Case:
    pytest.importorskip("huggingface_hub", reason="the huggingface_hub SDK is not installed")
    from fake_tgi import API_KEY, FakeTGI
    from gengate.providers.tgi import TGIBackend

    def token(text: Any, **extra: Any) -> dict[str, Any]:
        return {"index": 1, "token": {"id": 1, "text": text, "logprob": -0.1, "special": False}} | extra

    return Case(
        name="TGI",
        backend=lambda: TGIBackend,
        fake=FakeTGI,
        options=lambda f: {"model": "tgi-test", "base_url": f.server.base_url, "api_key": API_KEY},
        request=cc.prompt,  # /generate; the chat route is the OpenAI wire, tested below
        malformed={
            "no JSON": ("{", "is no JSON"),
            "a list of a string": (["x"], "no JSON object"),
            "generated_text a number": ({"generated_text": 5}, "`generated_text` is a number"),
            "details a list": ({"generated_text": "x", "details": []}, "`details` is a list"),
            "generated tokens text": (
                {"generated_text": "x", "details": {"finish_reason": "length", "generated_tokens": "1"}},
                "`generated_tokens` is a string",
            ),
        },
        good_event=token("Hey"),
        bad_event=(token(["x"]), "`text` is a list"),
        error_body={"error": "Model is overloaded", "error_type": "overloaded"},
    )


def _gemini_answer(*parts: Any, **candidate: Any) -> dict[str, Any]:
    good = {"content": {"parts": list(parts) or [{"text": "hi"}], "role": "model"}, "index": 0}
    return {"candidates": [good | {"finishReason": "STOP"} | candidate]}


def _gemini() -> Case:
    pytest.importorskip("google.genai", reason="the google-genai SDK is not installed")
    from fake_gemini import API_KEY, FakeGemini
    from gengate.providers.gemini import GeminiBackend

    def chunk(text: Any) -> dict[str, Any]:
        return {"candidates": [{"content": {"parts": [{"text": text}], "role": "model"}, "index": 0}]}

    return Case(
        name="Gemini",
        backend=lambda: GeminiBackend,
        fake=FakeGemini,
        options=lambda f: {"model": "gemini-test", "base_url": f.server.base_url, "api_key": API_KEY},
        request=cc.prompt,
        malformed={
            "no JSON": ('{"candidates": [', "is no JSON"),
            "a list": ([{"candidates": []}], "is a JSON list, not an object"),
            "candidates an object": ({"candidates": {"0": {}}}, "`candidates` is a object, not a list"),
            "content a list": ({"candidates": [{"content": []}]}, "`content` is a list, not an object"),
            "parts text": ({"candidates": [{"content": {"parts": "hi"}}]}, "`parts` is a string, not a list"),
            "text a number": (_gemini_answer({"text": 7}), "`text` is a number"),
            "thought a string": (_gemini_answer({"text": "x", "thought": "yes"}), "`thought` is a string"),
            "call name a number": (_gemini_answer({"functionCall": {"name": 5}}), "`name` is a number"),
            "call args a list": (
                _gemini_answer({"functionCall": {"name": "f", "args": [1]}}),
                "`args` is a list, not an object",
            ),
            "signature no base64": (
                _gemini_answer({"text": "x", "thoughtSignature": "!!"}),
                "`thoughtSignature` is no base64",
            ),
            "finish reason a number": (_gemini_answer(finishReason=3), "`finishReason` is a number"),
            "index text": (_gemini_answer(index="0"), "`index` is a string"),
            "continuation token a number": (
                _gemini_answer(finishReason="CONTINUATION", continuationToken=5),
                "`continuationToken` is a number",
            ),
            "usage text": (
                _gemini_answer() | {"usageMetadata": {"promptTokenCount": "3", "candidatesTokenCount": 1}},
                "`promptTokenCount` is a string",
            ),
        },
        good_event=chunk("Hey"),
        bad_event=(chunk(["x"]), "`text` is a list"),
        error_body={"error": {"code": 429, "message": "slow down", "status": "RESOURCE_EXHAUSTED"}},
    )


CASES = {"mistral": _mistral, "tgi": _tgi, "gemini": _gemini}


@pytest.fixture(scope="module", params=list(CASES))
def case_fake(request: pytest.FixtureRequest) -> Iterator[tuple[Case, Any]]:
    case = CASES[request.param]()
    fake = case.fake()
    fake.start()
    try:
        yield case, fake
    finally:
        fake.stop()


@pytest.fixture
async def make(case_fake: tuple[Case, Any]) -> AsyncIterator[cc.Make]:
    case, fake = case_fake
    async with cc.backends(
        case.backend(), case.name.lower(), fake, **case.options(fake), max_retries=0
    ) as build:
        yield build


async def test_a_malformed_answer_is_unreadable_naming_the_field_and_the_next_call_works(
    make: cc.Make, case_fake: tuple[Case, Any]
) -> None:
    case, fake = case_fake
    backend = await make()
    for label, (body, why) in case.malformed.items():
        answer_with(fake.server, body)
        with pytest.raises(errors.Unavailable) as info:
            await backend.generate(case.request())
        assert info.value.reason == UPSTREAM_BAD_RESPONSE, label
        assert f"{case.name} sent a response gengate could not read" in info.value.message, label
        assert why in info.value.message, (label, info.value.message)
    fake.answers.append("fine again")
    assert (await backend.generate(case.request())).generations[0].text == "fine again"


async def test_a_body_over_the_limit_is_unreadable(
    make: cc.Make, case_fake: tuple[Case, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    case, fake = case_fake
    monkeypatch.setattr(rawhttp, "MAX_BODY_BYTES", 300)
    backend = await make()
    fake.answers.append("x " * 400)
    with pytest.raises(errors.Unavailable) as info:
        await backend.generate(case.request())
    assert info.value.reason == UPSTREAM_BAD_RESPONSE and "over gengate's limit of 300" in info.value.message
    fake.answers.append("short")
    assert (await backend.generate(case.request())).generations[0].text == "short"


async def test_stream_faults_are_precise_errors(
    make: cc.Make, case_fake: tuple[Case, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    case, fake = case_fake
    backend = await make()

    async def fails(body: str, content_type: str = "text/event-stream") -> errors.GengateError:
        answer_with(fake.server, body, content_type)
        with pytest.raises(errors.GengateError) as info:
            await cc.collect(backend.generate_stream(case.request()))
        return info.value

    bad, why = case.bad_event
    error = await fails(sse(case.good_event, bad))
    assert error.reason == UPSTREAM_BAD_RESPONSE and why in error.message, error.message
    error = await fails(sse(case.good_event, "{not json"))
    assert error.reason == UPSTREAM_BAD_RESPONSE and "an event of its stream is no JSON" in error.message
    error = await fails('{"not": "a stream"}', "application/json")
    assert isinstance(error, errors.Unavailable) and error.reason == UPSTREAM_PROTOCOL
    monkeypatch.setattr(rawhttp, "MAX_EVENT_BYTES", 2000)
    error = await fails(sse(case.good_event) + "data: " + "x" * 5000)
    assert error.reason == UPSTREAM_BAD_RESPONSE and "over gengate's limit of 2000" in error.message
    fake.answers.append("still here")
    events = await cc.collect(backend.generate_stream(case.request()))
    assert "".join(e.text for e in events if isinstance(e, GenerationDelta)).replace(" ", "") == "stillhere"


async def test_status_errors_are_the_sdks_mapped_as_before(
    make: cc.Make, case_fake: tuple[Case, Any]
) -> None:
    """A non-2xx answer still raises the SDK's own error, for unary and stream alike."""
    case, fake = case_fake
    backend = await make()
    for call in (backend.generate(case.request()), cc.collect(backend.generate_stream(case.request()))):
        fake.server.fail_next(Fault(status=429, body=case.error_body, headers={"retry-after": "7"}))
        with pytest.raises(errors.ResourceExhausted) as info:
            await call
        assert info.value.retry_after_s == 7.0
        assert "slow down" in info.value.message or "overloaded" in info.value.message
    fake.server.fail_next(Fault(status=503, body="<html>down</html>", content_type="text/html"))
    # huggingface_hub's HfHubHTTPError names the status, not an HTML body (as before).
    with pytest.raises(errors.Unavailable, match="503" if case.name == "TGI" else "down"):
        await backend.generate(case.request())


async def test_an_error_body_over_the_limit_is_unreadable_before_the_sdk_reads_it(
    make: cc.Make, case_fake: tuple[Case, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-2xx body is read bounded too (rawhttp.ERROR_BODY_BYTES), never whole into the SDK's
    error."""
    case, fake = case_fake
    monkeypatch.setattr(rawhttp, "ERROR_BODY_BYTES", 300)
    backend = await make()
    fake.server.fail_next(Fault(status=500, body={"error": "x" * 5000}))
    with pytest.raises(errors.Unavailable) as info:
        await backend.generate(case.request())
    assert info.value.reason == UPSTREAM_BAD_RESPONSE and "over gengate's limit of 300" in info.value.message
    fake.answers.append("after")
    assert (await backend.generate(case.request())).generations[0].text == "after"


async def test_tgi_chat_route_reads_raw_with_its_faults() -> None:
    pytest.importorskip("huggingface_hub", reason="the huggingface_hub SDK is not installed")
    from fake_tgi import API_KEY, FakeTGI
    from gengate.providers.tgi import TGIBackend

    fake = FakeTGI()
    base = fake.start()
    try:
        async with cc.backends(
            TGIBackend, "tgi", fake, base_url=base, api_key=API_KEY, max_retries=0
        ) as make:
            backend = await make()
            answer_with(fake.server, {"choices": [{"index": 0, "message": {"content": ["x"]}}]})
            with pytest.raises(errors.Unavailable) as info:
                await backend.generate(chat())
            assert info.value.reason == UPSTREAM_BAD_RESPONSE and "`content` is a list" in info.value.message
            # An error event mid-stream: the SDK's typed TGI error, as its stream raised it.
            error = {"error": "Request failed during generation: overloaded", "error_type": "overloaded"}
            delta = {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}
            answer_with(fake.server, sse(delta, error), "text/event-stream")
            with pytest.raises(errors.ResourceExhausted, match="overloaded"):
                await cc.collect(backend.generate_stream(chat()))
            fake.answers.append("all good")
            events = await cc.collect(backend.generate_stream(chat()))
            assert (
                "".join(e.text for e in events if isinstance(e, GenerationDelta)).replace(" ", "")
                == "allgood"
            )
    finally:
        fake.stop()
