"""The Outlines model adapter, driven through Outlines' own Generator and model call API."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from fake_gengate import RunningFake
from gengate_client import AsyncClient, Client, TruncatedOutputError
from pydantic import BaseModel, Field

outlines = pytest.importorskip("outlines")
from gengate_client.outlines import AsyncGengate, Gengate, from_gengate  # noqa: E402


class City(BaseModel):
    name: str
    population: int = Field(ge=0)
    country_code: str = Field(pattern=r"^[A-Z]{2}$")


def test_generator_with_pydantic_literal_and_regex(fake: RunningFake) -> None:
    with Client(fake.address) as client:
        model = from_gengate(client, "tiny")
        assert isinstance(model, Gengate)
        text = outlines.Generator(model, City)("Describe a city", max_tokens=100)
        assert City.model_validate_json(text).country_code == "FR"
        sent = fake.servicer.requests[-1]
        assert sent.stopping.max_tokens == 100
        assert json.loads(sent.structured_output.json_schema.schema_json) == City.model_json_schema()

        assert outlines.Generator(model, Literal["yes", "no"])("Yes or no?") == "yes"
        assert list(fake.servicer.requests[-1].structured_output.choice.choices) == ["yes", "no"]

        date = outlines.types.Regex(r"\d{4}-\d{2}-\d{2}")
        assert model("A date", date, seed=1) == "2024-01-31"
        sent = fake.servicer.requests[-1]
        assert sent.structured_output.regex.pattern == r"\d{4}-\d{2}-\d{2}" and sent.sampling.seed == 1


def test_chat_input_stream_batch_and_n(fake: RunningFake) -> None:
    with Client(fake.address) as client:
        model = from_gengate(client, "tiny")
        chat = outlines.inputs.Chat(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        )
        assert model(chat) == "echo 0: Be brief. Hi"
        assert [m.role for m in fake.servicer.requests[-1].messages.messages] == [1, 2]
        assert "".join(model.stream("one two three")) == "echo 0: one two three"
        assert model.batch(["a", "b"], max_new_tokens=5) == ["echo 0: a", "echo 0: b"]
        assert fake.servicer.requests[-1].requests[0].stopping.max_tokens == 5
        assert model("x", n=2) == ["echo 0: x", "echo 1: x"]
        with pytest.raises(TypeError, match="Chat"):
            model(42)


def test_truncated_json_is_an_error_not_broken_text(fake: RunningFake) -> None:
    from fake_gengate import default_responder

    def cut(request):  # type: ignore[no-untyped-def]
        response = default_responder(request)
        response.generations[0].finish_reason = 2  # LENGTH
        response.generations[0].text = json.dumps({"name": "Paris"})[:8]
        return response

    fake.servicer.responder = cut
    with Client(fake.address) as client, pytest.raises(TruncatedOutputError):
        outlines.Generator(from_gengate(client, "tiny"), City)("x", max_tokens=3)


async def test_async_model(fake: RunningFake) -> None:
    async with AsyncClient(fake.address) as client:
        model = from_gengate(client, "tiny")
        assert isinstance(model, AsyncGengate)
        text = await outlines.Generator(model, City)("Describe a city")
        assert City.model_validate_json(text).name == "Paris"
        assert await model("Pick", Literal["b", "a"]) == "b"
        chunks = [c async for c in model.stream("p q")]
        assert "".join(chunks) == "echo 0: p q"
