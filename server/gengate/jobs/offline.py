"""Offline jobs (`options.offline`): the job's items go to each model's provider batch API
(backend.OfflineBatches) instead of online calls, and come back within the provider's window.

The driver leases every open item of the job (renewed by the runner's heartbeat, so one driver
owns the job), checks each through the service core as an online call would be checked (an item
refused there is its own error), groups the items by model and submits one provider batch per
model (more where a model's share is over the provider's batch size). Each batch id is stored in
the job's provider state before anything is polled, so a restarted server resumes polling the
same batches instead of submitting again. Results are stored as they are downloaded, through the
same validation as online results (service core `finish`), usage counted; items a batch did not
answer get the batch's error (failed, expired, cancelled), and then the job ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gengate.backend import OfflineBatches, unanswered
from gengate.domain import GenerationRequest, GenerationResult
from gengate.errors import GengateError, Internal, Unimplemented
from gengate.jobs.model import AsOwner, ItemResult, Job, JobCodec, JobUsage
from gengate.jobs.store import JobStore
from gengate.providers.errors import UPSTREAM_AUTH_FAILED, is_retryable

if TYPE_CHECKING:
    from gengate.router import Route, Router

log = logging.getLogger("gengate.jobs")

OFFLINE_UNSUPPORTED = "OFFLINE_UNSUPPORTED"


class OfflineCore(Protocol):
    """What the driver needs of the service core (GenerationCore)."""

    router: Router

    async def prepare(self, request: GenerationRequest) -> tuple[Route, GenerationRequest]: ...

    async def finish(
        self, route: Route, request: GenerationRequest, result: GenerationResult, arrived: float | None = None
    ) -> GenerationResult: ...


@dataclass
class _Batch:
    """One provider batch of a job: its model, id, route and the items it still owes."""

    model: str
    batch_id: str
    route: Route
    backend: OfflineBatches
    items: dict[int, GenerationRequest]


@dataclass
class _Run:
    job_id: str
    task: asyncio.Task[None] | None = None
    open: set[int] = field(default_factory=set)  # leased items without a stored result
    submitting: set[asyncio.Task[str]] = field(default_factory=set)
    failed_at: float | None = None  # the task ended on an unexpected error: retry after a poll


def _transient(error: GengateError) -> bool:
    """Errors worth polling through: the provider is busy or down, or its key is being fixed."""
    return is_retryable(error) or error.reason == UPSTREAM_AUTH_FAILED


def unsupported(model: str, kind: str) -> Unimplemented:
    return Unimplemented(
        f"model {model!r} (backend {kind}) has no provider batch API: offline jobs run on openai, "
        "azure_openai and anthropic models (run this job without options.offline)",
        reason=OFFLINE_UNSUPPORTED,
        metadata={"model": model},
    )


def _unexpected(exc: Exception) -> Internal:
    return Internal(f"item failed: unexpected server error ({type(exc).__name__})", reason="UNEXPECTED")


def _read_state(raw: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The job's stored batches: [{model, id, first, last}] (first/last: the index range of the
    model's items that batch holds). ValueError when the stored state is not that."""
    if raw is None:
        return []
    batches = raw.get("batches")
    if not isinstance(batches, list):
        raise ValueError("no batch list")
    out: list[dict[str, Any]] = []
    for b in batches:
        if not (
            isinstance(b, dict)
            and isinstance(b.get("model"), str)
            and isinstance(b.get("id"), str)
            and isinstance(b.get("first"), int)
            and isinstance(b.get("last"), int)
        ):
            raise ValueError(f"a malformed batch entry {str(b)[:80]!r}")
        out.append(b)
    return out


class OfflineDriver:
    """Runs a runner's offline jobs: one task per job while the job is this runner's."""

    def __init__(
        self,
        store: JobStore,
        core: OfflineCore,
        codec: JobCodec,
        owner: str,
        *,
        lease_s: float,
        poll_s: float,
        as_owner: AsOwner | None = None,
    ) -> None:
        self.store = store
        self.core = core
        self.as_owner: AsOwner = as_owner or (lambda job_owner: contextlib.nullcontext())
        self.codec = codec
        self.owner = owner
        self.lease_s = lease_s
        self.poll_s = poll_s
        self._runs: dict[str, _Run] = {}
        self.finished_items = 0

    @property
    def holding(self) -> int:
        """Jobs whose items this driver holds leases on (the runner's heartbeat renews them)."""
        return sum(1 for r in self._runs.values() if r.open)

    def ensure(self, job: Job) -> None:
        """Drives `job` unless it already is (or its last try failed less than a poll ago)."""
        run = self._runs.get(job.id)
        if run is not None and run.task is not None and not run.task.done():
            return
        if run is not None and run.failed_at is not None and time.monotonic() - run.failed_at < self.poll_s:
            return
        run = self._runs[job.id] = _Run(job.id)
        run.task = asyncio.create_task(self._guarded(run, job), name=f"gengate-offline-{job.id}")

    async def cancel(self, job_id: str) -> None:
        """Stops driving a cancelled job and cancels its provider batches upstream."""
        run = self._runs.pop(job_id, None)
        if run is not None:
            await self._stop(run)
        try:
            batches = _read_state(await self.store.provider_state(job_id))
        except ValueError:
            return
        for entry in batches:
            try:
                backend = self.core.router.route(entry["model"]).backend
            except GengateError:
                continue
            if not isinstance(backend, OfflineBatches):
                continue
            try:
                await backend.cancel_batch(entry["id"])
            except GengateError as exc:  # an ended batch cannot be cancelled: nothing is lost
                log.warning("jobs: cancelling batch %s of %s upstream failed: %s", entry["id"], job_id, exc)

    async def aclose(self) -> None:
        """Stops every job (their provider batches run on) and gives their items back, so this
        server restarted, or another runner, resumes polling them."""
        runs = list(self._runs.values())
        self._runs.clear()
        for run in runs:
            await self._stop(run)
            if run.open:
                with contextlib.suppress(Exception):
                    await self.store.release(run.job_id, self.owner, sorted(run.open))

    async def _stop(self, run: _Run) -> None:
        if run.task is not None:
            run.task.cancel()
            await asyncio.gather(run.task, return_exceptions=True)
        # a submission under way finishes, so its batch id is stored (and can be cancelled)
        await asyncio.gather(*run.submitting, return_exceptions=True)

    # -- one job ------------------------------------------------------------------------------

    async def _guarded(self, run: _Run, job: Job) -> None:
        try:
            await self._drive(run, job)
            if self._runs.get(job.id) is run:
                del self._runs[job.id]
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("jobs: offline job %s failed in the driver; trying again", job.id)
            run.failed_at = time.monotonic()
            if run.open:
                with contextlib.suppress(Exception):
                    await self.store.release(job.id, self.owner, sorted(run.open))
                run.open.clear()

    async def _drive(self, run: _Run, job: Job) -> None:
        leased = await self.store.lease(job.id, self.owner, max(job.total, 1), self.lease_s)
        if not leased:  # every item has its result, or another runner holds them
            await self.store.finish_if_complete(job.id)
            return
        run.open = {item.index for item in leased}
        if job.start_time is None:
            await self.store.mark_running(job.id)
        try:
            stored = _read_state(await self.store.provider_state(job.id))
        except ValueError as exc:
            await self.store.fail(
                job.id, f"the job's provider batch state is unreadable ({exc})", self.codec.cancelled()
            )
            run.open.clear()
            log.error("jobs: offline job %s has an unreadable provider state: %s", job.id, exc)
            return
        groups: dict[str, tuple[Route, list[tuple[int, GenerationRequest]]]] = {}
        for item in leased:
            try:
                with self.as_owner(job.owner):  # the models its owner may use, checked again
                    request = self.codec.decode_request(item.request, item.index)
                    route, request = await self.core.prepare(request)
            except GengateError as exc:  # refused as the online call would be: its own error
                await self._store(run, self._error(item.index, exc))
                continue
            except Exception as exc:  # one broken item never fails the job
                log.exception("jobs: item %d of %s could not be prepared", item.index, job.id)
                await self._store(run, self._error(item.index, _unexpected(exc)))
                continue
            groups.setdefault(route.name, (route, []))[1].append((item.index, request))
        del leased
        batches: list[_Batch] = []
        for model, (route, items) in groups.items():
            backend = route.backend
            if not isinstance(backend, OfflineBatches):
                error = unsupported(model, route.config.backend)
                for index, _ in items:
                    await self._store(run, self._error(index, error))
                continue
            items.sort(key=lambda pair: pair[0])
            known = [b for b in stored if b["model"] == model]
            for entry in known:
                members = {i: r for i, r in items if entry["first"] <= i <= entry["last"]}
                if members:
                    batches.append(_Batch(model, entry["id"], route, backend, members))
            rest = [(i, r) for i, r in items if not any(b["first"] <= i <= b["last"] for b in known)]
            size = max(1, backend.max_batch_items)
            for start in range(0, len(rest), size):
                chunk = rest[start : start + size]
                batch_id = await self._submit(run, job.id, stored, model, backend, chunk)
                if batch_id is not None:
                    batches.append(_Batch(model, batch_id, route, backend, dict(chunk)))
        if batches:
            log.info("jobs: offline job %s follows %d provider batch(es)", job.id, len(batches))
        await asyncio.gather(*(self._follow(run, batch) for batch in batches))
        await self.store.finish_if_complete(job.id)

    async def _submit(
        self,
        run: _Run,
        job_id: str,
        stored: list[dict[str, Any]],
        model: str,
        backend: OfflineBatches,
        chunk: Sequence[tuple[int, GenerationRequest]],
    ) -> str | None:
        """Submits one batch and stores its id before anything polls it (a submission is not
        cut off half way by a cancel or a stop: its id must be known to cancel or resume it).
        A refused batch's items get its error; None then."""

        async def send() -> str:
            batch_id = await backend.submit_batch(chunk)
            stored.append({"model": model, "id": batch_id, "first": chunk[0][0], "last": chunk[-1][0]})
            await self.store.set_provider_state(job_id, {"batches": stored})
            return batch_id

        while True:
            task = asyncio.create_task(send())
            run.submitting.add(task)
            task.add_done_callback(run.submitting.discard)
            try:
                return await asyncio.shield(task)
            except GengateError as exc:
                if _transient(exc):
                    log.warning(
                        "jobs: submitting %s's batch of %s failed, trying again: %s", model, job_id, exc
                    )
                    await asyncio.sleep(self.poll_s)
                    continue
                for index, _ in chunk:
                    await self._store(run, self._error(index, exc))
                return None

    async def _follow(self, run: _Run, batch: _Batch) -> None:
        """Polls one batch until it ends, then stores its results as they download."""
        while batch.items:
            try:
                status = await batch.backend.batch_status(batch.batch_id)
                if not status.state.finished:
                    await asyncio.sleep(self.poll_s)
                    continue
                async for index, outcome in batch.backend.batch_results(batch.batch_id, dict(batch.items)):
                    await self._outcome(run, batch, index, outcome)
            except GengateError as exc:
                if _transient(exc):
                    log.warning("jobs: polling batch %s failed, trying again: %s", batch.batch_id, exc)
                    await asyncio.sleep(self.poll_s)
                    continue
                await self._end_items(run, batch, exc)
                return
            if batch.items:
                label = str(getattr(batch.backend, "label", batch.route.config.backend))
                await self._end_items(run, batch, unanswered(status.state, label, status.error))
            log.info("jobs: batch %s (%s) ended %s", batch.batch_id, batch.model, status.state.value)
            return

    async def _outcome(
        self, run: _Run, batch: _Batch, index: int, outcome: GenerationResult | GengateError
    ) -> None:
        request = batch.items.pop(index, None)
        if request is None:
            return
        if isinstance(outcome, GengateError):
            await self._store(run, self._error(index, outcome))
            return
        try:
            result = await self.core.finish(batch.route, request, outcome)
        except GengateError as exc:  # the service's own validation of every structured result
            await self._store(run, self._error(index, exc))
            return
        except Exception as exc:
            log.exception("jobs: item %d of batch %s failed", index, batch.batch_id)
            await self._store(run, self._error(index, _unexpected(exc)))
            return
        u = result.usage
        usage = JobUsage(u.input_tokens, u.output_tokens, u.cached_input_tokens)
        await self._store(run, ItemResult(index, self.codec.encode_result(result), False, usage))

    async def _end_items(self, run: _Run, batch: _Batch, error: GengateError) -> None:
        for index in sorted(batch.items):
            await self._store(run, self._error(index, error))
        batch.items.clear()

    def _error(self, index: int, error: GengateError) -> ItemResult:
        return ItemResult(index, self.codec.encode_error(error, index), failed=True)

    async def _store(self, run: _Run, result: ItemResult) -> None:
        if await self.store.complete(run.job_id, result):
            self.finished_items += 1
        run.open.discard(result.index)
