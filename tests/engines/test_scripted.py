"""The scripted backend's test instruments: the abandoned-generation counter and the probe model
that reports it (what the cross-language conformance vectors read to see the server abort)."""

from __future__ import annotations

import asyncio

import pytest
from gengate import errors
from gengate.domain import GenerationDelta, GenerationRequest
from gengate.engines.scripted import ScriptedBackend, ScriptedOptions


def _request(model: str, prompt: str = "a b c d e f") -> GenerationRequest:
    return GenerationRequest(model=model, prompt=prompt)


async def _probe_says(probe: ScriptedBackend) -> int:
    return int((await probe.generate(_request(probe.name, "count"))).generations[0].text)


async def test_probe_counts_streams_closed_and_tasks_cancelled_not_finished_ones() -> None:
    watched = ScriptedBackend("watched-a", ScriptedOptions(tokens_per_s=50))
    probe = ScriptedBackend("probe-a", ScriptedOptions(answer_cancellations_of="watched-a"))
    await watched.generate(_request("watched-a"))  # finished: not abandoned
    assert await _probe_says(probe) == 0

    stream = watched.generate_stream(_request("watched-a"))
    async for event in stream:
        if isinstance(event, GenerationDelta):
            break
    await stream.aclose()  # the caller hung up mid-way
    assert await _probe_says(probe) == 1

    task = asyncio.create_task(watched.generate(_request("watched-a")))
    await asyncio.sleep(0)  # let it start
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _probe_says(probe) == 2 == watched.cancelled


async def test_probe_of_a_model_not_in_this_process_is_an_error_not_zero() -> None:
    probe = ScriptedBackend("probe-b", ScriptedOptions(answer_cancellations_of="nowhere"))
    with pytest.raises(errors.Unavailable) as info:
        await probe.generate(_request("probe-b"))
    assert info.value.reason == "SCRIPTED_PROBE_TARGET_MISSING"
