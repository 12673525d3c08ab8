"""Magpie on remote models that take raw prompts (TGI through huggingface_hub, vLLM's server
through the openai SDK, each against its loopback fake), over gRPC."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import fake_openai
import fake_tgi
import pytest
from gengate_client import AsyncClient, Magpie
from gengate_client.errors import UnimplementedError
from gengate_client.types import Response
from observe import ServerFactory

ANSWERS = ["What is a map?", "A drawing of a place.", "Who draws maps?"]


async def two_turns(
    make_server: ServerFactory, fake: Any, entry: Callable[[str], dict[str, Any]], preset: str
) -> tuple[Response, list[Any]]:
    """A two-turn Magpie conversation ending with the user, through `entry` on `fake`: the reply
    and the requests the fake saw. Also checks a custom template after a system prompt is refused
    (the server cannot render a remote model's own template)."""
    fake.start()
    try:
        server = await make_server({"models": [{"name": "remote", **entry(fake.server.base_url)}]})
        fake.answers.extend(ANSWERS)
        async with AsyncClient(server.address) as client:
            (info,) = await client.list_models()
            assert info.capabilities.magpie
            magpie = Magpie(preset, system_prompt="Ask about maps.", n_turns=2, end_with_user=True)
            reply = await client.generate("remote", magpie=magpie, max_tokens=8)
            with pytest.raises(UnimplementedError) as custom:
                await client.generate("remote", magpie=Magpie("<my pre-query>", system_prompt="s"))
            assert [v.field for v in custom.value.field_violations] == ["magpie.template"]
    finally:
        fake.stop()
    turns = [(t.role, t.text) for t in reply.generations[0].conversation]
    assert turns == list(zip(["user", "assistant", "user"], ANSWERS, strict=True))
    return reply, list(fake.server.requests)


async def test_tgi_writes_the_user_turn_on_its_raw_route_and_answers_on_chat(
    make_server: ServerFactory,
) -> None:
    """The server renders the conversation in the preset's format, sends it with the pre-query to
    TGI's /generate, and answers the written turn on TGI's chat route."""
    pytest.importorskip("huggingface_hub", reason="huggingface_hub is not installed (extra: gengate[tgi])")
    entry = lambda url: {"backend": "tgi", "model": "tgi-test", "base_url": url, "api_key": fake_tgi.API_KEY}  # noqa: E731
    _, (first, answer, second) = await two_turns(make_server, fake_tgi.FakeTGI(), entry, "llama3")
    assert (first.path, answer.path, second.path) == ("/", "/v1/chat/completions", "/")
    assert first.body["inputs"] == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nAsk about maps.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
    )
    assert "<|eot_id|>" in first.body["parameters"]["stop"]
    assert [m["role"] for m in answer.body["messages"]] == ["system", "user"]
    assert second.body["inputs"].endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\nA drawing of a place.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
    )


async def test_vllm_server_writes_the_user_turn_on_completions_and_answers_on_chat(
    make_server: ServerFactory,
) -> None:
    """vLLM's OpenAI-compatible server: the preset-rendered conversation goes raw to
    /v1/completions, the written turn is answered on /v1/chat/completions."""
    pytest.importorskip("openai", reason="the openai SDK is not installed (extra: gengate[openai])")
    entry = lambda url: {"backend": "vllm_server", "model": "m", "canary": False,  # noqa: E731
                         "base_url": url + "/v1", "api_key": fake_openai.API_KEY}  # fmt: skip
    _, (first, answer, second) = await two_turns(make_server, fake_openai.FakeOpenAI(), entry, "qwen2")
    assert (first.path, answer.path, second.path) == (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/completions",
    )
    assert first.body["prompt"] == "<|im_start|>system\nAsk about maps.<|im_end|>\n<|im_start|>user\n"
    assert "<|im_end|>" in first.body["stop"]
    assert [m["role"] for m in answer.body["messages"]] == ["system", "user"]
    assert second.body["prompt"].endswith(
        "<|im_start|>assistant\nA drawing of a place.<|im_end|>\n<|im_start|>user\n"
    )
