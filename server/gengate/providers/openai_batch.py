"""OpenAI's Batch API, for offline jobs (backend.OfflineBatches), on OpenAIBackend and
AzureOpenAIBackend: the items are uploaded as one JSONL file (`purpose="batch"`), one line per
item whose body is exactly what the online chat-completions call would send (`_params`:
messages, sampling, `n`, `response_format` from the same structured plan), and the batch is
created over it with a 24 h completion window. When it has ended, its output and error files
are read line by line; each line goes back to its item by `custom_id`, its chat completion
through the online parsing and structured validation (`offline_result`), its error through the
provider error mapping.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gengate import errors
from gengate.backend import OFFLINE_BATCH_FAILED, BatchOutcome, BatchState, BatchStatus
from gengate.domain import GenerationRequest
from gengate.providers import batching
from gengate.providers.base import Completion, ProviderBackend, ProviderCall
from gengate.providers.errors import from_status, scrub
from gengate.providers.retry import call_with_retries

log = logging.getLogger("gengate.providers")
T = TypeVar("T")

# OpenAI's limit on requests in one batch (its input file also must stay under 200 MB).
MAX_BATCH_ITEMS = 50_000

_STATES = {
    "validating": BatchState.RUNNING,
    "in_progress": BatchState.RUNNING,
    "finalizing": BatchState.RUNNING,
    "cancelling": BatchState.RUNNING,
    "completed": BatchState.ENDED,
    "failed": BatchState.FAILED,
    "expired": BatchState.EXPIRED,
    "cancelled": BatchState.CANCELLED,
}


@dataclass(frozen=True)
class ChatWire:
    """What the Batch API needs of the chat-completions adapter (providers/openai.py)."""

    backend: ProviderBackend
    client: Any  # the SDK's AsyncOpenAI / AsyncAzureOpenAI
    params: Callable[[ProviderCall], dict[str, Any]]  # the online unary call's SDK keywords
    completion: Callable[[ProviderCall, Any], Completion]  # a chat completion, read as online


async def _upstream(backend: ProviderBackend, attempt: Callable[[], Awaitable[T]]) -> T:
    """One SDK call under the provider's retry policy; errors come out as gengate errors."""
    return await call_with_retries(
        attempt,
        policy=backend.retry_policy,
        deadline=None,
        provider=backend.label,
        normalize=backend.normalize_error,
    )


def request_body(wire: ChatWire, call: ProviderCall) -> dict[str, Any]:
    """The JSON body of the online unary call: its SDK keywords, with `extra_body` merged in as
    the SDK merges it (over the typed fields) and the client-side `timeout` left out."""
    params = wire.params(call)
    params.pop("timeout", None)
    extra = params.pop("extra_body", None) or {}
    return {**params, **extra}


def input_file(wire: ChatWire, items: Sequence[tuple[int, GenerationRequest]], url: str) -> bytes:
    """The batch's JSONL input: one request per item (or per choice without native `n`)."""
    lines = [
        json.dumps(
            {"custom_id": cid, "method": "POST", "url": url, "body": request_body(wire, call)},
            ensure_ascii=False,
        )
        for cid, call in batching.batch_requests(wire.backend, items)
    ]
    return ("\n".join(lines) + "\n").encode()


async def submit(wire: ChatWire, items: Sequence[tuple[int, GenerationRequest]], *, url: str) -> str:
    backend, client = wire.backend, wire.client
    batching.check_size(backend, items, MAX_BATCH_ITEMS)
    data = input_file(wire, items, url)
    uploaded = await _upstream(
        backend,
        lambda: client.files.create(file=("gengate-batch.jsonl", data, "application/jsonl"), purpose="batch"),
    )
    batch = await _upstream(
        backend,
        lambda: client.batches.create(input_file_id=uploaded.id, endpoint=url, completion_window="24h"),
    )
    log.info("%s: submitted %s batch %s (%d items)", backend.name, backend.label, batch.id, len(items))
    return str(batch.id)


def _errors_text(batch: Any) -> str:
    data = getattr(getattr(batch, "errors", None), "data", None) or ()
    parts = [f"{e.code}: {e.message}" if e.code else str(e.message) for e in data if e is not None]
    return scrub("; ".join(parts))


async def status(wire: ChatWire, batch_id: str) -> BatchStatus:
    backend = wire.backend
    batch = await _upstream(backend, lambda: wire.client.batches.retrieve(batch_id))
    state = _STATES.get(str(batch.status))
    if state is None:
        log.warning("%s: batch %s has an unknown status %r", backend.name, batch_id, batch.status)
        state = BatchState.RUNNING
    counts = batch.request_counts
    error = ""
    if state is BatchState.FAILED:
        error = _errors_text(batch) or f"{backend.label} refused the batch"
    elif state is BatchState.EXPIRED:
        error = f"the {backend.label} batch expired before every item ran"
    return BatchStatus(
        state=state,
        total=int(getattr(counts, "total", 0) or 0),
        succeeded=int(getattr(counts, "completed", 0) or 0),
        failed=int(getattr(counts, "failed", 0) or 0),
        error=error,
    )


async def cancel(wire: ChatWire, batch_id: str) -> None:
    await _upstream(wire.backend, lambda: wire.client.batches.cancel(batch_id))
    log.info("%s: asked %s to cancel batch %s", wire.backend.name, wire.backend.label, batch_id)


async def results(
    wire: ChatWire, batch_id: str, items: Mapping[int, GenerationRequest]
) -> AsyncIterator[BatchOutcome]:
    batch = await _upstream(wire.backend, lambda: wire.client.batches.retrieve(batch_id))
    collector = batching.BatchCollector(wire.backend, items)
    for file_id in (batch.output_file_id, batch.error_file_id):
        if not file_id:
            continue
        async for line in _lines(wire, str(file_id)):
            read = _answer(wire, line)
            if read is None:
                continue
            outcome = collector.add(*read)
            if outcome is not None:
                yield outcome
    for outcome in collector.unfinished():
        yield outcome


async def _lines(wire: ChatWire, file_id: str) -> AsyncIterator[str]:
    """A result file's lines as they download (a large file is never held whole)."""
    stream = wire.client.files.with_streaming_response.content(file_id)
    try:
        async with stream as response:
            async for line in response.iter_lines():
                if line.strip():
                    yield line
    except errors.GengateError:
        raise
    except Exception as exc:
        raise wire.backend.normalize_error(exc) from exc


def _answer(wire: ChatWire, line: str) -> tuple[object, batching.Answer] | None:
    """(custom id, answer) of one result line; None for a line that is no JSON object."""
    backend = wire.backend
    try:
        record = json.loads(line)
    except ValueError:
        log.warning("%s: skipped a result line that is not JSON", backend.name)
        return None
    if not isinstance(record, dict):
        return None
    cid = record.get("custom_id")
    response = record.get("response")
    if isinstance(response, dict) and isinstance(response.get("status_code"), int):
        status_code = int(response["status_code"])
        body = response.get("body")
        if status_code == 200 and isinstance(body, dict):
            return cid, _reader(wire, body)
        return cid, from_status(status_code, body, provider=backend.label)
    error = record.get("error")
    code = str(error.get("code") or "") if isinstance(error, dict) else ""
    if code == "batch_expired":
        return cid, batching.expired(backend.label)
    if code == "batch_cancelled":
        return cid, batching.cancelled(backend.label)
    message = scrub(str(error.get("message") or "")) if isinstance(error, dict) else ""
    return cid, errors.Unavailable(
        f"{backend.label} could not run this item of the batch ({code or 'no code'}): {message}",
        reason=OFFLINE_BATCH_FAILED,
        metadata={"provider": backend.label, "upstream_code": code[:64]},
    )


def _reader(wire: ChatWire, body: dict[str, Any]) -> Callable[[ProviderCall], Completion]:
    """Reads a line's chat completion (its JSON) as the online call reads its answer."""

    def read(call: ProviderCall) -> Completion:
        return wire.completion(call, body)

    return read
