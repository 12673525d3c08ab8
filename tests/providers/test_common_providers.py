"""Shared provider infrastructure: error mapping by meaning, the secret scrubber, Retry-After,
the retry policy and deadlines, OpenAI strict-schema transforms, default provider entries."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from gengate import errors
from gengate.constraints import validate_output
from gengate.domain import ChoiceConstraint, JsonSchemaConstraint, RegexConstraint, StructuredOutput
from gengate.providers import structured as so
from gengate.providers.defaults import default_provider_entries
from gengate.providers.errors import (
    from_status,
    normalize_exception,
    parse_retry_after,
    register_secret,
    scrub,
)
from gengate.providers.retry import RetryPolicy, call_with_retries, stream_with_retries


def test_scrubber_removes_registered_and_credential_shaped_secrets() -> None:
    register_secret("my-very-secret-value")
    text = scrub("key my-very-secret-value and sk-abcdefgh12345678 and Bearer abcdefghijkl; hf_abcdefghijk")
    assert "my-very-secret-value" not in text and "sk-abcdefgh12345678" not in text
    assert "abcdefghijkl" not in text and "hf_abcdefghijk" not in text
    assert text.count("[REDACTED]") == 4


@pytest.mark.parametrize(
    ("status", "body", "expected", "reason"),
    [
        (429, {"error": {"message": "slow down"}}, errors.ResourceExhausted, "UPSTREAM_RATE_LIMITED"),
        (503, "overloaded, retry later", errors.ResourceExhausted, "UPSTREAM_RATE_LIMITED"),
        (529, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
         errors.ResourceExhausted, "UPSTREAM_RATE_LIMITED"),
        (500, {"error": {"message": "boom"}}, errors.Unavailable, "UPSTREAM_UNAVAILABLE"),
        (502, None, errors.Unavailable, "UPSTREAM_UNAVAILABLE"),
        (401, {"error": {"message": "Incorrect API key sk-live-0000000000"}}, errors.Internal,
         "UPSTREAM_AUTH_FAILED"),
        (403, None, errors.Internal, "UPSTREAM_AUTH_FAILED"),
        (400, {"error": {"message": "Invalid API key provided"}}, errors.Internal, "UPSTREAM_AUTH_FAILED"),
        (500, {"error": {"message": "invalid api key"}}, errors.Internal, "UPSTREAM_AUTH_FAILED"),
        (400, {"error": {"message": "max_tokens too large"}}, errors.InvalidArgument, "UPSTREAM_BAD_REQUEST"),
        (400, {"error": {"message": "maximum context length exceeded"}}, errors.InvalidArgument,
         "UPSTREAM_CONTEXT_LENGTH"),
        (504, None, errors.DeadlineExceeded, "UPSTREAM_TIMEOUT"),
    ],
)  # fmt: skip
def test_status_mapping_by_meaning(status: int, body: Any, expected: type, reason: str) -> None:
    error = from_status(status, body, provider="P")
    assert isinstance(error, expected) and error.reason == reason
    assert "sk-live" not in error.message


def test_429_carries_retry_after() -> None:
    error = from_status(429, None, headers={"Retry-After": "12"})
    assert error.retry_after_s == 12.0
    assert parse_retry_after({"retry-after-ms": "250"}) == 0.25
    assert parse_retry_after({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0
    assert parse_retry_after({}) is None


def test_normalize_plain_exceptions() -> None:
    assert isinstance(normalize_exception(TimeoutError()), errors.DeadlineExceeded)
    assert isinstance(normalize_exception(ConnectionRefusedError("refused")), errors.Unavailable)
    assert isinstance(normalize_exception(ValueError("bad json")), errors.Unavailable)

    class FakeStatusError(Exception):
        status_code = 429
        body = "quota"

    assert isinstance(normalize_exception(FakeStatusError()), errors.ResourceExhausted)


async def test_retries_then_success_with_backoff() -> None:
    calls: list[float] = []

    async def attempt() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise errors.Unavailable("down")
        return "ok"

    policy = RetryPolicy(max_retries=3, base_delay_s=0.05, max_delay_s=0.1)
    assert await call_with_retries(attempt, policy=policy, deadline=None, provider="P") == "ok"
    assert len(calls) == 3 and calls[2] - calls[1] >= 0.025


async def test_non_retryable_and_exhausted() -> None:
    calls = 0

    async def bad_request() -> None:
        nonlocal calls
        calls += 1
        raise errors.InvalidArgument("no")

    with pytest.raises(errors.InvalidArgument):
        await call_with_retries(bad_request, policy=RetryPolicy(max_retries=3), deadline=None, provider="P")
    assert calls == 1

    async def down() -> None:
        raise errors.Unavailable("down")

    with pytest.raises(errors.Unavailable) as info:
        await call_with_retries(down, policy=RetryPolicy(2, 0.01, 0.01), deadline=None, provider="P")
    assert "after 3 attempts" in info.value.message


async def test_deadline_cuts_a_slow_attempt_and_skips_long_sleeps() -> None:
    cut: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cut.append("slow attempt cancelled")
            raise

    with pytest.raises(errors.DeadlineExceeded):
        await call_with_retries(slow, policy=RetryPolicy(), deadline=time.monotonic() + 0.2, provider="P")
    assert cut == ["slow attempt cancelled"]  # the attempt was stopped, not waited for

    attempts: list[int] = []

    async def limited() -> None:
        attempts.append(1)
        raise errors.ResourceExhausted("later", retry_after_s=10)

    with pytest.raises(errors.ResourceExhausted) as info:
        await call_with_retries(limited, policy=RetryPolicy(5), deadline=time.monotonic() + 2, provider="P")
    # a 10 s Retry-After past a 2 s deadline: raised at once, no sleep, no second attempt
    assert attempts == [1] and "deadline is too close" in info.value.message


async def test_stream_retries_only_before_first_item() -> None:
    opened = 0

    async def flaky() -> Any:
        nonlocal opened
        opened += 1
        if opened == 1:
            raise errors.Unavailable("reset")
        yield 1
        raise errors.Unavailable("reset mid-stream")

    got = []
    with pytest.raises(errors.Unavailable):
        async for item in stream_with_retries(
            flaky, policy=RetryPolicy(5, 0.01, 0.01), deadline=None, provider="P"
        ):
            got.append(item)
    assert got == [1] and opened == 2  # retried before the first item, not after


def test_openai_strict_transform_and_strip() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"$ref": "#/$defs/B"},
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        },
        "required": ["a"],
        "$defs": {"B": {"type": "object", "properties": {"x": {"type": "string"}}}},
    }
    wire, wrapped, relaxed = so.openai_strict_schema(schema)
    assert not wrapped and relaxed  # uniqueItems dropped: result only validated
    assert wire["required"] == ["a", "b", "tags"] and wire["additionalProperties"] is False
    assert wire["$defs"]["B"]["required"] == ["x"] and wire["$defs"]["B"]["additionalProperties"] is False
    assert wire["properties"]["b"] == {"anyOf": [{"$ref": "#/$defs/B"}, {"type": "null"}]}
    value = {"a": 1, "b": {"x": None}, "tags": None}
    assert so.strip_added_nulls(value, schema, schema) == {"a": 1, "b": {}}
    _, wrapped, _ = so.openai_strict_schema({"type": "array", "items": {"type": "integer"}})
    assert wrapped


def test_added_nulls_are_stripped_through_every_kind_of_ref() -> None:
    """$refs resolve as JSON Schema says (the `referencing` library): pointers with escapes,
    anchors, refs of refs; a cycle or a dangling ref leaves the value as it is, never a crash."""
    schema = {
        "type": "object",
        "properties": {
            "p": {"$ref": "#/$defs/a~1b"},
            "q": {"$ref": "#node"},
            "r": {"$ref": "#/$defs/alias"},
            "loop": {"$ref": "#/$defs/loop"},
            "gone": {"$ref": "#/$defs/missing"},
        },
        "$defs": {
            "a/b": {"type": "object", "properties": {"x": {"type": "string"}}},
            "named": {"$anchor": "node", "type": "object", "properties": {"y": {"type": "integer"}}},
            "alias": {"$ref": "#/$defs/a~1b"},
            "loop": {"$ref": "#/$defs/loop"},
        },
    }
    value = {"p": {"x": None}, "q": {"y": None}, "r": {"x": None}, "loop": {"z": None}, "gone": {"w": None}}
    assert so.strip_added_nulls(value, schema, schema) == {
        "p": {},
        "q": {},
        "r": {},
        "loop": {"z": None},
        "gone": {"w": None},
    }


def test_plan_unwraps_and_validates_against_the_original() -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 2}
    plan = so.plan_openai_style(
        StructuredOutput(JsonSchemaConstraint(schema)), so.Enforcement.NATIVE, strict_transform=True
    )
    text = plan.unwrap('{"value": [1, 2, 3]}')
    assert text == "[1, 2, 3]" and validate_output(plan.structured, text) is not None
    choice = so.plan_openai_style(
        StructuredOutput(ChoiceConstraint(("a", "b"))), so.Enforcement.NATIVE, strict_transform=False
    )
    assert choice.unwrap('"b"') == "b"
    regex = StructuredOutput(RegexConstraint(r"\d+"))
    assert validate_output(regex, "12") is None and validate_output(regex, "12a") is not None
    with pytest.raises(errors.Unimplemented) as info:
        so.check_supported(regex, {}, provider="X")
    assert "regex" in info.value.message and "X" in info.value.message


def test_default_provider_entries_name_the_variable_never_the_key() -> None:
    entries = default_provider_entries({"OPENAI_API_KEY": "sk-secret-123456789", "CO_API_KEY": ""})
    openai_entry = next(e for e in entries if e["name"] == "openai")
    assert openai_entry == {
        "name": "openai",
        "backend": "openai",
        "model": "gpt-4o-mini",
        "api_key_env": "OPENAI_API_KEY",
    }
    assert not any(e["name"] == "cohere" for e in entries)
    assert "sk-secret" not in repr(entries)
