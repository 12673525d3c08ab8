"""Anthropic Message Batches (backend.OfflineBatches) driven through the real `anthropic` SDK
against a loopback Message Batches API: each request's params are the online call's body, `n`
fans out into one request per choice, results come back through the online parsing and
validation, errors through the provider error mapping, and cancel reaches the upstream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import pytest

pytest.importorskip("anthropic", reason="the anthropic SDK is not installed (extra: gengate[anthropic])")

import contract_checks as cc
from fake_anthropic import API_KEY
from fake_anthropic_batch import FakeAnthropicBatches
from gengate import errors
from gengate.backend import BatchState
from gengate.domain import (
    Enforcement,
    GenerationRequest,
    GenerationResult,
    JsonSchemaConstraint,
    StoppingCriteria,
    StructuredOutput,
)
from gengate.providers.anthropic import AnthropicBackend

PERSON = StructuredOutput(JsonSchemaConstraint(cc.PERSON, name="person"))
Outcomes = dict[int, GenerationResult | errors.GengateError]


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeAnthropicBatches]:
    yield from cc.serving(FakeAnthropicBatches())


@pytest.fixture
async def backend(fake: FakeAnthropicBatches) -> AsyncIterator[AnthropicBackend]:
    async with cc.backends(
        AnthropicBackend, "claude", fake, model="claude-test", base_url=fake.server.base_url, api_key=API_KEY
    ) as make:
        built = await make()
        assert isinstance(built, AnthropicBackend)
        yield built


def ask(text: str = "Say hello", **kw: Any) -> GenerationRequest:
    return GenerationRequest(model="claude", prompt=text, request_id=f"r-{text}", **kw)


async def outcomes(
    backend: AnthropicBackend, batch_id: str, items: Mapping[int, GenerationRequest]
) -> Outcomes:
    return {index: outcome async for index, outcome in backend.batch_results(batch_id, items)}


async def test_each_request_is_the_online_call_s_body(
    backend: AnthropicBackend, fake: FakeAnthropicBatches
) -> None:
    request = ask(
        "who?",
        structured_output=PERSON,
        stopping=StoppingCriteria(max_tokens=64, stop=("END",)),
    )
    fake.answers.append(json.dumps({"name": "Ada", "age": 36}))
    await backend.generate(request)
    online = fake.server.requests[-1].body
    assert "output_config" in online
    batch_id = await backend.submit_batch([(3, request), (8, ask("two", n=2))])
    sent = fake.inputs[batch_id]
    assert [r["custom_id"] for r in sent] == ["3", "8-0", "8-1"]  # no `n`: one request per choice
    assert sent[0]["params"] == online
    assert "timeout" not in sent[1]["params"] and "stream" not in sent[1]["params"]
    assert backend.max_batch_items == 100_000 // backend.options.max_n


async def test_status_then_results(backend: AnthropicBackend, fake: FakeAnthropicBatches) -> None:
    items = {
        0: ask("two", n=2),
        1: ask("valid", structured_output=PERSON),
        2: ask("invalid", structured_output=PERSON),
        4: ask("refused"),
        5: ask("busy"),
    }
    fake.answers.extend(
        ["first answer", "second answer", json.dumps({"name": "Ada", "age": 36}), json.dumps({"age": -1})]
    )
    fake.request_errors.update({"4": "invalid_request_error", "5": "overloaded_error"})
    fake.hold = True
    batch_id = await backend.submit_batch(sorted(items.items()))
    assert (await backend.batch_status(batch_id)).state is BatchState.RUNNING
    fake.hold = False
    status = await backend.batch_status(batch_id)
    assert (status.state, status.total, status.succeeded, status.failed) == (BatchState.ENDED, 6, 4, 2)
    got = await outcomes(backend, batch_id, items)
    assert sorted(got) == [0, 1, 2, 4, 5]
    two = got[0]
    assert isinstance(two, GenerationResult)
    assert [g.text for g in two.generations] == ["first answer", "second answer"]
    assert [g.index for g in two.generations] == [0, 1]
    assert two.usage.output_tokens == 4  # both choices' requests counted
    valid = got[1]  # `minimum` is not enforced by Anthropic: the schema is validated
    assert isinstance(valid, GenerationResult) and valid.enforcement is Enforcement.VALIDATED
    assert json.loads(valid.generations[0].text) == {"name": "Ada", "age": 36}
    invalid = got[2]
    assert isinstance(invalid, errors.Aborted) and invalid.reason == "VALIDATION_FAILED"
    refused = got[4]
    assert isinstance(refused, errors.InvalidArgument) and "request 4 was refused" in refused.message
    assert isinstance(got[5], errors.ResourceExhausted | errors.Unavailable)


async def test_a_fanned_out_item_with_an_errored_choice_is_that_error(
    backend: AnthropicBackend, fake: FakeAnthropicBatches
) -> None:
    fake.request_errors["0-1"] = "api_error"
    batch_id = await backend.submit_batch([(0, ask("two", n=2))])
    await backend.batch_status(batch_id)
    got = await outcomes(backend, batch_id, {0: ask("two", n=2)})
    assert isinstance(got[0], errors.Unavailable)


async def test_cancel_reaches_the_upstream(backend: AnthropicBackend, fake: FakeAnthropicBatches) -> None:
    fake.hold = True
    items = {0: ask("a"), 1: ask("b")}
    batch_id = await backend.submit_batch(sorted(items.items()))
    await backend.cancel_batch(batch_id)
    assert fake.cancels == [batch_id]
    assert (await backend.batch_status(batch_id)).state is BatchState.CANCELLED
    got = await outcomes(backend, batch_id, items)
    assert all(
        isinstance(e, errors.Cancelled) and e.reason == "OFFLINE_BATCH_CANCELLED" for e in got.values()
    )
    assert sorted(got) == [0, 1]


async def test_an_expired_batch(backend: AnthropicBackend, fake: FakeAnthropicBatches) -> None:
    fake.next_outcome = "expired"
    batch_id = await backend.submit_batch([(0, ask("a"))])
    status = await backend.batch_status(batch_id)
    assert status.state is BatchState.EXPIRED
    got = await outcomes(backend, batch_id, {0: ask("a")})
    assert isinstance(got[0], errors.DeadlineExceeded) and got[0].reason == "OFFLINE_BATCH_EXPIRED"


async def test_an_unknown_batch_is_a_mapped_error(backend: AnthropicBackend) -> None:
    with pytest.raises(errors.InvalidArgument) as missing:
        await backend.batch_status("msgbatch_nope")
    assert API_KEY not in missing.value.message
