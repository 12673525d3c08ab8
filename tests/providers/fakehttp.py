"""A scripted loopback HTTP server for provider fakes: each fake module adds routes that speak
its provider's wire protocol; this harness adds the faults every provider must survive.

The server runs aiohttp on 127.0.0.1:0 in its own thread and event loop, so a blocking SDK
cannot stall it and the test's loop stays free. Faults are queued and consumed one request at
a time: an HTTP status with headers, body and content type, a slow answer, a malformed body, a
stream that breaks (connection dropped) or ends (clean EOF) after k events. Every request and
every client disconnect mid-stream is recorded.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Json:
    """A JSON reply."""

    body: Any
    status: int = 200


@dataclass
class Raw:
    """Any other reply: bytes with a content type (a file download, a JSONL stream)."""

    body: bytes
    content_type: str = "application/octet-stream"
    status: int = 200


@dataclass
class Sse:
    """A server-sent-events reply: (event name or None, data string) pairs, then EOF."""

    events: list[tuple[str | None, str]]


@dataclass
class Fault:
    """What the next request gets instead of (or on top of) the normal answer."""

    status: int | None = None
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    malformed: bool = False
    break_after: int | None = None
    # With `status`: the Content-Type of that reply (a proxy's HTML page, a JSON document).
    content_type: str = "application/json"
    # An event stream that ends cleanly (EOF, no error) after this many events, finish or not.
    end_after: int | None = None
    # Close the connection without answering (the request read), as an upstream restarting does.
    hang_up: bool = False
    # A header of this many bytes on the answer (a proxy's or CDN's long header).
    header_bytes: int = 0


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any
    # When the request arrived (time.monotonic()): how long a client waited between attempts.
    arrived_at: float = 0.0
    raw: bytes = b""  # the body as sent (a multipart upload), `body` its JSON or text reading
    # The client's (host, port): requests over one kept-alive connection share it.
    peer: tuple[str, int] | None = None


Handler = Callable[[Recorded], Awaitable[Json | Sse | Raw] | Json | Sse | Raw]


class FakeServer:
    """The harness: `add_route`, `start()`, then queue faults and inspect `requests`."""

    def __init__(self, *, auth: Callable[[Recorded], bool], unauthorized: Callable[[], Json]) -> None:
        self._auth = auth
        self._unauthorized = unauthorized
        self._routes: list[tuple[str, str, Handler]] = []
        self.faults: list[Fault] = []
        self.requests: list[Recorded] = []
        self.disconnects = 0
        self.abandoned = 0  # delayed requests the client hung up on before any answer
        self.in_flight = 0
        self.max_in_flight = 0  # the most requests the fake was answering at once
        self.completed_streams = 0
        self.event_delay_s = 0.0
        self.events_in_one_write = False  # a whole event stream in one write (one chunk), then EOF
        self.base_url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        self._routes.append((method, path, handler))

    def fail_next(self, *faults: Fault) -> None:
        with self._lock:
            self.faults.extend(faults)

    def reset(self) -> None:
        with self._lock:
            self.faults.clear()
            self.requests.clear()
            self.disconnects = 0
            self.abandoned = 0
            self.in_flight = self.max_in_flight = 0
            self.completed_streams = 0
            self.event_delay_s = 0.0
            self.events_in_one_write = False

    def start(self) -> str:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            app = web.Application()
            for method, path, handler in self._routes:
                app.router.add_route(method, path, self._wrap(handler))
            runner = web.AppRunner(app, handler_cancellation=True)
            self._runner = runner
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.base_url = f"http://127.0.0.1:{port}"
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-provider", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self.base_url

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)

    async def until_abandoned(self, count: int = 1) -> None:
        """Waits until the client hung up on `count` delayed requests (the fake saw it happen);
        a test stuck here fails by pytest's timeout."""
        while self.abandoned < count:
            await asyncio.sleep(0.02)

    def wait_for_disconnect(self, timeout: float = 5.0) -> bool:
        """Blocks until a client dropped a stream mid-way (polling; the fake runs in a thread)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.disconnects:
                return True
            time.sleep(0.02)
        return False

    def _next_fault(self) -> Fault | None:
        with self._lock:
            return self.faults.pop(0) if self.faults else None

    def _wrap(self, handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def serve(request: web.Request) -> web.StreamResponse:
            with self._lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                return await answer(request)
            finally:
                with self._lock:
                    self.in_flight -= 1

        async def answer(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
            rec = Recorded(
                request.method,
                request.path,
                dict(request.query),
                {k.lower(): v for k, v in request.headers.items()},
                body,
                time.monotonic(),
                raw,
                request.transport.get_extra_info("peername") if request.transport else None,
            )
            with self._lock:
                self.requests.append(rec)
            if not self._auth(rec):
                reply = self._unauthorized()
                return web.json_response(reply.body, status=reply.status)
            fault = self._next_fault()
            if fault and fault.delay_s:
                try:
                    await asyncio.sleep(fault.delay_s)
                except asyncio.CancelledError:  # the client gave up on the slow answer and hung up
                    with self._lock:
                        self.abandoned += 1
                    raise
            if fault and fault.hang_up:
                assert request.transport is not None
                request.transport.close()
                return web.Response(status=500)  # never sent: the connection is gone
            if fault and fault.status is not None:
                text = fault.body if isinstance(fault.body, str) else json.dumps(fault.body or {})
                return web.Response(
                    status=fault.status, text=text, headers=fault.headers, content_type=fault.content_type
                )
            if fault and fault.malformed:
                return web.Response(
                    status=200, text='{"not": "what you expected', content_type="application/json"
                )
            result = handler(rec)
            reply = await result if asyncio.iscoroutine(result) else result
            padding = {"X-Padding": "a" * fault.header_bytes} if fault and fault.header_bytes else {}
            if isinstance(reply, Json):
                return web.json_response(reply.body, status=reply.status, headers=padding)
            if isinstance(reply, Raw):
                return web.Response(
                    body=reply.body, status=reply.status, content_type=reply.content_type, headers=padding
                )
            if fault and fault.end_after is not None:
                reply = Sse(reply.events[: fault.end_after])
            return await self._stream(request, reply, fault.break_after if fault else None, padding)

        return serve

    async def _stream(
        self, request: web.Request, reply: Sse, break_after: int | None, headers: dict[str, str] | None = None
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **(headers or {})}
        )
        await response.prepare(request)
        try:
            frames = [(f"event: {name}\n" if name else "") + f"data: {data}\n\n"
                      for name, data in reply.events]  # fmt: skip
            if self.events_in_one_write and break_after is None:
                frames = ["".join(frames)]
            for i, frame in enumerate(frames):
                if break_after is not None and i >= break_after:
                    # Drop the TCP connection mid-stream, as a crashed upstream would.
                    assert request.transport is not None
                    request.transport.close()
                    return response
                await response.write(frame.encode())
                if self.event_delay_s:
                    await asyncio.sleep(self.event_delay_s)
            await response.write_eof()
            self.completed_streams += 1
        except (ConnectionResetError, asyncio.CancelledError, OSError):
            with self._lock:
                self.disconnects += 1
            raise
        return response
