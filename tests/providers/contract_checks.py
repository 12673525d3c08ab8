"""The behaviours every remote provider must show, written once and run by each provider's test
module against its own fake (a FakeServer speaking that provider's wire protocol).

`make(**options)` builds and starts a backend pointed at the fake; `fake` has `.server` (the
FakeServer) and `.answers` (texts the fake returns, in order).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar

import pytest
from fakehttp import FakeServer, Fault
from gengate import errors
from gengate.backend import Backend
from gengate.domain import (
    Enforcement,
    FinishReason,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    JsonSchemaConstraint,
    StreamEvent,
    StreamStart,
    StructuredOutput,
)
from gengate.providers.errors import UPSTREAM_UNAVAILABLE
from pydantic import SecretStr


class Fake(Protocol):
    server: FakeServer
    answers: list[str]

    def reset(self) -> None: ...


Make = Callable[..., Awaitable[Backend]]
Started = TypeVar("Started", bound="Startable")


class Startable(Protocol):
    def start(self) -> str: ...
    def stop(self) -> None: ...


def serving(fake: Started) -> Iterator[Started]:
    """Runs a fake server for a module-scoped fixture: `yield from cc.serving(FakeX())`."""
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


@contextlib.asynccontextmanager
async def backends(cls: Any, name: str, fake: Fake | None, **defaults: Any) -> AsyncIterator[Make]:
    """`make(**overrides)` builds and starts backends of `cls` from `defaults | overrides`
    (short timeout, one retry, api_key as a secret); every one is closed at the end."""
    if fake is not None:
        fake.reset()
    made: list[Backend] = []

    async def build(**overrides: Any) -> Backend:
        options = {"timeout": 5.0, "max_retries": 1} | defaults | overrides
        if isinstance(options.get("api_key"), str):
            options["api_key"] = SecretStr(options["api_key"])
        backend: Backend = cls(name, cls.Options(**options))
        await backend.start()
        made.append(backend)
        return backend

    try:
        yield build
    finally:
        for backend in made:
            await backend.aclose()


def sdk_hook(owner: Any, name: str, *parameters: str) -> None:
    """`owner.name` exists and takes `parameters`, or the test fails saying which: the pin on a
    private SDK hook a raw provider path calls (see the backend's docstring)."""
    where = f"{getattr(owner, '__module__', '')}.{getattr(owner, '__name__', type(owner).__name__)}.{name}"
    assert hasattr(owner, name), (
        f"{where} is gone: a raw provider path calls it (see the backend's docstring)"
    )
    if parameters:
        taken = set(inspect.signature(getattr(owner, name)).parameters)
        missing = [p for p in parameters if p not in taken]
        assert not missing, f"{where} no longer takes {missing}: a raw provider path passes them"


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


def prompt(text: str = "Say hello", **kw: Any) -> GenerationRequest:
    return GenerationRequest(model="m", prompt=text, request_id="req-1", **kw)


async def collect(stream: Any) -> list[StreamEvent]:
    return [event async for event in stream]


async def check_text(make: Make, fake: Fake) -> None:
    fake.answers.append("Hello there, friend")
    backend = await make()
    result = await backend.generate(prompt())
    assert [g.text for g in result.generations] == ["Hello there, friend"]
    assert result.generations[0].finish_reason == FinishReason.STOP
    assert result.usage.input_tokens > 0
    assert result.usage.output_tokens == 3
    assert result.enforcement == Enforcement.NONE


async def check_stream(make: Make, fake: Fake) -> list[StreamEvent]:
    fake.answers.append("one two three four")
    backend = await make()
    events = await collect(backend.generate_stream(prompt()))
    assert isinstance(events[0], StreamStart)
    text = "".join(e.text for e in events if isinstance(e, GenerationDelta))
    assert text == "one two three four"
    ends = [e for e in events if isinstance(e, GenerationEnd)]
    assert len(ends) == 1 and events[-1] is ends[0]
    assert ends[0].finish_reason == FinishReason.STOP
    assert ends[0].usage.output_tokens == 4  # the provider's own count, from the final frame
    assert ends[0].usage.input_tokens > 0
    return events


async def check_streams_keep_the_connection(
    make: Make, fake: Fake, request: GenerationRequest | None = None
) -> None:
    """Streams one after another, then a unary call, all over one upstream connection: a stream
    read to its end leaves its HTTP/1.1 connection to the pool (one closed unread drops it, and
    every stream would pay a new connection, over TLS a handshake)."""
    backend = await make()
    before = len(fake.server.requests)
    for text in ("one two", "three four", "five six"):
        fake.answers.append(text)
        events = await collect(backend.generate_stream(request or prompt()))
        assert "".join(e.text for e in events if isinstance(e, GenerationDelta)) == text
    fake.answers.append("seven")
    await backend.generate(request or prompt())
    peers = [r.peer for r in fake.server.requests[before:]]
    assert len(peers) == 4 and None not in peers
    assert len(set(peers)) == 1, f"{len(set(peers))} connections for 3 streams and a call"


async def check_n2(make: Make, fake: Fake, *, native: bool) -> None:
    fake.answers.extend(["first answer", "second answer"])
    backend = await make()
    result = await backend.generate(prompt(n=2))
    assert sorted(g.text for g in result.generations) == ["first answer", "second answer"]
    assert [g.index for g in result.generations] == [0, 1]
    assert result.usage.output_tokens == 4
    assert len(fake.server.requests) == (1 if native else 2)


async def check_json_schema(make: Make, fake: Fake, *, level: Enforcement) -> dict[str, Any]:
    """A schema request: the fake's answer is valid; returns the upstream request body."""
    fake.answers.append(json.dumps({"name": "Ada", "age": 36}))
    backend = await make()
    structured = StructuredOutput(JsonSchemaConstraint(PERSON, name="person"))
    result = await backend.generate(prompt("Who?", structured_output=structured))
    assert json.loads(result.generations[0].text) == {"name": "Ada", "age": 36}
    assert result.enforcement == level
    body: dict[str, Any] = fake.server.requests[-1].body
    return body


async def check_reask(make: Make, fake: Fake) -> None:
    """An answer invalid against the ORIGINAL schema is re-asked with the error, never returned."""
    fake.answers.extend([json.dumps({"name": "Ada", "age": -3}), json.dumps({"name": "Ada", "age": 3})])
    backend = await make()
    structured = StructuredOutput(JsonSchemaConstraint(PERSON))
    result = await backend.generate(prompt("Who?", structured_output=structured))
    assert json.loads(result.generations[0].text)["age"] == 3
    assert len(fake.server.requests) == 2
    assert "minimum" in json.dumps(fake.server.requests[1].body) or "-3" in json.dumps(
        fake.server.requests[1].body
    )
    fake.answers[:] = [json.dumps({"name": "Ada", "age": -1})] * 5
    with pytest.raises(errors.Aborted) as info:
        await backend.generate(prompt("Who?", structured_output=structured))
    assert info.value.reason == "VALIDATION_FAILED"


async def retried_through(make: Make, fake: Fake, fault: Fault, *, max_retries: int = 1) -> list[Any]:
    """One call whose first attempt meets `fault` and whose retry is answered: the answer comes
    through, after two requests (returned, the upstream's records of them)."""
    fake.server.fail_next(fault)
    fake.answers.append("after the retry")
    backend = await make(max_retries=max_retries)
    sent = len(fake.server.requests)
    result = await backend.generate(prompt())
    assert result.generations[0].text == "after the retry"
    assert len(fake.server.requests) == sent + 2
    return list(fake.server.requests[-2:])


async def check_429_then_success(make: Make, fake: Fake, body: Any = None) -> None:
    retry_after = Fault(status=429, headers={"Retry-After": "0.3"}, body=body)
    first, second = await retried_through(make, fake, retry_after, max_retries=2)
    assert second.arrived_at - first.arrived_at >= 0.3  # Retry-After honoured, seen by the upstream


async def check_429_exhausted(make: Make, fake: Fake, body: Any = None) -> None:
    fake.server.fail_next(Fault(status=429, headers={"Retry-After": "7"}, body=body))
    backend = await make(max_retries=0)
    with pytest.raises(errors.ResourceExhausted) as info:
        await backend.generate(prompt())
    assert info.value.retry_after_s == 7.0


async def check_500_unavailable(make: Make, fake: Fake, body: Any = None) -> None:
    fake.server.fail_next(*[Fault(status=500, body=body) for _ in range(3)])
    backend = await make(max_retries=1)
    with pytest.raises(errors.Unavailable):
        await backend.generate(prompt())
    assert len(fake.server.requests) == 2


async def check_hang_up(make: Make, fake: Fake) -> None:
    """An upstream that closes the connection without answering is unreachable for that attempt
    (UNAVAILABLE, retryable; never a timeout, as aiohttp's transport for httpx calls it): with
    a retry the next answer comes through, without one the call fails at once."""
    await retried_through(make, fake, Fault(hang_up=True))
    fake.server.fail_next(Fault(hang_up=True))
    backend = await make(max_retries=0)
    with pytest.raises(errors.Unavailable) as info:
        await backend.generate(prompt())
    assert info.value.reason == UPSTREAM_UNAVAILABLE, info.value


async def check_unreachable(make: Make, fake: Fake) -> None:
    """A base URL where nothing listens is UNAVAILABLE (UPSTREAM_UNAVAILABLE) at once, for a
    unary call and a stream, not DEADLINE_EXCEEDED (aiohttp's transport for httpx raises a
    refused connection as ConnectTimeout)."""
    # (A refusal waited out would be DEADLINE_EXCEEDED; the test's own timeout is shorter.)
    backend = await make(base_url=f"http://127.0.0.1:{closed_port()}", max_retries=0, timeout=600)
    for call in (backend.generate(prompt()), collect(backend.generate_stream(prompt()))):
        with pytest.raises(errors.Unavailable) as info:
            await call
        assert info.value.reason == UPSTREAM_UNAVAILABLE, info.value


async def check_long_headers(make: Make, fake: Fake, *, reads_20k: bool = True) -> None:
    """An answer with a 20 KB header (a proxy's, a CDN's) is read (where gengate builds the HTTP
    client: `reads_20k`); one with a 200 KB header is UNAVAILABLE (retryable, the upstream's
    fault), never the caller's INVALID_ARGUMENT."""
    backend = await make(max_retries=0)
    if reads_20k:
        fake.server.fail_next(Fault(header_bytes=20_000))
        fake.answers.append("under a long header")
        assert (await backend.generate(prompt())).generations[0].text == "under a long header"
    fake.server.fail_next(Fault(header_bytes=200_000))
    fake.answers.append("never read")
    with pytest.raises(errors.Unavailable):
        await backend.generate(prompt())


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def check_timeout(make: Make, fake: Fake) -> None:
    fake.server.fail_next(Fault(delay_s=3.0))
    backend = await make(timeout=0.3, max_retries=0)
    abandoned = fake.server.abandoned
    with pytest.raises(errors.DeadlineExceeded):
        await backend.generate(prompt())
    await fake.server.until_abandoned(abandoned + 1)  # the upstream call was dropped, not left to finish


async def check_deadline(make: Make, fake: Fake) -> None:
    """The caller's deadline bounds the call even with a generous configured timeout."""
    fake.server.fail_next(Fault(delay_s=3.0))
    backend = await make(timeout=30, max_retries=3)
    abandoned, sent = fake.server.abandoned, len(fake.server.requests)
    with pytest.raises(errors.DeadlineExceeded):
        await backend.generate(prompt(deadline=time.monotonic() + 0.4))
    await fake.server.until_abandoned(abandoned + 1)  # the caller's deadline dropped the upstream call
    assert len(fake.server.requests) == sent + 1  # and no retry was started past it


async def check_bad_key(make: Make, fake: Fake, caplog: pytest.LogCaptureFixture, bad_key: str) -> None:
    caplog.set_level(logging.DEBUG)
    backend = await make(api_key=bad_key)
    for call in (backend.generate(prompt()), collect(backend.generate_stream(prompt()))):
        with pytest.raises(errors.Internal) as info:
            await call
        assert info.value.reason == "UPSTREAM_AUTH_FAILED"
        assert bad_key not in str(info.value) and bad_key not in info.value.message
        assert bad_key not in json.dumps(info.value.metadata)
    assert bad_key not in caplog.text


async def check_cancel_closes_upstream(make: Make, fake: Fake) -> None:
    fake.answers.append(" ".join(f"w{i}" for i in range(200)))
    fake.server.event_delay_s = 0.05
    backend = await make()
    stream = backend.generate_stream(prompt())
    deltas = 0
    async for event in stream:
        if isinstance(event, GenerationDelta):
            deltas += 1
            if deltas == 3:
                break
    await stream.aclose()  # type: ignore[attr-defined]
    assert await asyncio.to_thread(fake.server.wait_for_disconnect, 5.0)
    assert fake.server.completed_streams == 0


async def check_task_cancel_closes_upstream(make: Make, fake: Fake) -> None:
    """Cancelling the consuming task (what a cancelled gRPC call does) also drops the upstream."""
    fake.answers.append(" ".join(f"w{i}" for i in range(200)))
    fake.server.event_delay_s = 0.05
    backend = await make()
    got_one = asyncio.Event()

    async def consume() -> None:
        async for event in backend.generate_stream(prompt()):
            if isinstance(event, GenerationDelta):
                got_one.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_one.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(fake.server.wait_for_disconnect, 5.0)


async def check_broken_stream(make: Make, fake: Fake) -> None:
    """A stream the upstream drops mid-way ends in an error, never a silent short success."""
    fake.answers.append("a b c d e f g h")
    fake.server.fail_next(Fault(break_after=4))
    backend = await make(max_retries=0)
    with pytest.raises(errors.GengateError) as info:
        await collect(backend.generate_stream(prompt()))
    assert isinstance(info.value, errors.Unavailable | errors.Internal | errors.Aborted)


async def check_malformed(make: Make, fake: Fake) -> None:
    fake.server.fail_next(Fault(malformed=True))
    backend = await make(max_retries=0)
    with pytest.raises(errors.GengateError) as info:
        await backend.generate(prompt())
    assert not isinstance(info.value, errors.InvalidArgument)
