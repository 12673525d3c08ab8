"""OpenAI's and Azure OpenAI's Batch API (backend.OfflineBatches) driven through the real
`openai` SDK against a loopback Files + Batch API: the input file holds the online call's
bodies, results come back through the online parsing and validation, errors through the
provider error mapping, and cancel reaches the upstream."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import pytest

pytest.importorskip("openai", reason="the openai SDK is not installed (extra: gengate[openai])")

import contract_checks as cc
from fake_openai import API_KEY
from fake_openai_batch import FakeOpenAIBatches
from gengate import errors
from gengate.backend import BatchState, OfflineBatches
from gengate.domain import (
    Enforcement,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
    StoppingCriteria,
    StructuredOutput,
)
from gengate.providers import openai as oai
from gengate.providers.anthropic import AnthropicBackend
from gengate.providers.ollama import OllamaBackend

PERSON = StructuredOutput(JsonSchemaConstraint(cc.PERSON, name="person"))
Outcomes = dict[int, GenerationResult | errors.GengateError]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAIBatches]:
    yield from cc.serving(FakeOpenAIBatches())


@pytest.fixture(params=[oai.OpenAIBackend, oai.AzureOpenAIBackend], ids=["openai", "azure_openai"])
async def backend(
    request: pytest.FixtureRequest, fake: FakeOpenAIBatches
) -> AsyncIterator[oai.OpenAIBackend]:
    cls: type[oai.OpenAIBackend] = request.param
    url = fake.server.base_url if cls is oai.AzureOpenAIBackend else fake.server.base_url + "/v1"
    async with cc.backends(cls, "gpt", fake, model="gpt-test", base_url=url, api_key=API_KEY) as make:
        built = await make()
        assert isinstance(built, oai.OpenAIBackend)
        yield built


def ask(text: str = "Say hello", **kw: Any) -> GenerationRequest:
    return GenerationRequest(model="gpt", prompt=text, request_id=f"r-{text}", **kw)


async def outcomes(
    backend: oai.OpenAIBackend, batch_id: str, items: Mapping[int, GenerationRequest]
) -> Outcomes:
    return {index: outcome async for index, outcome in backend.batch_results(batch_id, items)}


def test_only_openai_and_azure_of_the_family_have_a_batch_api() -> None:
    def built(cls: type[Any], **kw: Any) -> Any:
        return cls("m", cls.Options(model="x", api_key=API_KEY, base_url="http://127.0.0.1:9/v1", **kw))

    assert isinstance(built(oai.OpenAIBackend), OfflineBatches)
    assert isinstance(built(oai.AzureOpenAIBackend), OfflineBatches)
    assert isinstance(built(AnthropicBackend), OfflineBatches)
    for cls in (oai.OpenAICompatibleBackend, oai.TogetherBackend, oai.VLLMServerBackend, OllamaBackend):
        assert not isinstance(built(cls), OfflineBatches), cls.kind


async def test_each_line_is_the_online_call_s_body(
    backend: oai.OpenAIBackend, fake: FakeOpenAIBatches
) -> None:
    request = ask(
        "who?",
        n=2,
        structured_output=PERSON,
        sampling=SamplingParams(temperature=0.3, seed=7),
        stopping=StoppingCriteria(max_tokens=50, stop=("END",)),
    )
    fake.answers.extend([json.dumps({"name": "Ada", "age": 36})] * 2)
    await backend.generate(request)
    online = fake.server.requests[-1].body
    assert online["response_format"]["type"] == "json_schema" and online["n"] == 2
    batch_id = await backend.submit_batch([(4, request), (9, ask("plain"))])
    upload = next(r for r in fake.server.requests if r.path.endswith("/files"))
    assert upload.headers["content-type"].startswith("multipart/form-data")
    assert API_KEY.encode() not in upload.raw  # the key travels in a header, never in the file
    lines = fake.inputs[batch_id]
    url = "/chat/completions" if isinstance(backend, oai.AzureOpenAIBackend) else "/v1/chat/completions"
    assert [(line["custom_id"], line["method"], line["url"]) for line in lines] == [
        ("4", "POST", url),
        ("9", "POST", url),
    ]
    assert lines[0]["body"] == online
    assert lines[1]["body"]["model"] == "gpt-test" and "n" not in lines[1]["body"]
    create = next(r for r in fake.server.requests if r.path.endswith("/batches") and r.method == "POST")
    assert create.body["endpoint"] == url and create.body["completion_window"] == "24h"
    if isinstance(backend, oai.AzureOpenAIBackend):
        assert create.path == "/openai/batches" and create.query["api-version"]


async def test_status_then_results_through_the_online_parsing_and_validation(
    backend: oai.OpenAIBackend, fake: FakeOpenAIBatches
) -> None:
    items = {
        0: ask("two", n=2),
        1: ask("valid", structured_output=PERSON),
        2: ask("invalid", structured_output=PERSON),
        3: ask("regex", structured_output=StructuredOutput(RegexConstraint(r"[0-9]+"))),
        5: ask("refused"),
        6: ask("limited"),
    }
    fake.answers.extend(
        [
            "first answer",
            "second answer",
            json.dumps({"name": "Ada", "age": 36}),
            json.dumps({"name": "Ada"}),  # no age: the schema says it is required
            "42",
        ]
    )
    fake.line_errors["5"] = {
        "status_code": 400,
        "body": {"error": {"message": "Invalid 'messages'.", "type": "invalid_request_error", "code": None}},
    }
    fake.line_errors["6"] = {"status_code": 429, "body": {"error": {"message": "Rate limit reached"}}}
    fake.hold = True
    batch_id = await backend.submit_batch(sorted(items.items()))
    assert (await backend.batch_status(batch_id)).state is BatchState.RUNNING
    assert (await backend.batch_status(batch_id)).state is BatchState.RUNNING
    fake.hold = False
    status = await backend.batch_status(batch_id)
    assert (status.state, status.total, status.succeeded, status.failed) == (BatchState.ENDED, 6, 4, 2)
    got = await outcomes(backend, batch_id, items)
    assert sorted(got) == [0, 1, 2, 3, 5, 6]
    two = got[0]
    assert isinstance(two, GenerationResult)
    assert [g.text for g in two.generations] == ["first answer", "second answer"]
    assert [g.index for g in two.generations] == [0, 1]
    assert two.usage.output_tokens == 4 and two.usage.input_tokens > 0
    assert two.generations[0].finish_reason is FinishReason.STOP
    valid = got[1]
    assert isinstance(valid, GenerationResult) and valid.enforcement is Enforcement.NATIVE
    assert json.loads(valid.generations[0].text) == {"name": "Ada", "age": 36}
    invalid = got[2]
    assert isinstance(invalid, errors.Aborted) and invalid.reason == "VALIDATION_FAILED"
    regex = got[3]
    assert isinstance(regex, GenerationResult) and regex.enforcement is Enforcement.VALIDATED
    assert regex.generations[0].text == "42"
    refused = got[5]
    assert isinstance(refused, errors.InvalidArgument) and refused.reason == "UPSTREAM_BAD_REQUEST"
    assert "Invalid 'messages'" in refused.message
    limited = got[6]
    assert isinstance(limited, errors.ResourceExhausted)
    # Only the items still wanted come back (the others are already stored).
    assert sorted(await outcomes(backend, batch_id, {1: items[1], 5: items[5]})) == [1, 5]


async def test_no_reask_offline(backend: oai.OpenAIBackend, fake: FakeOpenAIBatches) -> None:
    fake.answers.append("not json at all")
    batch_id = await backend.submit_batch([(0, ask("x", structured_output=PERSON))])
    await backend.batch_status(batch_id)
    await backend.batch_status(batch_id)
    got = await outcomes(backend, batch_id, {0: ask("x", structured_output=PERSON)})
    assert isinstance(got[0], errors.Aborted) and "in 1 tries" in got[0].message
    assert not [r for r in fake.server.requests if r.path.endswith("/chat/completions")]


async def test_cancel_reaches_the_upstream(backend: oai.OpenAIBackend, fake: FakeOpenAIBatches) -> None:
    fake.hold = True
    items = {0: ask("a"), 1: ask("b")}
    batch_id = await backend.submit_batch(sorted(items.items()))
    await backend.cancel_batch(batch_id)
    assert fake.cancels == [batch_id]
    assert (await backend.batch_status(batch_id)).state is BatchState.CANCELLED
    assert await outcomes(backend, batch_id, items) == {}  # nothing ran: the driver ends them
    with pytest.raises(errors.InvalidArgument):  # an ended batch cannot be cancelled again
        await backend.cancel_batch(batch_id)


async def test_an_expired_batch_ends_its_items_expired(
    backend: oai.OpenAIBackend, fake: FakeOpenAIBatches
) -> None:
    fake.next_outcome = "expired"
    items = {0: ask("a"), 1: ask("b")}
    batch_id = await backend.submit_batch(sorted(items.items()))
    await backend.batch_status(batch_id)
    status = await backend.batch_status(batch_id)
    assert status.state is BatchState.EXPIRED and status.error
    got = await outcomes(backend, batch_id, items)
    assert all(
        isinstance(e, errors.DeadlineExceeded) and e.reason == "OFFLINE_BATCH_EXPIRED" for e in got.values()
    )
    assert sorted(got) == [0, 1]


async def test_a_refused_batch_is_failed_with_the_provider_s_reason(
    backend: oai.OpenAIBackend, fake: FakeOpenAIBatches
) -> None:
    fake.next_outcome = "failed"
    batch_id = await backend.submit_batch([(0, ask("a"))])
    status = await backend.batch_status(batch_id)
    assert status.state is BatchState.FAILED and "Enqueued token limit" in status.error
    assert await outcomes(backend, batch_id, {0: ask("a")}) == {}


async def test_upstream_errors_are_mapped_and_never_echo_the_key(
    backend: oai.OpenAIBackend, fake: FakeOpenAIBatches, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(errors.InvalidArgument) as missing:
        await backend.batch_status("batch_nope")
    assert missing.value.reason == "UPSTREAM_BAD_REQUEST"
    batch_id = await backend.submit_batch([(0, ask("a"))])
    assert batch_id.startswith("batch_")
    assert API_KEY not in caplog.text and API_KEY not in str(missing.value)


async def test_a_batch_holds_at_most_the_provider_s_limit(backend: oai.OpenAIBackend) -> None:
    assert backend.max_batch_items == 50_000
    with pytest.raises(errors.InvalidArgument):
        await backend.submit_batch([])
