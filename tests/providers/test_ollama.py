"""Ollama through its OpenAI-compatible endpoint (the real `openai` SDK against a loopback fake
that answers like Ollama: one choice per request). The contract checks for the `ollama` kind
run in test_openai.py's family tests; these are Ollama's own specifics."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import pytest

pytest.importorskip("openai", reason="the openai SDK is not installed (extra: gengate[ollama])")

import contract_checks as cc
from fake_openai import FakeOpenAI
from gengate import errors
from gengate.domain import (
    ChoiceConstraint,
    ConstraintKind,
    Enforcement,
    GrammarConstraint,
    GrammarSyntax,
    JsonSchemaConstraint,
    RegexConstraint,
    StructuredOutput,
)
from gengate.providers.ollama import OllamaBackend


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def ollama(fake: FakeOpenAI) -> AsyncIterator[OllamaBackend]:
    fake.reset()
    fake.ignore_n = True
    # No api key: Ollama needs none (the fake accepts this one only because it is told to below).
    backend = OllamaBackend(
        "llama", OllamaBackend.Options(model="llama3.2", base_url=fake.server.base_url + "/v1")
    )
    await backend.start()
    yield backend
    await backend.aclose()


@pytest.fixture(autouse=True)
def open_fake(fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake.server, "_auth", lambda rec: True)


async def test_capabilities_table(ollama: OllamaBackend) -> None:
    table = ollama.capabilities.constraints
    assert table == {
        ConstraintKind.JSON_SCHEMA: Enforcement.NATIVE,
        ConstraintKind.JSON_OBJECT: Enforcement.NATIVE,
        ConstraintKind.CHOICE: Enforcement.NATIVE,
        ConstraintKind.REGEX: Enforcement.VALIDATED,
    }
    assert ollama.capabilities.max_n == 16


async def test_schema_is_sent_as_format_unchanged(ollama: OllamaBackend, fake: FakeOpenAI) -> None:
    fake.answers.append(json.dumps({"name": "Ada", "age": 36}))
    structured = StructuredOutput(JsonSchemaConstraint(cc.PERSON, name="person"))
    result = await ollama.generate(cc.prompt(structured_output=structured))
    assert result.enforcement == Enforcement.NATIVE
    body = fake.server.requests[0].body
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": cc.PERSON},
    }
    assert "authorization" in fake.server.requests[0].headers  # placeholder key, never a real one


async def test_choice_as_enum_schema(ollama: OllamaBackend, fake: FakeOpenAI) -> None:
    fake.answers.extend(['"no"', '"yes"'])
    structured = StructuredOutput(ChoiceConstraint(("yes", "no")))
    result = await ollama.generate(cc.prompt(structured_output=structured, n=2))
    assert sorted(g.text for g in result.generations) == ["no", "yes"]  # fanned out: either order
    assert len(fake.server.requests) == 2  # one choice per request: fanned out
    schema = fake.server.requests[0].body["response_format"]["json_schema"]["schema"]
    assert schema == {"type": "string", "enum": ["yes", "no"]}


async def test_regex_validated_and_grammar_refused(ollama: OllamaBackend, fake: FakeOpenAI) -> None:
    fake.answers.append("```\n2024-01-02\n```")
    fake.answers.append("2024-01-02")
    result = await ollama.generate(
        cc.prompt(structured_output=StructuredOutput(RegexConstraint(r"\d{4}-\d{2}-\d{2}")))
    )
    assert result.generations[0].text == "2024-01-02" and result.enforcement == Enforcement.VALIDATED
    with pytest.raises(errors.Unimplemented) as info:
        await ollama.generate(
            cc.prompt(
                structured_output=StructuredOutput(GrammarConstraint(GrammarSyntax.GBNF, 'root ::= "a"'))
            )
        )
    assert "Ollama" in info.value.message and "grammar" in info.value.message


async def test_no_key_needed_and_default_url() -> None:
    backend = OllamaBackend("o", OllamaBackend.Options(model="llama3.2"))
    await backend.start()
    assert str(backend._client.base_url).startswith("http://localhost:11434/v1")
    await backend.aclose()


async def test_unreachable_is_unavailable() -> None:
    backend = OllamaBackend(
        "o", OllamaBackend.Options(model="m", base_url="http://127.0.0.1:9/v1", max_retries=0)
    )
    await backend.start()
    with pytest.raises(errors.Unavailable):
        await backend.generate(cc.prompt())
    await backend.aclose()
