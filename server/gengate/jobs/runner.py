"""Works through queued jobs: leases items from the store, runs each through the service core
(the same routing, limits, validation and engine batching as online calls, waiting for a slot
instead of failing on a full queue), and writes each result the moment it is finished.

Each item runs as its job's owner (`as_owner`): metrics, logs and spans count it for the caller
who created the job, and the models it may use are checked again as it runs.

Runners on several replicas share a store: each item is leased to one runner at a time, leases
are renewed while items run and expire when a runner dies, so its items go to the others.
Offline jobs (`options.offline`) go to the offline driver (jobs/offline.py): provider batch APIs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gengate.domain import GenerationRequest, GenerationResult
from gengate.errors import GengateError, Internal
from gengate.jobs.model import AsOwner, ItemResult, Job, JobCodec, JobUsage, LeasedItem
from gengate.jobs.offline import OfflineCore, OfflineDriver
from gengate.jobs.store import JobStore, runner_identity
from gengate.logs import log_unexpected

log = logging.getLogger("gengate.jobs")

Generate = Callable[[GenerationRequest], Awaitable[GenerationResult]]


@dataclass
class RunnerSettings:
    """`server.jobs`: how many items run at once and how leases behave."""

    concurrency: int = 8  # items in flight across all jobs of this server
    lease_s: float = 60.0  # a dead runner's items go back to the others after this
    poll_s: float = 1.0  # how often to look for work when nothing woke the runner
    offline_poll_s: float = 30.0  # how often an offline job's provider batches are polled


@dataclass
class _Running:
    job: Job
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    # Leased ahead, not started yet: one lease query serves many items.
    buffered: deque[LeasedItem] = field(default_factory=deque)


class JobRunner:
    """Runs the store's jobs in the background of one server."""

    def __init__(
        self,
        store: JobStore,
        generate: Generate,
        codec: JobCodec,
        settings: RunnerSettings | None = None,
        *,
        offline: OfflineCore | None = None,
        as_owner: AsOwner | None = None,
    ) -> None:
        self.store = store
        self.generate = generate
        self.codec = codec
        self.as_owner: AsOwner = as_owner or (lambda owner: contextlib.nullcontext())
        self.settings = settings or RunnerSettings()
        self.owner = runner_identity()
        # Without a core to check items with, offline jobs run online like the others.
        self.offline = (
            None
            if offline is None
            else OfflineDriver(
                store,
                offline,
                codec,
                self.owner,
                lease_s=self.settings.lease_s,
                poll_s=self.settings.offline_poll_s,
                as_owner=self.as_owner,
            )
        )
        self._running: dict[str, _Running] = {}
        self._wake = asyncio.Event()
        self._jobs: list[Job] = []  # the runnable jobs, re-read when woken and every poll_s
        self._jobs_read_at = -1e9
        self._refresh = True
        # Finished items waiting to be stored: written together, one transaction per flush.
        self._finished: list[tuple[str, ItemResult, asyncio.Future[bool]]] = []
        self._flush_wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.finished_items = 0  # results this runner stored (for tests, logs and metrics)
        self.failed_items = 0  # ... of which errors

    @property
    def in_flight(self) -> int:
        return sum(len(r.tasks) for r in self._running.values())

    @property
    def unfinished_items(self) -> int:
        """Items without a result in the store's queued and running jobs, as of the runner's last
        read of them (every poll_s while it runs): every replica's, not only this one's."""
        return sum(max(0, job.total - job.done) for job in self._jobs)  # done counts failed ones too

    async def start(self) -> None:
        released = await self.store.release_dead_local()
        if released:
            log.info("jobs: took back the items of %d runner(s) of this host that died", released)
        self._tasks = [
            asyncio.create_task(self._loop(), name="gengate-jobs"),
            asyncio.create_task(self._heartbeat(), name="gengate-jobs-leases"),
            asyncio.create_task(self._flusher(), name="gengate-jobs-results"),
        ]

    def wake(self) -> None:
        """Something changed (a job was created or cancelled): look for work now."""
        self._refresh = True
        self._wake.set()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.offline is not None:  # the provider batches run on; a restart resumes polling them
            await self.offline.aclose()
        items = [(job_id, [*r.tasks, *(i.index for i in r.buffered)]) for job_id, r in self._running.items()]
        for running in self._running.values():
            for task in running.tasks.values():
                task.cancel()
        await asyncio.gather(
            *(t for r in self._running.values() for t in r.tasks.values()), return_exceptions=True
        )
        for job_id, indices in items:  # unfinished: another runner (or this one restarted) takes them now
            with contextlib.suppress(Exception):
                await self.store.release(job_id, self.owner, indices)
        self._running.clear()

    async def cancel(self, job_id: str) -> None:
        """Stops this runner's items of a job (the store already holds their CANCELLED results)."""
        running = self._running.pop(job_id, None)
        self._refresh = True
        if running is not None:
            running.buffered.clear()
            for task in running.tasks.values():
                task.cancel()
        if self.offline is not None:  # an offline job's provider batches are cancelled upstream too
            await self.offline.cancel(job_id)

    # -- the loop ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self._fill()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("jobs: scheduling failed; trying again")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.poll_s):
                    await self._wake.wait()

    async def _runnable(self) -> list[Job]:
        """The runnable jobs: read again when something woke the runner or poll_s passed, not
        on every finished item."""
        now = time.monotonic()
        if self._refresh or now - self._jobs_read_at >= self.settings.poll_s:
            self._refresh = False
            self._jobs_read_at = now
            self._jobs = await self.store.runnable()
        return self._jobs

    async def _fill(self) -> None:
        """Starts items of the runnable jobs, by priority, up to the concurrency limits; leases
        ahead (one query for up to a job's concurrency of items)."""
        for job in await self._runnable():
            if job.options.offline and self.offline is not None:
                self.offline.ensure(job)  # no online slots: the provider runs the items
                continue
            free = self.settings.concurrency - self.in_flight
            if free <= 0:
                return
            running = self._running.setdefault(job.id, _Running(job))
            running.job = job
            cap = job.options.max_concurrency or self.settings.concurrency
            want = min(free, cap - len(running.tasks))
            if want <= 0:
                continue
            if len(running.buffered) < want:
                leased = await self.store.lease(job.id, self.owner, want + cap, self.settings.lease_s)
                running.buffered.extend(leased)
            if not running.buffered:
                if not running.tasks and not self._finished:
                    self._running.pop(job.id, None)
                    self._refresh = True
                    await self.store.finish_if_complete(job.id)
                continue
            if job.start_time is None:
                running.job = await self.store.mark_running(job.id)
                self._refresh = True
            for _ in range(min(want, len(running.buffered))):
                item = running.buffered.popleft()
                running.tasks[item.index] = asyncio.create_task(self._run_item(job.id, job.owner, item))

    async def _run_item(self, job_id: str, owner: str, item: LeasedItem) -> None:
        try:
            result = await self._outcome(owner, item)
            stored: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._finished.append((job_id, result, stored))
            self._flush_wake.set()
            if await stored:
                self.finished_items += 1
                self.failed_items += int(result.failed)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("jobs: storing item %d of %s failed; it will run again", item.index, job_id)
        finally:
            running = self._running.get(job_id)
            if running is not None:
                running.tasks.pop(item.index, None)
            self._wake.set()

    async def _outcome(self, owner: str, item: LeasedItem) -> ItemResult:
        """The item's result, as BatchGenerate would answer it: a response or its own error."""
        try:
            with self.as_owner(owner):  # this task's own context: nothing leaks to other items
                request = self.codec.decode_request(item.request, item.index)
                result = await self.generate(request)
        except GengateError as exc:
            return ItemResult(item.index, self.codec.encode_error(exc, item.index), failed=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one broken item never fails the job
            log_unexpected(log, exc, "jobs: item %d failed", item.index)
            error = Internal(
                f"item failed: unexpected server error ({type(exc).__name__})", reason="UNEXPECTED"
            )
            return ItemResult(item.index, self.codec.encode_error(error, item.index), failed=True)
        u = result.usage
        usage = JobUsage(u.input_tokens, u.output_tokens, u.cached_input_tokens)
        return ItemResult(item.index, self.codec.encode_result(result), failed=False, usage=usage)

    async def _flusher(self) -> None:
        """Stores finished items, all that finished since the last write in one transaction."""
        while True:
            await self._flush_wake.wait()
            self._flush_wake.clear()
            batch, self._finished = self._finished, []
            if not batch:
                continue
            try:
                stored = await self.store.complete_many([(job_id, result) for job_id, result, _ in batch])
            except Exception as exc:
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, _, future), ok in zip(batch, stored, strict=True):
                if not future.done():
                    future.set_result(ok)

    async def _heartbeat(self) -> None:
        """Keeps this runner's leases alive while their items run."""
        while True:
            await asyncio.sleep(self.settings.lease_s / 3)
            if self.in_flight or (self.offline is not None and self.offline.holding):
                try:
                    await self.store.renew(self.owner, self.settings.lease_s)
                except Exception:
                    log.exception("jobs: renewing leases failed")
