"""The OpenAI adapter against a real third-party peer: llama-cpp-python's OpenAI-compatible
server (`python -m llama_cpp.server`) on the tiny GGUF, with its real quirks (ignores `n`,
HTTP 500 on json_schema response_format, no usage in streams). A prompt goes raw to its
/v1/completions route, so Magpie is served on it."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai", reason="the openai SDK is not installed (extra: gengate[openai])")
pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] is not installed")

from gengate import errors
from gengate.domain import (
    ChatMessage,
    ChoiceConstraint,
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    JsonSchemaConstraint,
    Role,
    SamplingParams,
    StoppingCriteria,
    StreamStart,
    StructuredOutput,
    TextPart,
    Tool,
    ToolChoice,
)
from gengate.models.tiny import TinyModelPaths
from gengate.providers import openai as oai
from gengate_client import AsyncClient, Magpie
from llamacpp_peer import llamacpp_server
from observe import ServerFactory
from pydantic import SecretStr

KEY = "sk-llamacpp-peer-0123456789"


@pytest.fixture(scope="module")
def server_url(tiny_model: TinyModelPaths, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = Path(tmp_path_factory.mktemp("llamacpp-server")) / "server.log"
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(llamacpp_server(tiny_model.gguf_path, log_path, KEY))
        except RuntimeError as exc:
            pytest.fail(str(exc))
        yield url


@pytest.fixture
async def make(server_url: str) -> AsyncIterator[Any]:
    made: list[oai.OpenAIBackend] = []

    async def build(cls: type[oai.OpenAIBackend] = oai.LlamaCppServerBackend, **kw: Any) -> oai.OpenAIBackend:
        opts: dict[str, Any] = {
            "model": "tiny",
            "base_url": server_url + "/v1",
            "api_key": SecretStr(KEY),
            "timeout": 60,
            "max_retries": 0,
        } | kw
        if isinstance(opts["api_key"], str):
            opts["api_key"] = SecretStr(opts["api_key"])
        backend = cls("tiny-peer", cls.Options(**opts))
        await backend.start()
        made.append(backend)
        return backend

    yield build
    for backend in made:
        await backend.aclose()


def _req(**kw: Any) -> GenerationRequest:
    kw.setdefault("stopping", StoppingCriteria(max_tokens=8))
    return GenerationRequest(model="tiny", prompt="Hello there", request_id="peer", **kw)


async def test_text_with_server_usage(make: Any) -> None:
    backend = await make()
    result = await backend.generate(_req())
    assert len(result.generations) == 1
    assert result.usage.input_tokens > 0 and 0 < result.usage.output_tokens <= 8


async def test_stream_counts_usage_the_server_does_not_send(make: Any) -> None:
    backend = await make()
    events = [e async for e in backend.generate_stream(_req())]
    assert isinstance(events[0], StreamStart)
    deltas = [e for e in events if isinstance(e, GenerationDelta)]
    end = events[-1]
    assert isinstance(end, GenerationEnd)
    assert end.usage.output_tokens == sum(d.token_count for d in deltas) > 0
    assert end.usage.input_tokens > 0


async def test_n2_is_fanned_out(make: Any) -> None:
    backend = await make()
    result = await backend.generate(_req(n=2))
    assert [g.index for g in result.generations] == [0, 1]
    events = [e async for e in backend.generate_stream(_req(n=2))]
    assert sorted(e.index for e in events if isinstance(e, GenerationEnd)) == [0, 1]


async def test_choice_enforced_by_its_grammar(make: Any) -> None:
    backend = await make()
    structured = StructuredOutput(ChoiceConstraint(("alpha", "beta")))
    result = await backend.generate(
        _req(structured_output=structured, stopping=StoppingCriteria(max_tokens=16))
    )
    assert result.generations[0].text in ("alpha", "beta")
    assert result.enforcement == Enforcement.NATIVE


async def test_json_schema_valid_or_refused(make: Any) -> None:
    backend = await make()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    structured = StructuredOutput(JsonSchemaConstraint(schema))
    valid = 0
    for seed in range(4):  # random weights may ramble past max_tokens: refused, never invalid
        request = _req(
            structured_output=structured,
            stopping=StoppingCriteria(max_tokens=48),
            sampling=SamplingParams(seed=seed),
        )
        try:
            result = await backend.generate(request)
        except errors.Aborted as exc:
            assert exc.reason == "VALIDATION_FAILED"
            continue
        assert isinstance(json.loads(result.generations[0].text)["ok"], bool)
        assert result.enforcement == Enforcement.VALIDATED
        valid += 1
    assert valid > 0, "every schema request was refused: the schema never reached the server's grammar"


async def test_json_schema_response_format_500_is_an_error_not_a_drop(make: Any) -> None:
    backend = await make(oai.OpenAIBackend)  # sends OpenAI's json_schema response_format
    structured = StructuredOutput(JsonSchemaConstraint({"type": "object", "properties": {}}))
    with pytest.raises(errors.GengateError) as info:
        await backend.generate(_req(structured_output=structured))
    assert isinstance(info.value, errors.Unavailable | errors.InvalidArgument)


async def test_bad_key_and_deadline(make: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    bad = "sk-wrong-peer-key-5555555555"
    backend = await make(api_key=bad)
    with pytest.raises(errors.Internal) as info:
        await backend.generate(_req())
    assert info.value.reason == "UPSTREAM_AUTH_FAILED" and bad not in info.value.message
    assert bad not in caplog.text
    good = await make()
    with pytest.raises(errors.DeadlineExceeded):
        await good.generate(
            _req(stopping=StoppingCriteria(max_tokens=400), deadline=time.monotonic() + 0.001)
        )


FLAG = Tool(
    "set_flag",
    "Sets the flag.",
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
)


def _tool_req(seed: int) -> GenerationRequest:
    message = ChatMessage(Role.USER, (TextPart("Set the flag."),))
    return GenerationRequest(
        model="tiny",
        messages=(message,),
        tools=(FLAG,),
        tool_choice=ToolChoice(name="set_flag"),
        stopping=StoppingCriteria(max_tokens=48),
        sampling=SamplingParams(seed=seed),
    )


async def test_a_named_tool_call_from_the_real_server(make: Any) -> None:
    """llama-cpp-python answers a named tool_choice with a call whose arguments its grammar builds
    from the tool's schema (its chatml handler), unary and streamed (id and name on every
    fragment): each call validated, or refused (random weights may ramble past max_tokens)."""
    backend = await make()
    unary = streamed = 0
    for seed in range(4):
        try:
            result = await backend.generate(_tool_req(seed))
        except errors.Aborted as exc:
            assert exc.reason == "VALIDATION_FAILED"
        else:
            (gen,) = result.generations
            (call,) = gen.tool_calls
            assert call.name == "set_flag" and call.id and gen.finish_reason == FinishReason.TOOL_CALLS
            assert isinstance(json.loads(call.arguments)["ok"], bool)
            unary += 1
        events: list[Any] = []
        try:
            async for event in backend.generate_stream(_tool_req(seed)):
                events.append(event)
        except errors.Aborted as exc:
            assert exc.reason == "VALIDATION_FAILED"
            continue
        end = events[-1]
        assert isinstance(end, GenerationEnd) and end.finish_reason == FinishReason.TOOL_CALLS
        (call,) = end.tool_calls
        fragments = [f for e in events if isinstance(e, GenerationDelta) for f in e.tool_calls]
        assert [f.name for f in fragments if f.name] == ["set_flag"]  # once, though sent on each
        assert "".join(f.arguments for f in fragments) == call.arguments
        assert isinstance(json.loads(call.arguments)["ok"], bool)
        streamed += 1
    assert unary > 0 and streamed > 0, "no call validated: the tool never reached the server's grammar"


def _server_count(server_url: str, text: str) -> int:
    """The tokens the peer's own engine reads `text` as (its /extras/tokenize/count: special tokens
    parsed, BOS as the model adds it: what its completions route reads a raw prompt as)."""
    req = urllib.request.Request(
        server_url + "/extras/tokenize/count",
        data=json.dumps({"input": text}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as response:
        return int(json.loads(response.read())["count"])


# What Magpie's qwen2 (ChatML) preset writes for the system prompt "Ask about maps.".
PRE_QUERY = "<|im_start|>system\nAsk about maps.<|im_end|>\n<|im_start|>user\n"


async def test_a_prompt_reaches_the_engine_raw(make: Any, server_url: str) -> None:
    """A prompt ending in the ChatML user header is read as exactly its own tokens (the special
    tokens parsed, no chat template around it); the same text as a chat message is wrapped."""
    backend = await make()
    stopping = StoppingCriteria(max_tokens=8)
    raw = await backend.generate(GenerationRequest(model="tiny", prompt=PRE_QUERY, stopping=stopping))
    assert raw.usage.input_tokens == _server_count(server_url, PRE_QUERY)
    assert raw.usage.output_tokens > 0
    message = ChatMessage(Role.USER, (TextPart(PRE_QUERY),))
    chat = await backend.generate(GenerationRequest(model="tiny", messages=(message,), stopping=stopping))
    assert chat.usage.input_tokens > raw.usage.input_tokens  # the server's template around it


async def test_magpie_over_grpc_writes_the_user_turn(make_server: ServerFactory, server_url: str) -> None:
    """Magpie on a llamacpp_server model: the pre-query goes raw to the peer, which writes the
    user turn; with a system prompt the conversation is rendered in the preset's format and the
    written turn answered on chat."""
    entry = {"name": "peer", "backend": "llamacpp_server", "model": "tiny", "base_url": server_url + "/v1",
             "api_key": KEY, "max_retries": 0}  # fmt: skip
    server = await make_server({"models": [entry]})
    async with AsyncClient(server.address) as client:
        (info,) = await client.list_models()
        assert info.capabilities.magpie
        reply = await client.generate(
            "peer", magpie=Magpie("qwen2", only_instruction=True), max_tokens=6, seed=5
        )
        (generation,) = reply.generations
        (turn,) = generation.conversation
        assert turn.role == "user" and turn.text == generation.text
        assert turn.output_tokens > 0  # the peer's count (it may pass max_tokens to end a UTF-8 character)
        assert reply.usage.input_tokens == _server_count(server_url, "<|im_start|>user\n")  # read raw
        answered = await client.generate(
            "peer", magpie=Magpie("qwen2", system_prompt="Ask about maps."), max_tokens=6, seed=5
        )
    roles = [t.role for t in answered.generations[0].conversation]
    assert roles == ["user", "assistant"]
    assert answered.usage.input_tokens > _server_count(server_url, PRE_QUERY)  # both calls counted
