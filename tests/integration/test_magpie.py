"""Magpie over gRPC on the real engines: the model writes the user turns from the pre-query text,
turn after turn, and answers each; refusals name the field and the reason."""

from __future__ import annotations

from typing import Any

import pytest
from gengate.domain import MagpiePreset
from gengate.magpie import PRESETS
from gengate_client import AsyncClient, Magpie
from gengate_client.errors import InvalidArgumentError, UnimplementedError
from observe import ServerFactory

pytest.importorskip("llama_cpp")

TINY = {"name": "tiny", "backend": "llamacpp", "tiny": True}


async def test_a_two_turn_conversation_is_written_and_answered(make_server: ServerFactory) -> None:
    server = await make_server({"models": [TINY]})
    async with AsyncClient(server.address) as client:
        (info,) = await client.list_models()
        assert info.capabilities.magpie
        magpie = Magpie("qwen2", system_prompt="You write questions about cooking.", n_turns=2)
        reply = await client.generate("tiny", magpie=magpie, n=2, max_tokens=6, seed=11)
    assert len(reply.generations) == 2
    for generation in reply.generations:
        roles = [t.role for t in generation.conversation]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert all(0 < t.output_tokens <= 6 for t in generation.conversation)
        assert generation.text == generation.conversation[-1].text
        assert generation.output_tokens == sum(t.output_tokens for t in generation.conversation)
    # usage counts every call: 8 turns written, each read its whole conversation as input
    written = sum(g.output_tokens for g in reply.generations)
    assert reply.usage.output_tokens == written
    assert reply.usage.input_tokens > 8
    # the two conversations were sampled apart (same start, different seeds after the first call)
    assert reply.generations[0].conversation != reply.generations[1].conversation


async def test_the_same_seed_writes_the_same_conversation(make_server: ServerFactory) -> None:
    server = await make_server({"models": [TINY]})
    async with AsyncClient(server.address) as client:
        first, second = [
            await client.generate("tiny", magpie=Magpie("qwen2", n_turns=2), max_tokens=5, seed=4)
            for _ in range(2)
        ]
    assert first.generations[0].conversation == second.generations[0].conversation


@pytest.mark.parametrize(
    ("options", "roles"),
    [
        ({"only_instruction": True, "n_turns": 3}, ["user"]),
        ({"end_with_user": True, "n_turns": 2}, ["user", "assistant", "user"]),
        ({"conversation": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
         ["user", "assistant", "user", "assistant"]),
    ],
)  # fmt: skip
async def test_turn_options(make_server: ServerFactory, options: dict[str, Any], roles: list[str]) -> None:
    server = await make_server({"models": [TINY]})
    async with AsyncClient(server.address) as client:
        reply = await client.generate("tiny", magpie=Magpie("qwen2", **options), max_tokens=4, seed=2)
    conversation = reply.generations[0].conversation
    assert [t.role for t in conversation] == roles
    given = options.get("conversation", [])
    assert [(t.text, t.output_tokens) for t in conversation[: len(given)]] == [
        (m["content"], 0) for m in given
    ]


async def test_a_custom_template_is_sent_as_given(make_server: ServerFactory) -> None:
    """A custom pre-query text after a system prompt continues the chat template's rendering: the
    engine sees template-rendered system turn + the text, and writes a user turn."""
    server = await make_server({"models": [TINY]})
    async with AsyncClient(server.address) as client:
        custom = Magpie("<|im_start|>user\nQuestion:", system_prompt="Be brief.", only_instruction=True)
        reply = await client.generate("tiny", magpie=custom, max_tokens=5, seed=1)
        preset = Magpie("qwen2", system_prompt="Be brief.", only_instruction=True)
        same = await client.generate("tiny", magpie=preset, max_tokens=5, seed=1)
    assert reply.generations[0].conversation[0].role == "user"
    # a different pre-query is a different prompt: the tiny model's samples differ
    assert reply.usage.input_tokens > same.usage.input_tokens


async def test_a_preset_whose_tokens_the_tokenizer_lacks_is_refused_naming_them(
    make_server: ServerFactory,
) -> None:
    server = await make_server({"models": [TINY]})
    async with AsyncClient(server.address) as client:
        with pytest.raises(InvalidArgumentError) as info:
            await client.generate("tiny", magpie=Magpie("llama3"), max_tokens=4)
        assert info.value.reason == "MAGPIE_TOKENS_MISSING"
        assert [v.field for v in info.value.field_violations] == ["magpie.preset"]
        for token in PRESETS[MagpiePreset.LLAMA3].tokens:
            assert token in str(info.value)
        # the server goes on serving
        ok = await client.generate("tiny", magpie=Magpie("qwen2", only_instruction=True), max_tokens=2)
        assert ok.generations[0].conversation


async def test_refusals_name_the_field(make_server: ServerFactory) -> None:
    server = await make_server(
        {
            "models": [
                TINY,
                {
                    "name": "chat",
                    "backend": "openai",
                    "api_key": "k",
                    "base_url": "http://127.0.0.1:9/v1",
                    "model": "m",
                },
            ]
        }
    )
    async with AsyncClient(server.address) as client:
        with pytest.raises(UnimplementedError) as chat_only:
            await client.generate("chat", magpie=Magpie("qwen2"))
        assert chat_only.value.reason == "MAGPIE_UNSUPPORTED"
        assert [v.field for v in chat_only.value.field_violations] == ["magpie"]
        with pytest.raises(InvalidArgumentError) as too_many:
            await client.generate("tiny", magpie=Magpie("qwen2", n_turns=17))
        assert "magpie.n_turns" in [v.field for v in too_many.value.field_violations]
        with pytest.raises(InvalidArgumentError) as with_logprobs:
            await client.generate("tiny", magpie=Magpie("qwen2"), logprobs=1)
        assert [v.field for v in with_logprobs.value.field_violations] == ["logprobs"]
        with pytest.raises(InvalidArgumentError) as system_turn:
            await client.generate(
                "tiny", magpie=Magpie("qwen2", conversation=[{"role": "system", "content": "x"}])
            )
        assert [v.field for v in system_turn.value.field_violations] == ["magpie.conversation[0].role"]
        with pytest.raises(UnimplementedError) as streamed:
            async for _ in client.generate_stream("tiny", magpie=Magpie("qwen2")):
                pass
        assert streamed.value.reason == "MAGPIE_NOT_STREAMED"
        (chat_info,) = [m for m in await client.list_models() if m.name == "chat"]
        assert not chat_info.capabilities.magpie


async def test_a_batch_runs_magpie_items_beside_plain_ones(make_server: ServerFactory) -> None:
    server = await make_server({"models": [TINY]})
    async with AsyncClient(server.address) as client:
        items = await client.batch_generate(
            [
                {"model": "tiny", "magpie": Magpie("qwen2"), "max_tokens": 3},
                {"model": "tiny", "magpie": Magpie("llama3"), "max_tokens": 3},
                {"model": "tiny", "prompt": "Hi", "max_tokens": 3},
            ]
        )
    assert [t.role for t in items[0].response.generations[0].conversation] == ["user", "assistant"]
    assert isinstance(items[1].error, InvalidArgumentError)
    assert items[2].response is not None and not items[2].response.generations[0].conversation


@pytest.mark.parametrize(("kind", "framework"), [("transformers", "torch"), ("mlx", "mlx.core")])
async def test_batched_engines_continue_their_own_chat_template(
    make_server: ServerFactory, kind: str, framework: str
) -> None:
    pytest.importorskip(framework)
    server = await make_server({"models": [{"name": "hf", "backend": kind, "tiny": True}]})
    async with AsyncClient(server.address) as client:
        magpie = Magpie("qwen2", system_prompt="Ask about rivers.", n_turns=1)
        reply = await client.generate("hf", magpie=magpie, max_tokens=4, seed=3)
        with pytest.raises(InvalidArgumentError) as gemma:
            await client.generate("hf", magpie=Magpie("gemma"), max_tokens=4)
    assert [t.role for t in reply.generations[0].conversation] == ["user", "assistant"]
    assert all(t.output_tokens > 0 for t in reply.generations[0].conversation)
    assert gemma.value.reason == "MAGPIE_TOKENS_MISSING" and "<start_of_turn>" in str(gemma.value)
