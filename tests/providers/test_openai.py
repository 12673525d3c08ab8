"""OpenAI-family backends driven through the real `openai` SDK against a loopback chat API (and
its text completions route, which vLLM's and llama.cpp's servers take a prompt on)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

pytest.importorskip("openai", reason="the openai SDK is not installed (extra: gengate[openai])")

import contract_checks as cc
from fake_openai import API_KEY, FakeOpenAI
from fakehttp import Fault
from gengate import errors
from gengate.domain import (
    ChatMessage,
    ChoiceConstraint,
    ConstraintKind,
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GrammarConstraint,
    GrammarSyntax,
    ImagePart,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    Role,
    SamplingParams,
    StoppingCriteria,
    StreamStart,
    StructuredOutput,
    TextPart,
    Usage,
)
from gengate.providers import openai as oai
from gengate.providers.ollama import OllamaBackend
from gengate.registry import backend_class
from pydantic import SecretStr


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI()
    server.start()
    yield server
    server.stop()


def builder(fake: FakeOpenAI, cls: type[oai.OpenAIBackend], made: list[oai.OpenAIBackend]) -> cc.Make:
    async def build(**overrides: Any) -> oai.OpenAIBackend:
        url = fake.server.base_url if cls is oai.AzureOpenAIBackend else fake.server.base_url + "/v1"
        opts: dict[str, Any] = {
            "model": "gpt-test",
            "base_url": url,
            "api_key": SecretStr(API_KEY),
            "timeout": 5.0,
            "max_retries": 1,
        } | overrides
        if isinstance(opts["api_key"], str):
            opts["api_key"] = SecretStr(opts["api_key"])
        if cls is oai.VLLMServerBackend:
            opts.setdefault("canary", False)
        backend = cls("gpt", cls.Options(**opts))
        await backend.start()
        made.append(backend)
        return backend

    return build  # type: ignore[return-value]


@pytest.fixture
async def made(fake: FakeOpenAI) -> AsyncIterator[list[oai.OpenAIBackend]]:
    fake.reset()
    backends: list[oai.OpenAIBackend] = []
    yield backends
    for backend in backends:
        await backend.aclose()


@pytest.fixture
def make(fake: FakeOpenAI, made: list[oai.OpenAIBackend]) -> cc.Make:
    return builder(fake, oai.OpenAIBackend, made)


FAMILY = [
    oai.OpenAIBackend,
    oai.AzureOpenAIBackend,
    oai.TogetherBackend,
    oai.GroqBackend,
    oai.AnyscaleBackend,
    oai.VLLMServerBackend,
    oai.SGLangBackend,
    oai.LlamaCppServerBackend,
    oai.OpenAICompatibleBackend,
    OllamaBackend,
]


@pytest.fixture(params=FAMILY, ids=lambda c: c.kind)
def family_make(request: pytest.FixtureRequest, fake: FakeOpenAI, made: list[oai.OpenAIBackend]) -> cc.Make:
    cls: type[oai.OpenAIBackend] = request.param
    if not cls.native_n:
        fake.ignore_n = True  # behave like the real server: one choice per request
    return builder(fake, cls, made)


# --- the behaviours every provider must show, for every member of the family -------------------


async def test_family_text(family_make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_text(family_make, fake)


async def test_family_stream(family_make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_stream(family_make, fake)
    assert fake.server.requests[-1].body["stream_options"] == {"include_usage": True}


async def test_family_streams_keep_the_upstream_connection(family_make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_streams_keep_the_connection(family_make, fake)


async def test_family_n2(family_make: cc.Make, fake: FakeOpenAI) -> None:
    backend_native = not fake.ignore_n
    await cc.check_n2(family_make, fake, native=backend_native)


RAW_PROMPT_KINDS = {"vllm_server", "llamacpp_server"}  # the README's magpie column, written out
CHATML_PRE_QUERY = "<|im_start|>user\n"  # Magpie's qwen2 pre-query: only a raw route can take it


async def test_family_prompt_route(family_make: cc.Make, fake: FakeOpenAI) -> None:
    """A prompt goes raw to /v1/completions on the raw-prompt servers, as one user message on
    chat elsewhere; messages always go to chat. (The family checks above thus run each route.)"""
    backend = await family_make()
    assert backend.capabilities.raw_prompt == (backend.kind in RAW_PROMPT_KINDS)
    await backend.generate(cc.prompt(CHATML_PRE_QUERY))
    await backend.generate(_chat(ChatMessage(Role.USER, (TextPart("hi"),))))
    prompt, chat = fake.server.requests
    azure = backend.kind == "azure_openai"
    chat_path = "/openai/deployments/gpt-test/chat/completions" if azure else "/v1/chat/completions"
    if backend.kind in RAW_PROMPT_KINDS:
        assert prompt.path == "/v1/completions" and "messages" not in prompt.body
        assert prompt.body["prompt"] == CHATML_PRE_QUERY  # as given, not wrapped in a chat template
    else:
        assert prompt.path == chat_path
        assert prompt.body["messages"] == [{"role": "user", "content": CHATML_PRE_QUERY}]
    assert chat.path == chat_path and "prompt" not in chat.body
    assert chat.body["messages"] == [{"role": "user", "content": "hi"}]


# What the README's provider table promises for a JSON Schema, written out here rather than read
# from the backend under test, so a backend that starts claiming another level fails.
JSON_SCHEMA_ENFORCEMENT = {
    "openai": Enforcement.NATIVE,
    "azure_openai": Enforcement.NATIVE,
    "together": Enforcement.NATIVE,
    "groq": Enforcement.NATIVE,
    "anyscale": Enforcement.NATIVE,
    "vllm_server": Enforcement.NATIVE,
    "sglang": Enforcement.NATIVE,
    "llamacpp_server": Enforcement.VALIDATED,  # its schema conversion skips minimum/maximum
    "openai_compatible": Enforcement.VALIDATED,  # an unknown server: checked, not trusted
    "ollama": Enforcement.NATIVE,
}


async def test_family_json_schema(family_make: cc.Make, fake: FakeOpenAI) -> None:
    backend = await family_make()
    assert set(JSON_SCHEMA_ENFORCEMENT) == {cls.kind for cls in FAMILY}
    level = JSON_SCHEMA_ENFORCEMENT[backend.kind]
    assert backend.capabilities.constraints[ConstraintKind.JSON_SCHEMA] == level
    fake.reset()
    await cc.check_json_schema(family_make, fake, level=level)


async def test_family_429_then_success(family_make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_429_then_success(
        family_make, fake, {"error": {"message": "Rate limit reached", "type": "requests"}}
    )


async def test_family_500_unavailable(family_make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_500_unavailable(family_make, fake, {"error": {"message": "boom", "type": "server_error"}})


async def test_family_timeout(family_make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_timeout(family_make, fake)


async def test_hang_up_is_retried(family_make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_hang_up(family_make, fake)


async def test_unreachable_upstream(family_make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_unreachable(family_make, fake)


async def test_long_headers(family_make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_long_headers(family_make, fake)


async def test_family_bad_key(
    family_make: cc.Make, fake: FakeOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    await cc.check_bad_key(family_make, fake, caplog, "sk-bad-key-9876543210zyxw")


async def test_family_cancel_closes_upstream(family_make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_cancel_closes_upstream(family_make, fake)


# --- OpenAI specifics ----------------------------------------------------------------------------


async def test_request_body_and_sampling(make: cc.Make, fake: FakeOpenAI) -> None:
    backend = await make()
    req = cc.prompt(
        sampling=SamplingParams(temperature=0.2, top_p=0.9, seed=7),
        stopping=StoppingCriteria(max_tokens=12, stop=("END",)),
    )
    await backend.generate(req)
    body = fake.server.requests[0].body
    assert body["model"] == "gpt-test"
    assert body["max_completion_tokens"] == 12 and body["stop"] == ["END"]
    assert (body["temperature"], body["top_p"], body["seed"]) == (0.2, 0.9, 7)
    assert fake.server.requests[0].headers["authorization"] == f"Bearer {API_KEY}"
    with pytest.raises(errors.InvalidArgument) as info:
        await backend.generate(cc.prompt(sampling=SamplingParams(top_k=5)))
    assert info.value.violations[0].field == "sampling.top_k"


async def test_request_options_reach_the_body_and_nothing_else_does(make: cc.Make, fake: FakeOpenAI) -> None:
    from dataclasses import replace

    from gengate.checks import prepare

    backend = await make(
        request_options=["reasoning_effort", "service_tier"], extra_body={"reasoning_effort": "high", "x": 1}
    )
    assert backend.capabilities.backend_options == {"reasoning_effort", "service_tier"}
    await backend.generate(replace(cc.prompt(), backend_options={"reasoning_effort": "low"}))
    body = fake.server.requests[0].body
    assert (body["reasoning_effort"], body["x"]) == ("low", 1)  # the caller's value over the config's
    with pytest.raises(errors.InvalidArgument) as info:  # what the service checks before a backend
        prepare(replace(cc.prompt(), backend_options={"temperature": 2}), backend.capabilities)
    assert info.value.violations[0].field == "backend_options[temperature]"
    assert (await make()).capabilities.backend_options == frozenset()  # none unless configured
    with pytest.raises(ValueError, match=r"\['seed', 'temperature'\] are set from the request's own fields"):
        oai.OpenAIOptions(model="m", request_options=["temperature", "user", "seed"])


async def test_strict_schema_transform_and_null_stripping(make: cc.Make, fake: FakeOpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "nick": {"type": "string"}},
        "required": ["name"],
    }
    fake.answers.append(json.dumps({"name": "Ada", "nick": None}))
    backend = await make()
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(JsonSchemaConstraint(schema)))
    )
    assert json.loads(result.generations[0].text) == {"name": "Ada"}  # the forced null is gone
    assert result.enforcement == Enforcement.NATIVE
    rf = fake.server.requests[0].body["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["strict"] is True
    wire = rf["json_schema"]["schema"]
    assert wire["required"] == ["name", "nick"] and wire["additionalProperties"] is False
    assert wire["properties"]["nick"]["type"] == ["string", "null"]


async def test_choice_is_native_through_a_wrapped_enum(make: cc.Make, fake: FakeOpenAI) -> None:
    fake.answers.append(json.dumps({"value": "blue"}))
    backend = await make()
    result = await backend.generate(
        cc.prompt(structured_output=StructuredOutput(ChoiceConstraint(("red", "blue"))))
    )
    assert result.generations[0].text == "blue" and result.enforcement == Enforcement.NATIVE
    wire = fake.server.requests[0].body["response_format"]["json_schema"]["schema"]
    assert wire["properties"]["value"]["enum"] == ["red", "blue"]


async def test_regex_is_prompted_validated_and_reasked(make: cc.Make, fake: FakeOpenAI) -> None:
    fake.answers.extend(["call me maybe", "555-1234"])
    backend = await make()
    structured = StructuredOutput(RegexConstraint(r"\d{3}-\d{4}"))
    result = await backend.generate(cc.prompt(structured_output=structured))
    assert result.generations[0].text == "555-1234"
    assert result.enforcement == Enforcement.VALIDATED
    first, second = (r.body["messages"] for r in fake.server.requests)
    assert first[0]["role"] == "system" and "[0-9]{3}-[0-9]{4}" in first[0]["content"]  # ASCII dialect
    assert second[-2] == {"role": "assistant", "content": "call me maybe"}
    assert "not valid" in second[-1]["content"]


async def test_schema_reask_and_validation_failure(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_reask(make, fake)


async def test_grammar_refused_up_front(make: cc.Make, fake: FakeOpenAI) -> None:
    backend = await make()
    assert ConstraintKind.GRAMMAR not in backend.capabilities.constraints
    grammar = StructuredOutput(GrammarConstraint(GrammarSyntax.LARK, 'start: "a"'))
    with pytest.raises(errors.Unimplemented) as info:
        await backend.generate(cc.prompt(structured_output=grammar))
    assert "grammar" in info.value.message and "OpenAI" in info.value.message
    assert fake.server.requests == []


async def test_json_object_and_structured_stream(make: cc.Make, fake: FakeOpenAI) -> None:
    fake.answers.append('{"a": 1}')
    backend = await make()
    events = await cc.collect(
        backend.generate_stream(cc.prompt(structured_output=StructuredOutput(JsonObjectConstraint())))
    )
    assert fake.server.requests[0].body["response_format"] == {"type": "json_object"}
    assert json.loads("".join(e.text for e in events if isinstance(e, GenerationDelta))) == {"a": 1}
    assert isinstance(events[-1], GenerationEnd) and events[-1].usage.output_tokens == 2


async def test_logprobs_unary_and_stream(make: cc.Make, fake: FakeOpenAI) -> None:
    fake.answers.extend(["a b", "c d"])
    backend = await make()
    result = await backend.generate(cc.prompt(logprobs=2))
    lp = result.generations[0].logprobs
    assert lp is not None and [t.token for t in lp] == ["a", " b"] and len(lp[0].top) == 2
    assert fake.server.requests[0].body["top_logprobs"] == 2
    events = await cc.collect(backend.generate_stream(cc.prompt(logprobs=0)))
    deltas = [e for e in events if isinstance(e, GenerationDelta)]
    assert all(d.logprobs and d.logprobs[0].logprob == -0.5 for d in deltas)


async def test_image_input(make: cc.Make, fake: FakeOpenAI) -> None:
    backend = await make()
    msg = ChatMessage(
        Role.USER, (TextPart("What is this?"), ImagePart(data=b"\x89PNG", mime_type="image/png"))
    )
    await backend.generate(_chat(msg))
    content = fake.server.requests[0].body["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "What is this?"}
    assert content[1]["image_url"]["url"] == "data:image/png;base64,iVBORw=="


def _chat(*messages: ChatMessage) -> Any:
    from gengate.domain import GenerationRequest

    return GenerationRequest(model="m", messages=messages, request_id="r")


async def test_finish_reasons_refusal_and_stop_sequence(make: cc.Make, fake: FakeOpenAI) -> None:
    backend = await make()
    fake.finish_reason = "length"
    assert (await backend.generate(cc.prompt())).generations[0].finish_reason == FinishReason.LENGTH
    fake.finish_reason = "content_filter"
    events = await cc.collect(backend.generate_stream(cc.prompt()))
    assert isinstance(events[-1], GenerationEnd) and events[-1].finish_reason == FinishReason.CONTENT_FILTER
    fake.finish_reason, fake.refusal = "stop", "I can't help with that."
    gen = (await backend.generate(cc.prompt())).generations[0]
    assert (gen.finish_reason, gen.text) == (FinishReason.REFUSAL, "I can't help with that.")
    fake.refusal, fake.stop_reason = None, "END"
    gen = (await backend.generate(cc.prompt(stopping=StoppingCriteria(stop=("END",))))).generations[0]
    assert (gen.finish_reason, gen.matched_stop) == (FinishReason.STOP_SEQUENCE, "END")


async def test_deadline_bounds_retries(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_deadline(make, fake)
    fake.reset()
    fake.server.fail_next(Fault(status=429, headers={"Retry-After": "5"}))
    backend = await make(max_retries=3)
    with pytest.raises(errors.ResourceExhausted) as info:
        await backend.generate(cc.prompt(deadline=time.monotonic() + 1.0))
    # a 5 s Retry-After past a 1 s deadline: raised at once, no second request, no sleep
    assert len(fake.server.requests) == 1 and "deadline is too close" in info.value.message
    assert info.value.retry_after_s == 5.0


async def test_broken_and_malformed(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_broken_stream(make, fake)
    fake.reset()
    await cc.check_malformed(make, fake)
    fake.reset()
    # Broken before the first byte: retried, then served.
    fake.server.fail_next(Fault(break_after=0))
    backend = await make(max_retries=1)
    events = await cc.collect(backend.generate_stream(cc.prompt()))
    assert isinstance(events[-1], GenerationEnd) and len(fake.server.requests) == 2


async def test_400_is_invalid_argument_scrubbed(make: cc.Make, fake: FakeOpenAI) -> None:
    body = {"error": {"message": f"Bad 'max_tokens' (key {API_KEY})", "type": "invalid_request_error"}}
    fake.server.fail_next(Fault(status=400, body=body))
    backend = await make()
    with pytest.raises(errors.InvalidArgument) as info:
        await backend.generate(cc.prompt())
    assert "max_tokens" in info.value.message and API_KEY not in info.value.message


async def test_task_cancel_closes_upstream(make: cc.Make, fake: FakeOpenAI) -> None:
    await cc.check_task_cancel_closes_upstream(make, fake)


async def test_azure_path_and_key_header(fake: FakeOpenAI, made: list[oai.OpenAIBackend]) -> None:
    backend = await builder(fake, oai.AzureOpenAIBackend, made)(
        model="my-deployment", api_version="2024-10-21"
    )
    await backend.generate(cc.prompt())
    rec = fake.server.requests[0]
    assert rec.path == "/openai/deployments/my-deployment/chat/completions"
    assert rec.query["api-version"] == "2024-10-21" and rec.headers["api-key"] == API_KEY


async def test_vllm_structured_outputs_and_canary(fake: FakeOpenAI, made: list[oai.OpenAIBackend]) -> None:
    build = builder(fake, oai.VLLMServerBackend, made)
    backend = await build(canary=True)
    assert fake.server.requests[0].body["structured_outputs"] == {"choice": ["zq7", "xv9"]}
    assert backend.capabilities.constraints[ConstraintKind.REGEX] == Enforcement.NATIVE
    fake.answers.append("42")
    result = await backend.generate(cc.prompt(structured_output=StructuredOutput(RegexConstraint(r"\d+"))))
    assert result.enforcement == Enforcement.NATIVE
    assert fake.server.requests[-1].body["structured_outputs"] == {"regex": "[0-9]+"}  # ASCII dialect
    assert "guided_regex" not in fake.server.requests[-1].body
    # A server that drops structured_outputs: the canary sees free text, nothing stays native.
    fake.reset()
    fake.honour_structured_outputs = False
    backend = await build(canary=True)
    table = backend.capabilities.constraints
    assert ConstraintKind.GRAMMAR not in table and set(table.values()) == {Enforcement.VALIDATED}


async def test_vllm_prompt_on_completions_with_structured_outputs_n_stop_usage(
    fake: FakeOpenAI, made: list[oai.OpenAIBackend]
) -> None:
    backend = await builder(fake, oai.VLLMServerBackend, made)()
    fake.answers.extend(["red", "blue"])
    result = await backend.generate(
        cc.prompt(
            CHATML_PRE_QUERY,
            n=2,
            structured_output=StructuredOutput(ChoiceConstraint(("red", "blue"))),
            sampling=SamplingParams(temperature=0.7, top_k=5, seed=3),
            stopping=StoppingCriteria(max_tokens=16, stop=("<|im_end|>",)),
        )
    )
    (rec,) = fake.server.requests  # n native: one request
    body = rec.body
    assert rec.path == "/v1/completions" and body["prompt"] == CHATML_PRE_QUERY and "messages" not in body
    assert body["structured_outputs"] == {"choice": ["red", "blue"]}
    assert (body["n"], body["stop"], body["max_tokens"]) == (2, ["<|im_end|>"], 16)
    assert "max_completion_tokens" not in body and "logprobs" not in body
    assert (body["temperature"], body["top_k"], body["seed"]) == (0.7, 5, 3)
    assert [g.text for g in result.generations] == ["red", "blue"]
    assert result.enforcement == Enforcement.NATIVE
    assert result.usage == Usage(1, 2)  # the fake's counts: one prompt "token", one per answer
    fake.stop_reason = "<|im_end|>"
    gen = (await backend.generate(cc.prompt(stopping=StoppingCriteria(stop=("<|im_end|>",))))).generations[0]
    assert (gen.finish_reason, gen.matched_stop) == (FinishReason.STOP_SEQUENCE, "<|im_end|>")
    fake.stop_reason, fake.finish_reason = None, "length"
    assert (await backend.generate(cc.prompt())).generations[0].finish_reason == FinishReason.LENGTH


async def test_vllm_completions_logprobs_unary_and_stream(
    fake: FakeOpenAI, made: list[oai.OpenAIBackend]
) -> None:
    backend = await builder(fake, oai.VLLMServerBackend, made)()
    fake.answers.extend(["a b", "c d"])
    gen = (await backend.generate(cc.prompt(logprobs=2))).generations[0]
    body = fake.server.requests[0].body
    assert body["logprobs"] == 2 and "top_logprobs" not in body  # the completions shape: a top count
    assert gen.logprobs is not None and [t.token for t in gen.logprobs] == ["a", " b"]
    assert gen.output_tokens == 2 and all(t.logprob == -0.5 for t in gen.logprobs)
    # The server's top also holds the sampled token: cut to the two asked for, best first.
    assert [(t.token, t.logprob) for t in gen.logprobs[0].top] == [("alt0", -0.1), ("alt1", -0.2)]
    events = await cc.collect(backend.generate_stream(cc.prompt(logprobs=0)))
    assert fake.server.requests[1].body["logprobs"] == 0
    deltas = [e for e in events if isinstance(e, GenerationDelta)]
    assert "".join(d.text for d in deltas) == "c d"
    assert all(d.logprobs and d.logprobs[0].logprob == -0.5 and d.logprobs[0].top == () for d in deltas)


async def test_vllm_completions_stream(fake: FakeOpenAI, made: list[oai.OpenAIBackend]) -> None:
    backend = await builder(fake, oai.VLLMServerBackend, made)()
    fake.answers.extend(["one two", "three four five"])
    fake.stop_reason = "END"
    events = await cc.collect(
        backend.generate_stream(cc.prompt(CHATML_PRE_QUERY, n=2, stopping=StoppingCriteria(stop=("END",))))
    )
    (rec,) = fake.server.requests
    assert rec.path == "/v1/completions" and rec.body["prompt"] == CHATML_PRE_QUERY
    assert rec.body["stream"] is True and rec.body["stream_options"] == {"include_usage": True}
    assert isinstance(events[0], StreamStart)
    texts = [
        "".join(e.text for e in events if isinstance(e, GenerationDelta) and e.index == i) for i in (0, 1)
    ]
    assert texts == ["one two", "three four five"]
    ends = [e for e in events if isinstance(e, GenerationEnd)]
    assert [e.index for e in ends] == [0, 1]
    assert all((e.finish_reason, e.matched_stop) == (FinishReason.STOP_SEQUENCE, "END") for e in ends)
    # The server's usage from the final chunk: the total split by each choice's chunks.
    assert [e.usage for e in ends] == [Usage(1, 2), Usage(1, 3)]


async def test_vllm_raw_prompt_keeps_chat_where_gengate_adds_chat_turns(
    fake: FakeOpenAI, made: list[oai.OpenAIBackend]
) -> None:
    """A re-ask's feedback and a validated constraint's instructions are chat turns: those calls
    go to chat, the first answer of a native constraint came from /v1/completions."""
    build = builder(fake, oai.VLLMServerBackend, made)
    backend = await build()
    fake.answers.extend([json.dumps({"name": "Ada", "age": -3}), json.dumps({"name": "Ada", "age": 3})])
    structured = StructuredOutput(JsonSchemaConstraint(cc.PERSON))
    result = await backend.generate(cc.prompt("Who?", structured_output=structured))
    assert json.loads(result.generations[0].text)["age"] == 3
    first, second = fake.server.requests
    assert first.path == "/v1/completions" and first.body["structured_outputs"] == {"json": cc.PERSON}
    assert second.path == "/v1/chat/completions" and second.body["structured_outputs"] == {"json": cc.PERSON}
    assert [m["role"] for m in second.body["messages"]] == ["user", "assistant", "user"]
    assert second.body["messages"][0]["content"] == "Who?"
    # A server whose canary failed: constraints are prompted, in a system message, on chat.
    fake.reset()
    fake.honour_structured_outputs = False
    backend = await build(canary=True)
    fake.answers.append("42")
    result = await backend.generate(
        cc.prompt("n?", structured_output=StructuredOutput(RegexConstraint(r"\d+")))
    )
    assert result.enforcement == Enforcement.VALIDATED
    rec = fake.server.requests[-1]
    assert rec.path == "/v1/chat/completions" and rec.body["messages"][0]["role"] == "system"


async def test_llamacpp_server_quirks(fake: FakeOpenAI, made: list[oai.OpenAIBackend]) -> None:
    fake.ignore_n, fake.stream_usage = True, False
    backend = await builder(fake, oai.LlamaCppServerBackend, made)()
    events = await cc.collect(backend.generate_stream(cc.prompt(n=2)))
    ends = [e for e in events if isinstance(e, GenerationEnd)]
    assert [e.index for e in ends] == [0, 1] and len(fake.server.requests) == 2
    assert all(e.usage.output_tokens == 6 and e.usage.input_tokens > 0 for e in ends)  # counted
    assert {r.path for r in fake.server.requests} == {"/v1/completions"}
    fake.answers.append("yes")
    await backend.generate(cc.prompt(structured_output=StructuredOutput(ChoiceConstraint(("yes", "no")))))
    rec = fake.server.requests[-1]  # its grammar field works on the raw route
    assert rec.path == "/v1/completions" and rec.body["grammar"] == 'root ::= "yes" | "no"'
    # response_format is read on chat only: a schema (or JSON object) prompt request stays there.
    fake.answers.append('{"name": "A", "age": 1}')
    await backend.generate(cc.prompt(structured_output=StructuredOutput(JsonSchemaConstraint(cc.PERSON))))
    rec = fake.server.requests[-1]
    assert rec.path == "/v1/chat/completions"
    assert rec.body["response_format"] == {"type": "json_object", "schema": cc.PERSON}
    fake.answers.append("{}")
    await backend.generate(cc.prompt(structured_output=StructuredOutput(JsonObjectConstraint())))
    rec = fake.server.requests[-1]
    assert rec.path == "/v1/chat/completions" and rec.body["response_format"] == {"type": "json_object"}


async def test_registry_kinds() -> None:
    for kind in ("openai", "azure_openai", "ollama", "vllm_server", "llamacpp_server", "together", "groq"):
        assert backend_class(kind).kind == kind


async def test_key_never_in_repr_or_logs(make: cc.Make, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    backend = await make()
    assert API_KEY not in repr(backend.options) and API_KEY not in str(backend.options.model_dump())
    assert API_KEY not in caplog.text


async def test_concurrent_fanout_is_concurrent(fake: FakeOpenAI, made: list[oai.OpenAIBackend]) -> None:
    fake.ignore_n = True
    backend = await builder(fake, oai.GroqBackend, made)()
    fake.server.fail_next(Fault(delay_s=0.4), Fault(delay_s=0.4), Fault(delay_s=0.4))
    result = await backend.generate(cc.prompt(n=3))
    assert len(result.generations) == 3 and fake.server.max_in_flight == 3  # all three at once
    await asyncio.sleep(0)


async def test_llamacpp_server_gets_repetition_penalty_by_its_own_name(
    fake: FakeOpenAI, made: list[oai.OpenAIBackend]
) -> None:
    """llama.cpp's servers read `repeat_penalty` and ignore `repetition_penalty`: sent under the
    contract's name, the penalty would be silently dropped."""
    backend = await builder(fake, oai.LlamaCppServerBackend, made)()
    await backend.generate(cc.prompt("hi", sampling=SamplingParams(repetition_penalty=1.3, min_p=0.1)))
    body = fake.server.requests[-1].body
    assert body["repeat_penalty"] == 1.3 and "repetition_penalty" not in body and body["min_p"] == 0.1
    vllm = await builder(fake, oai.VLLMServerBackend, made)()
    await vllm.generate(cc.prompt("hi", sampling=SamplingParams(repetition_penalty=1.3)))
    assert fake.server.requests[-1].body["repetition_penalty"] == 1.3
