"""Magpie on remote models that take raw prompts (TGI through huggingface_hub, vLLM's server
through the openai SDK, each against its loopback fake), over gRPC."""

from __future__ import annotations

import fake_openai
import fake_tgi
import pytest
from gengate_client import AsyncClient, Magpie
from gengate_client.errors import UnimplementedError
from observe import ServerFactory


async def test_tgi_writes_the_user_turn_on_its_raw_route_and_answers_on_chat(
    make_server: ServerFactory,
) -> None:
    """A remote raw-prompt model: the server renders the conversation in the preset's format (it
    cannot see the model's template), sends it with the pre-query to TGI's /generate, and answers
    the written turn on TGI's chat route."""
    pytest.importorskip("huggingface_hub", reason="huggingface_hub is not installed (extra: gengate[tgi])")
    fake = fake_tgi.FakeTGI()
    fake.start()
    try:
        entry = {"name": "tgi", "backend": "tgi", "model": "tgi-test", "base_url": fake.server.base_url,
                 "api_key": fake_tgi.API_KEY}  # fmt: skip
        server = await make_server({"models": [entry]})
        fake.answers.extend(["What is a map?", "A drawing of a place.", "Who draws maps?"])
        async with AsyncClient(server.address) as client:
            (info,) = await client.list_models()
            assert info.capabilities.magpie
            magpie = Magpie("llama3", system_prompt="Ask about maps.", n_turns=2, end_with_user=True)
            reply = await client.generate("tgi", magpie=magpie, max_tokens=8)
            with pytest.raises(UnimplementedError) as custom:
                await client.generate("tgi", magpie=Magpie("<my pre-query>", system_prompt="s"))
            assert [v.field for v in custom.value.field_violations] == ["magpie.template"]
    finally:
        fake.stop()
    turns = [(t.role, t.text) for t in reply.generations[0].conversation]
    assert turns == [
        ("user", "What is a map?"),
        ("assistant", "A drawing of a place."),
        ("user", "Who draws maps?"),
    ]
    first, answer, second = fake.server.requests
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
    """vLLM's OpenAI-compatible server: the conversation rendered in the preset's format goes raw
    to /v1/completions, the written turn is answered on /v1/chat/completions."""
    pytest.importorskip("openai", reason="the openai SDK is not installed (extra: gengate[openai])")
    fake = fake_openai.FakeOpenAI()
    fake.start()
    try:
        entry = {"name": "vllm", "backend": "vllm_server", "model": "m", "canary": False,
                 "base_url": fake.server.base_url + "/v1", "api_key": fake_openai.API_KEY}  # fmt: skip
        server = await make_server({"models": [entry]})
        fake.answers.extend(["What is a map?", "A drawing of a place.", "Who draws maps?"])
        async with AsyncClient(server.address) as client:
            (info,) = await client.list_models()
            assert info.capabilities.magpie
            magpie = Magpie("qwen2", system_prompt="Ask about maps.", n_turns=2, end_with_user=True)
            reply = await client.generate("vllm", magpie=magpie, max_tokens=8)
    finally:
        fake.stop()
    turns = [(t.role, t.text) for t in reply.generations[0].conversation]
    assert turns == [
        ("user", "What is a map?"),
        ("assistant", "A drawing of a place."),
        ("user", "Who draws maps?"),
    ]
    first, answer, second = fake.server.requests
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
