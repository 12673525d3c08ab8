"""Durable batch jobs: `client.batch_jobs.create(requests)`, `.get`, `.list`, `.cancel`, and
`.results(job_id, after_index=...)`, typed like `batch_generate` (ItemResult, `output_type`)."""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from gengate_proto.v1 import generation_pb2, jobs_pb2, jobs_pb2_grpc
from google.protobuf import timestamp_pb2

from gengate_client import _convert as convert
from gengate_client._channel import LoopChannel
from gengate_client._convert import CallSettings, MetadataLike
from gengate_client.errors import OutputError, error_from_rpc, error_from_status
from gengate_client.output_types import resolve_output_type
from gengate_client.tools import resolve_tools
from gengate_client.types import ItemResult, Request, ToolLike

# Jobs with more items than this are sent with the client-streaming upload, in pieces.
UPLOAD_ABOVE = 1000


@dataclass(frozen=True)
class JobUsage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0


@dataclass(frozen=True)
class BatchJob:
    """Where a job stands. `state` is queued, running, succeeded, failed or cancelled."""

    id: str
    state: str
    total: int
    done: int
    failed: int
    display_name: str = ""
    create_time: datetime.datetime | None = None
    start_time: datetime.datetime | None = None
    end_time: datetime.datetime | None = None
    usage: JobUsage = field(default_factory=JobUsage)
    offline: bool = False
    priority: int = 0
    idempotency_key: str = ""
    error: str = ""
    raw: Any = field(default=None, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.state in ("succeeded", "failed", "cancelled")


def _time(stamp: timestamp_pb2.Timestamp, present: bool) -> datetime.datetime | None:
    return stamp.ToDatetime(tzinfo=datetime.UTC) if present else None


def job_from_pb(pb: jobs_pb2.BatchJob) -> BatchJob:
    state = jobs_pb2.BatchJobState.Name(pb.state).removeprefix("BATCH_JOB_STATE_").lower()
    return BatchJob(
        id=pb.id,
        state=state,
        total=pb.total,
        done=pb.done,
        failed=pb.failed,
        display_name=pb.display_name,
        create_time=_time(pb.create_time, pb.HasField("create_time")),
        start_time=_time(pb.start_time, pb.HasField("start_time")),
        end_time=_time(pb.end_time, pb.HasField("end_time")),
        usage=JobUsage(pb.usage.input_tokens, pb.usage.output_tokens, pb.usage.cached_input_tokens),
        offline=pb.options.offline,
        priority=pb.options.priority,
        idempotency_key=pb.idempotency_key,
        error=pb.error,
        raw=pb,
    )


def results_spec(output_type: Any, tools: Sequence[ToolLike] | None) -> convert.ResultSpec:
    """How a job's stored responses are read: their output type and the tools they may call."""
    return convert.ResultSpec(resolve_output_type(output_type), {t.name: t for t in resolve_tools(tools)})


def result_from_pb(pb: jobs_pb2.StreamBatchJobResultsResponse, spec: Any) -> ItemResult:
    """One stored item: its response (parsed as `spec` says) or its error."""
    if pb.WhichOneof("result") == "error":
        return ItemResult(index=pb.index, error=error_from_status(pb.error))
    try:
        return ItemResult(index=pb.index, response=convert.response(pb.response, spec))
    except OutputError as exc:
        return ItemResult(index=pb.index, error=exc)


class BatchJobs:
    """The BatchJobService of one Client (`client.batch_jobs`)."""

    def __init__(self, channel: grpc.Channel, call: CallSettings, default_timeout: float | None) -> None:
        self._stub = jobs_pb2_grpc.BatchJobServiceStub(channel)
        self._call = call
        self._timeout = default_timeout

    def _kwargs(self, timeout: float | None, metadata: MetadataLike | None) -> dict[str, Any]:
        return CallSettings(timeout, metadata).kwargs(self._timeout, self._call.metadata)

    def create(
        self,
        requests: Sequence[Request | Mapping[str, Any]] | None = None,
        *,
        jsonl: Iterable[str] | None = None,
        defaults: Request | Mapping[str, Any] | None = None,
        display_name: str = "",
        idempotency_key: str = "",
        offline: bool = False,
        priority: int = 0,
        max_concurrency: int = 0,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
    ) -> BatchJob:
        """Stores a job and returns it at once (it runs on the server, whatever this process does).

        Give `requests` (like `batch_generate`'s) or `jsonl` lines (parsed by the server; a bad
        line is that item's error); `defaults` fill what items leave unset. With an
        `idempotency_key`, creating again returns the first job instead of a second one.
        """
        plan = plan_create(
            requests, jsonl, defaults, display_name, idempotency_key, offline, priority, max_concurrency
        )
        kwargs = self._kwargs(timeout, metadata)
        try:
            if isinstance(plan, jobs_pb2.CreateBatchJobRequest):
                return job_from_pb(self._stub.CreateBatchJob(plan, **kwargs).job)
            return job_from_pb(self._stub.UploadBatchJob(iter(plan), **kwargs).job)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def get(
        self, job_id: str, *, timeout: float | None = None, metadata: MetadataLike | None = None
    ) -> BatchJob:
        try:
            reply = self._stub.GetBatchJob(
                jobs_pb2.GetBatchJobRequest(id=job_id), **self._kwargs(timeout, metadata)
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return job_from_pb(reply.job)

    def list(
        self, *, page_size: int = 50, timeout: float | None = None, metadata: MetadataLike | None = None
    ) -> Iterator[BatchJob]:
        """Every job, newest first, fetched a page at a time."""
        token = ""
        while True:
            try:
                page = self._stub.ListBatchJobs(
                    jobs_pb2.ListBatchJobsRequest(page_size=page_size, page_token=token),
                    **self._kwargs(timeout, metadata),
                )
            except grpc.RpcError as exc:
                raise error_from_rpc(exc) from None
            yield from (job_from_pb(job) for job in page.jobs)
            token = page.next_page_token
            if not token:
                return

    def cancel(
        self, job_id: str, *, timeout: float | None = None, metadata: MetadataLike | None = None
    ) -> BatchJob:
        """Stops the job; items not finished end with a CANCELLED error. A finished job:
        GengateError FAILED_PRECONDITION."""
        try:
            reply = self._stub.CancelBatchJob(
                jobs_pb2.CancelBatchJobRequest(id=job_id), **self._kwargs(timeout, metadata)
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return job_from_pb(reply.job)

    def results(
        self,
        job_id: str,
        *,
        after_index: int | None = None,
        follow: bool = True,
        output_type: Any = None,
        tools: Sequence[ToolLike] | None = None,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
    ) -> Iterator[ItemResult]:
        """Each item's outcome in index order, from `after_index + 1`: resume a download where it
        stopped. `follow` waits for items still running (until the last); without it the stream
        ends at the first unfinished item. `output_type` parses each response as `generate` does;
        `tools` (the job's, as offered) links each returned call to its tool, so `arguments()`
        parses into its type."""
        spec = results_spec(output_type, tools)
        request = jobs_pb2.StreamBatchJobResultsRequest(id=job_id, follow=follow)
        if after_index is not None:
            request.after_index = after_index
        stream = self._stub.StreamBatchJobResults(request, **self._kwargs(timeout, metadata))
        try:
            for item in stream:
                yield result_from_pb(item, spec)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            stream.cancel()

    def wait(self, job_id: str, *, poll_s: float = 1.0, timeout: float | None = None) -> BatchJob:
        """Polls until the job has finished (or `timeout` seconds pass: TimeoutError)."""
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if job.finished:
                return job
            if give_up is not None and time.monotonic() > give_up:
                raise TimeoutError(f"batch job {job_id} still {job.state} after {timeout:g} s")
            time.sleep(poll_s)


def plan_create(
    requests: Sequence[Request | Mapping[str, Any]] | None,
    jsonl: Iterable[str] | None,
    defaults: Request | Mapping[str, Any] | None,
    display_name: str,
    idempotency_key: str,
    offline: bool,
    priority: int,
    max_concurrency: int,
) -> jobs_pb2.CreateBatchJobRequest | list[jobs_pb2.UploadBatchJobRequest]:
    """The one CreateBatchJob message, or the messages of an upload (header first) for jobs
    over UPLOAD_ABOVE items, JSONL lines or item defaults."""
    if (requests is None) == (jsonl is None):
        raise ValueError("give either requests or jsonl")
    options = jobs_pb2.BatchJobOptions(offline=offline, priority=priority, max_concurrency=max_concurrency)
    built = [convert.build_request(convert.as_request(r))[0] for r in requests or ()]
    if requests is not None and len(built) <= UPLOAD_ABOVE and defaults is None:
        return jobs_pb2.CreateBatchJobRequest(
            requests=built, display_name=display_name, idempotency_key=idempotency_key, options=options
        )
    header = jobs_pb2.BatchJobHeader(
        display_name=display_name, idempotency_key=idempotency_key, options=options
    )
    if defaults is not None:
        header.defaults.CopyFrom(_defaults(defaults))
    parts = [jobs_pb2.UploadBatchJobRequest(header=header)]
    parts += [jobs_pb2.UploadBatchJobRequest(request=item) for item in built]
    parts += [jobs_pb2.UploadBatchJobRequest(json_line=line) for line in jsonl or ()]
    return parts


def _defaults(defaults: Request | Mapping[str, Any]) -> generation_pb2.GenerateRequest:
    """The header's defaults: a Request (or its fields), `model` optional."""
    request = convert.as_request(defaults if not isinstance(defaults, Mapping) else {"model": "", **defaults})
    return convert.build_request(request)[0]


class AsyncBatchJobs:
    """The BatchJobService of one AsyncClient (`client.batch_jobs`): BatchJobs, awaitable."""

    def __init__(self, channel: LoopChannel, call: CallSettings, default_timeout: float | None) -> None:
        self._channel = channel
        self._call = call
        self._timeout = default_timeout

    @property
    def _stub(self) -> jobs_pb2_grpc.BatchJobServiceAsyncStub:
        stub: jobs_pb2_grpc.BatchJobServiceAsyncStub = self._channel.stub(jobs_pb2_grpc.BatchJobServiceStub)
        return stub

    def _kwargs(self, timeout: float | None, metadata: MetadataLike | None) -> dict[str, Any]:
        return CallSettings(timeout, metadata).kwargs(self._timeout, self._call.metadata)

    async def create(
        self,
        requests: Sequence[Request | Mapping[str, Any]] | None = None,
        *,
        jsonl: Iterable[str] | None = None,
        defaults: Request | Mapping[str, Any] | None = None,
        display_name: str = "",
        idempotency_key: str = "",
        offline: bool = False,
        priority: int = 0,
        max_concurrency: int = 0,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
    ) -> BatchJob:
        """As BatchJobs.create."""
        plan = plan_create(
            requests, jsonl, defaults, display_name, idempotency_key, offline, priority, max_concurrency
        )
        kwargs = self._kwargs(timeout, metadata)
        try:
            if isinstance(plan, jobs_pb2.CreateBatchJobRequest):
                return job_from_pb((await self._stub.CreateBatchJob(plan, **kwargs)).job)
            return job_from_pb((await self._stub.UploadBatchJob(iter(plan), **kwargs)).job)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    async def get(
        self, job_id: str, *, timeout: float | None = None, metadata: MetadataLike | None = None
    ) -> BatchJob:
        try:
            reply = await self._stub.GetBatchJob(
                jobs_pb2.GetBatchJobRequest(id=job_id), **self._kwargs(timeout, metadata)
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return job_from_pb(reply.job)

    async def list(
        self, *, page_size: int = 50, timeout: float | None = None, metadata: MetadataLike | None = None
    ) -> AsyncIterator[BatchJob]:
        """Every job, newest first, fetched a page at a time."""
        token = ""
        while True:
            try:
                page = await self._stub.ListBatchJobs(
                    jobs_pb2.ListBatchJobsRequest(page_size=page_size, page_token=token),
                    **self._kwargs(timeout, metadata),
                )
            except grpc.RpcError as exc:
                raise error_from_rpc(exc) from None
            for job in page.jobs:
                yield job_from_pb(job)
            token = page.next_page_token
            if not token:
                return

    async def cancel(
        self, job_id: str, *, timeout: float | None = None, metadata: MetadataLike | None = None
    ) -> BatchJob:
        try:
            reply = await self._stub.CancelBatchJob(
                jobs_pb2.CancelBatchJobRequest(id=job_id), **self._kwargs(timeout, metadata)
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return job_from_pb(reply.job)

    async def results(
        self,
        job_id: str,
        *,
        after_index: int | None = None,
        follow: bool = True,
        output_type: Any = None,
        tools: Sequence[ToolLike] | None = None,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
    ) -> AsyncIterator[ItemResult]:
        """As BatchJobs.results: each item's outcome in index order, from `after_index + 1`."""
        spec = results_spec(output_type, tools)
        request = jobs_pb2.StreamBatchJobResultsRequest(id=job_id, follow=follow)
        if after_index is not None:
            request.after_index = after_index
        stream = self._stub.StreamBatchJobResults(request, **self._kwargs(timeout, metadata))
        try:
            async for item in stream:
                yield result_from_pb(item, spec)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            stream.cancel()

    async def wait(self, job_id: str, *, poll_s: float = 1.0, timeout: float | None = None) -> BatchJob:
        """Polls until the job has finished (or `timeout` seconds pass: TimeoutError)."""
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            job = await self.get(job_id)
            if job.finished:
                return job
            if give_up is not None and time.monotonic() > give_up:
                raise TimeoutError(f"batch job {job_id} still {job.state} after {timeout:g} s")
            await asyncio.sleep(poll_s)
