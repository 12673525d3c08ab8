"""The one backend protocol shared by engines, providers and composites.

A backend serves one configured model. Its capabilities are data, declared up front; the
service layer refuses anything a backend has not declared, so no backend ever needs to raise
NotImplementedError for a feature.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from gengate.domain import (
    Generation,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GenerationResult,
    ModelCapabilities,
    Reasoning,
    StreamEvent,
    StreamStart,
    Timings,
    TokenLogprob,
    Usage,
)
from gengate.errors import Cancelled, DeadlineExceeded, GengateError, Unavailable


@runtime_checkable
class Backend(Protocol):
    """One served model.

    `generate_stream` yields exactly one StreamStart, then GenerationDelta events, and one
    GenerationEnd per generation index. Requests arrive validated against `capabilities`
    with defaults filled in (n, seed). Cancelling the iterator (task cancellation or
    `aclose()` on the generator) must abort the engine or upstream request.
    """

    name: str
    kind: str
    capabilities: ModelCapabilities

    async def start(self) -> None:
        """Load the model / open clients. Called once before the first request."""
        ...

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]: ...

    async def aclose(self) -> None:
        """Release the model, worker processes and connections."""
        ...


# A composite's view of the other served models: name -> backend (the router's member handles).
MemberLookup = Callable[[str], Backend]


@runtime_checkable
class Composite(Protocol):
    """A backend built from other served models (fallback, mixture, preset): the router binds
    its members once every backend is built, and starts it after them."""

    def bind(self, lookup: MemberLookup) -> None:
        """Resolves the members by name; ConfigError when one is not served."""
        ...


ServingListener = Callable[[bool], Any]


@runtime_checkable
class ReportsHealth(Protocol):
    """A backend that can stop serving on its own (a worker process that died): it tells the
    health service when it goes down and when it is back."""

    @property
    def serving(self) -> bool: ...

    def add_serving_listener(self, listener: ServingListener) -> None:
        """`listener(serving)` on every change, from any thread."""
        ...


class BatchState(enum.Enum):
    """Where a provider batch is: still running, or ended one of four ways."""

    RUNNING = "running"
    ENDED = "ended"  # every request has its result (succeeded or errored)
    FAILED = "failed"  # the batch as a whole was refused (its input file did not validate)
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # the provider's completion window passed

    @property
    def finished(self) -> bool:
        return self is not BatchState.RUNNING


@dataclass(frozen=True)
class BatchStatus:
    """A provider batch's state and request counts; `error` says why it failed or expired."""

    state: BatchState
    total: int = 0
    succeeded: int = 0
    failed: int = 0
    error: str = ""


# One item of a provider batch: its job index, and its result or its own error.
BatchOutcome = tuple[int, GenerationResult | GengateError]

# Why an item of a provider batch has no answer.
OFFLINE_BATCH_FAILED = "OFFLINE_BATCH_FAILED"
OFFLINE_BATCH_EXPIRED = "OFFLINE_BATCH_EXPIRED"
OFFLINE_BATCH_CANCELLED = "OFFLINE_BATCH_CANCELLED"
OFFLINE_RESULT_MISSING = "OFFLINE_RESULT_MISSING"


def unanswered(state: BatchState, provider: str, detail: str = "") -> GengateError:
    """The error of an item its provider batch gave no answer for, by how the batch ended."""
    meta = {"provider": provider}
    why = f": {detail}" if detail else ""
    if state is BatchState.FAILED:
        return Unavailable(f"the {provider} batch failed{why}", reason=OFFLINE_BATCH_FAILED, metadata=meta)
    if state is BatchState.EXPIRED:
        return DeadlineExceeded(
            f"the {provider} batch expired (its completion window passed) before this item ran{why}",
            reason=OFFLINE_BATCH_EXPIRED,
            metadata=meta,
        )
    if state is BatchState.CANCELLED:
        return Cancelled(
            f"the {provider} batch was cancelled before this item ran{why}",
            reason=OFFLINE_BATCH_CANCELLED,
            metadata=meta,
        )
    return Unavailable(
        f"the {provider} batch ended without a result for this item{why}",
        reason=OFFLINE_RESULT_MISSING,
        metadata=meta,
    )


@runtime_checkable
class OfflineBatches(Protocol):
    """A backend whose provider has an offline batch API (OpenAI and Azure OpenAI: Batch API;
    Anthropic: Message Batches): a day's turnaround at about half the price.

    Items arrive prepared by the service core (checked, defaults filled in), keyed by their job
    index. Every result comes back through the same parsing and structured-output validation as
    the online call, without re-asks: an invalid output is that item's ABORTED VALIDATION_FAILED.
    Errors are gengate errors (the provider's error mapping), never SDK exceptions.
    """

    @property
    def max_batch_items(self) -> int:
        """The most items one provider batch may hold: a model's larger share is split."""
        ...

    async def submit_batch(self, items: Sequence[tuple[int, GenerationRequest]]) -> str:
        """Sends the items as one provider batch; returns the provider's batch id."""
        ...

    async def batch_status(self, batch_id: str) -> BatchStatus: ...

    def batch_results(
        self, batch_id: str, items: Mapping[int, GenerationRequest]
    ) -> AsyncIterator[BatchOutcome]:
        """The results of a finished batch for the `items` still wanted (the requests it was
        built from, by index), as they are downloaded; indices not in `items` are skipped."""
        ...

    async def cancel_batch(self, batch_id: str) -> None:
        """Asks the provider to stop the batch (results finished before it stays available)."""
        ...


async def collect_stream(events: AsyncIterator[StreamEvent]) -> GenerationResult:
    """Builds a unary result from a stream; lets stream-native backends implement generate. The
    end frames carry the complete tool calls; reasoning is the deltas' text and the end's
    signatures."""
    start: StreamStart | None = None
    texts: dict[int, list[str]] = {}
    thoughts: dict[int, list[str]] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    ends: dict[int, GenerationEnd] = {}
    async for event in events:
        if isinstance(event, StreamStart):
            start = event
        elif isinstance(event, GenerationDelta):
            texts.setdefault(event.index, []).append(event.text)
            if event.logprobs is not None:
                logprobs.setdefault(event.index, []).extend(event.logprobs)
            if event.reasoning:
                thoughts.setdefault(event.index, []).append(event.reasoning)
        elif isinstance(event, GenerationEnd):
            ends[event.index] = event
    if start is None:
        raise RuntimeError("backend stream ended without a start event")
    generations = []
    output_tokens = 0
    last_total: float | None = None
    first_token: float | None = None
    cached = 0  # the prompt is shared by every generation: counted once, like input_tokens
    for index in sorted(ends):
        end = ends[index]
        thought = "".join(thoughts.get(index, []))
        generations.append(
            Generation(
                index=index,
                text="".join(texts.get(index, [])),
                finish_reason=end.finish_reason,
                output_tokens=end.usage.output_tokens,
                matched_stop=end.matched_stop,
                logprobs=tuple(logprobs[index]) if index in logprobs else None,
                tool_calls=end.tool_calls,
                reasoning=Reasoning(thought, end.reasoning_signatures)
                if thought or end.reasoning_signatures
                else None,
            )
        )
        output_tokens += end.usage.output_tokens
        cached = max(cached, end.usage.cached_input_tokens)
        if end.timings.total_s is not None:
            last_total = max(last_total or 0.0, end.timings.total_s)
        if end.timings.time_to_first_token_s is not None:
            ttft = end.timings.time_to_first_token_s
            first_token = ttft if first_token is None else min(first_token, ttft)
    queue = next((e.timings.queue_s for e in ends.values() if e.timings.queue_s is not None), None)
    return GenerationResult(
        request_id=start.request_id,
        model=start.model,
        generations=tuple(generations),
        usage=Usage(start.input_tokens, output_tokens, cached),
        enforcement=start.enforcement,
        effective_sampling=start.effective_sampling,
        effective_stopping=start.effective_stopping,
        timings=Timings(queue_s=queue, time_to_first_token_s=first_token, total_s=last_total),
    )


async def aclose_stream(stream: AsyncIterator[object]) -> None:
    """Closes a stream now (async generators have aclose), so the engine or upstream request
    behind it is aborted at once rather than when the generator is garbage-collected."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
