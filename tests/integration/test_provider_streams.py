"""A provider stream whose upstream answers 200 with something other than a complete event
stream ends UNAVAILABLE (UPSTREAM_PROTOCOL) over gRPC, never OK with empty or short text.

Each provider runs through its real SDK against its loopback fake (tests/providers)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "providers"))

import fake_anthropic
import fake_cohere
import fake_gemini
import fake_mistral
import fake_openai
import fake_tgi
from fakehttp import Fault
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from observe import reason

# provider: (SDK it needs, fake factory, model entry given the fake's base URL)
PROVIDERS: dict[str, tuple[str, Callable[[], Any], Callable[[str], dict[str, Any]]]] = {
    "openai": (
        "openai",
        fake_openai.FakeOpenAI,
        lambda url: {"backend": "openai", "model": "gpt-fake", "base_url": url + "/v1",
                     "api_key": fake_openai.API_KEY},
    ),
    "anthropic": (
        "anthropic",
        fake_anthropic.FakeAnthropic,
        lambda url: {"backend": "anthropic", "model": "claude-test", "base_url": url,
                     "api_key": fake_anthropic.API_KEY},
    ),
    "mistral": (
        "mistralai",
        fake_mistral.FakeChatCompletions,
        lambda url: {"backend": "mistral", "model": "mistral-test", "base_url": url,
                     "api_key": fake_mistral.API_KEY},
    ),
    "cohere": (
        "cohere",
        fake_cohere.FakeCohere,
        lambda url: {"backend": "cohere", "model": "command-test", "base_url": url,
                     "api_key": fake_cohere.API_KEY},
    ),
    "gemini": (
        "google.genai",
        fake_gemini.FakeGemini,
        lambda url: {"backend": "gemini", "model": "gemini-test", "base_url": url,
                     "api_key": fake_gemini.API_KEY},
    ),
    "tgi": (
        "huggingface_hub",
        fake_tgi.FakeTGI,
        lambda url: {"backend": "tgi", "model": "tgi-test", "base_url": url, "api_key": fake_tgi.API_KEY},
    ),
}  # fmt: skip

# What the upstream answers a streaming request with, instead of a whole event stream.
FAULTS = {
    "json document": Fault(status=200, body={"id": "x", "object": "chat.completion", "choices": []}),
    "html page": Fault(status=200, body="<html><body>Sign in</body></html>", content_type="text/html"),
    "empty event stream": Fault(end_after=0),
    "event stream ending before its finish": Fault(end_after=3),
}


@pytest.fixture(scope="module", params=sorted(PROVIDERS))
def provider(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    sdk, factory, _ = PROVIDERS[request.param]
    pytest.importorskip(sdk)
    fake = factory()
    fake.start()
    yield request.param, fake
    fake.stop()


async def test_stream_without_a_whole_event_stream_is_unavailable(
    make_server: Any, provider: tuple[str, Any]
) -> None:
    name, fake = provider
    fake.reset()
    entry = {"name": "remote", "max_retries": 0, **PROVIDERS[name][2](fake.server.base_url)}
    server = await make_server({"models": [entry]})
    request = g.GenerateStreamRequest(request=g.GenerateRequest(model="remote", prompt="hi"))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        fake.answers.append("one two three four five six")
        frames = [frame async for frame in stub.GenerateStream(request, timeout=10)]
        assert frames[-1].WhichOneof("frame") == "end"  # the fake's real stream is served
        for what, fault in FAULTS.items():
            fake.answers.append("one two three four five six")
            fake.server.fail_next(fault)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.GenerateStream(request, timeout=10):
                    pass
            error = caught.value
            assert error.code() == grpc.StatusCode.UNAVAILABLE, (what, error.details())
            assert reason(error) == "UPSTREAM_PROTOCOL", (what, error.details())
            assert "server-sent-event stream" in (error.details() or ""), what


async def test_deltas_ready_together_arrive_merged_and_spaced_ones_arrive_whole(
    make_server: Any, provider: tuple[str, Any]
) -> None:
    """What the upstream sends in one write reaches the client merged (one delta frame, two if
    TCP splits it); sent spaced, it arrives as it comes. Either way the text and the token count
    are the unary answer's (gengate/api/coalesce.py; a delta arriving while the writer is idle
    going alone is held in tests/unit/test_coalesce.py)."""
    name, fake = provider
    fake.reset()
    entry = {"name": "remote", "max_retries": 0, **PROVIDERS[name][2](fake.server.base_url)}
    server = await make_server({"models": [entry]})
    words = "one two three four five six"
    request = g.GenerateRequest(model="remote", prompt="hi")
    streamed = g.GenerateStreamRequest(request=request)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        fake.answers.append(words)
        unary = await stub.Generate(request, timeout=10)
        streams = {}
        for way in ("one write", "spaced"):
            fake.server.events_in_one_write = way == "one write"
            fake.server.event_delay_s = 0.02 if way == "spaced" else 0.0
            fake.answers.append(words)
            frames = [f async for f in stub.GenerateStream(streamed, timeout=10)]
            deltas = [f.delta for f in frames if f.WhichOneof("frame") == "delta"]
            assert "".join(d.text for d in deltas) == unary.generations[0].text == words, way
            assert sum(d.token_count for d in deltas) == frames[-1].end.usage.output_tokens, way
            streams[way] = deltas
    # (counts of frames, not times: a body written at once reaches the server in one read, or
    # two should TCP split it; how spaced chunks fall depends on timing, so they are not counted)
    assert len(streams["one write"]) <= 2
