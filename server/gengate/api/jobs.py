"""gengate.v1.BatchJobService: durable batch jobs over the job store and runner.

A job belongs to the caller who created it: with callers configured, each caller sees, cancels
and reads only its own jobs (another's is NOT_FOUND, as an unknown id is) and its idempotency
keys are its own. Without callers every call sees every job.

Items are stored as the GenerateRequest bytes the caller sent and converted again when they
run, so an item refused at create time and one that fails while running answer the same way
(a google.rpc.Status with `requests[i].` field paths, as BatchGenerate's items do).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from gengate_proto.v1 import generation_pb2 as gpb
from gengate_proto.v1 import jobs_pb2 as jpb
from gengate_proto.v1 import jobs_pb2_grpc
from google.rpc import status_pb2

from gengate.api import convert
from gengate.api.status import abort, to_rpc_status
from gengate.callers.context import current_policy
from gengate.callers.identity import Caller
from gengate.config import JobSettings
from gengate.domain import GenerationRequest, GenerationResult
from gengate.errors import Cancelled, GengateError, InvalidArgument
from gengate.jobs.model import ItemResult, Job
from gengate.jobs.runner import JobRunner
from gengate.jobs.store import JobStore
from gengate.limits import LIMIT_REASON
from gengate.service import not_allowed

Context = grpc.aio.ServicerContext[Any, Any]

# Items converted per step while creating a job (a large job is converted off the event loop).
_CONVERT_CHUNK = 1000
# JSONL lines longer than this are parsed in a thread, off the event loop.
_INLINE_LINE_CHARS = 64 * 1024
# Results read per query while streaming.
_READ_CHUNK = 500
# How often a following stream looks for the next result.
_FOLLOW_POLL_S = 0.2
MAX_PAGE_SIZE = 1000


class ItemCodec:
    """Items as protobuf bytes: GenerateRequest in, GenerateResponse or google.rpc.Status out."""

    def __init__(self, max_schema_json_bytes: int) -> None:
        self.max_schema_json_bytes = max_schema_json_bytes

    def decode_request(self, data: bytes, index: int) -> GenerationRequest:
        return self.decode_request_message(gpb.GenerateRequest.FromString(data), index)

    def encode_result(self, result: GenerationResult) -> bytes:
        return bytes(convert.result_to_pb(result).SerializeToString())

    def encode_error(self, error: GengateError, index: int) -> bytes:
        return bytes(to_rpc_status(error.under(f"requests[{index}].")).SerializeToString())

    def cancelled(self) -> bytes:
        error = Cancelled("the batch job was cancelled before this item finished", reason="JOB_CANCELLED")
        return bytes(to_rpc_status(error).SerializeToString())

    def refused(
        self, item: gpb.GenerateRequest | GengateError, index: int, caller: Caller | None = None
    ) -> tuple[bytes | None, ItemResult | None]:
        """What the store keeps for one item at create time: its bytes, or its error now (an
        item for a model `caller` may not use fails as its own item, PERMISSION_DENIED)."""
        try:
            if isinstance(item, GengateError):
                raise item
            request = self.decode_request_message(item, index)
            if caller is not None and request.model and not caller.may_use(request.model):
                raise not_allowed(caller, request.model)
        except GengateError as exc:
            return None, ItemResult(index, self.encode_error(exc, index), failed=True)
        return bytes(item.SerializeToString()), None

    def decode_request_message(self, item: gpb.GenerateRequest, index: int) -> GenerationRequest:
        return convert.request_from_pb(
            item,
            deadline=None,
            prefix=f"requests[{index}].",
            max_schema_json_bytes=self.max_schema_json_bytes,
        )


def _job_id(value: str, field: str = "id") -> str:
    if not value:
        raise InvalidArgument.field(field, "is required: the id CreateBatchJob returned")
    return value


def _scope() -> str | None:
    """Whose jobs the current call sees: its caller's, or anyone's without callers."""
    caller = current_policy()
    return None if caller is None else caller.name


def _page_token(job: Job) -> str:
    return base64.urlsafe_b64encode(f"{job.create_time!r}|{job.id}".encode()).decode()


def _parse_page_token(token: str) -> tuple[float, str]:
    try:
        when, _, job_id = base64.urlsafe_b64decode(token.encode()).decode().partition("|")
        return float(when), job_id
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument.field("page_token", "is not a token ListBatchJobs returned") from None


class BatchJobServicer(jobs_pb2_grpc.BatchJobServiceServicer):
    """The BatchJobService RPCs."""

    def __init__(self, store: JobStore, runner: JobRunner, codec: ItemCodec, settings: JobSettings) -> None:
        self.store = store
        self.runner = runner
        self.codec = codec
        self.settings = settings

    def _check_size(self, count: int, field: str = "requests") -> None:
        if count > self.settings.max_items:
            raise InvalidArgument.field(
                field,
                f"the number of items is {count}, over the limit of {self.settings.max_items} "
                "(server.jobs.max_items)",
                reason=LIMIT_REASON,
            )

    async def _items(
        self, requests: Sequence[gpb.GenerateRequest | GengateError], start: int
    ) -> list[tuple[bytes | None, ItemResult | None]]:
        caller = current_policy()  # checked now, and again as the items run (for their owner)

        def convert_all() -> list[tuple[bytes | None, ItemResult | None]]:
            return [self.codec.refused(item, start + i, caller) for i, item in enumerate(requests)]

        if len(requests) <= _CONVERT_CHUNK:
            return convert_all()
        return await asyncio.to_thread(convert_all)

    async def CreateBatchJob(
        self, request: jpb.CreateBatchJobRequest, context: Context
    ) -> jpb.CreateBatchJobResponse:
        try:
            count = len(request.requests)
            self._check_size(count)
            if count == 0:
                raise InvalidArgument.field("requests", "must contain at least one request")
            items = await self._items(list(request.requests), 0)
            job, _ = await self.store.create_job(
                display_name=request.display_name,
                idempotency_key=request.idempotency_key,
                options=convert.job_options_from_pb(request.options),
                items=items,
                owner=_scope() or "",
            )
            self.runner.wake()
            return jpb.CreateBatchJobResponse(job=convert.job_to_pb(job))
        except GengateError as exc:
            await abort(context, exc)
        raise AssertionError("unreachable")

    async def UploadBatchJob(
        self, request_iterator: AsyncIterator[jpb.UploadBatchJobRequest], context: Context
    ) -> jpb.UploadBatchJobResponse:
        job: Job | None = None
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None or not first.HasField("header"):
                raise InvalidArgument.field("header", "the first message of an upload must be the header")
            header = first.header
            job, created = await self.store.create_job(
                display_name=header.display_name,
                idempotency_key=header.idempotency_key,
                options=convert.job_options_from_pb(header.options),
                sealed=False,
                owner=_scope() or "",
            )
            if not created:  # a retried upload: the first one's job, whatever this one sends
                return jpb.UploadBatchJobResponse(job=convert.job_to_pb(job))
            defaults = header.defaults if header.HasField("defaults") else None
            chunk: list[gpb.GenerateRequest | GengateError] = []
            total = 0
            async for message in request_iterator:
                index = total + len(chunk)
                part = message.WhichOneof("part")
                if part == "request":
                    item: gpb.GenerateRequest | GengateError = message.request
                elif part == "json_line":
                    line = message.json_line
                    try:
                        if len(line) <= _INLINE_LINE_CHARS:
                            item = convert.request_from_json_line(line, index)
                        else:  # parsing scales with the line: never on the event loop
                            item = await asyncio.to_thread(convert.request_from_json_line, line, index)
                    except GengateError as bad_line:
                        item = bad_line
                else:
                    raise InvalidArgument.field(f"requests[{index}]", "only the first message is a header")
                if defaults is not None and not isinstance(item, GengateError):
                    item = convert.merged_request(defaults, item)
                chunk.append(item)
                if len(chunk) >= _CONVERT_CHUNK:
                    total = await self._append(job.id, chunk, total)
                    chunk = []
            if chunk:
                total = await self._append(job.id, chunk, total)
            if total == 0:
                raise InvalidArgument.field("requests", "an upload must send at least one request")
            job = await self.store.seal(job.id)
            self.runner.wake()
            return jpb.UploadBatchJobResponse(job=convert.job_to_pb(job))
        except GengateError as exc:
            if job is not None and not job.sealed:
                await self.store.fail(
                    job.id, f"the upload did not finish: {exc.message}", self.codec.cancelled()
                )
            await abort(context, exc)
        except asyncio.CancelledError:
            if job is not None and not job.sealed:
                await asyncio.shield(
                    self.store.fail(job.id, "the upload was interrupted", self.codec.cancelled())
                )
            raise
        raise AssertionError("unreachable")

    async def _append(self, job_id: str, chunk: list[gpb.GenerateRequest | GengateError], start: int) -> int:
        self._check_size(start + len(chunk))
        return await self.store.add_items(job_id, start, await self._items(chunk, start))

    async def GetBatchJob(self, request: jpb.GetBatchJobRequest, context: Context) -> jpb.GetBatchJobResponse:
        try:
            job = await self.store.get(_job_id(request.id), _scope())
            return jpb.GetBatchJobResponse(job=convert.job_to_pb(job))
        except GengateError as exc:
            await abort(context, exc)
        raise AssertionError("unreachable")

    async def ListBatchJobs(
        self, request: jpb.ListBatchJobsRequest, context: Context
    ) -> jpb.ListBatchJobsResponse:
        try:
            size = request.page_size or 50
            if size > MAX_PAGE_SIZE:
                raise InvalidArgument.field("page_size", f"must be at most {MAX_PAGE_SIZE}")
            before = _parse_page_token(request.page_token) if request.page_token else None
            jobs = await self.store.list_jobs(size + 1, before, _scope())
            token = _page_token(jobs[size - 1]) if len(jobs) > size else ""
            return jpb.ListBatchJobsResponse(
                jobs=[convert.job_to_pb(j) for j in jobs[:size]], next_page_token=token
            )
        except GengateError as exc:
            await abort(context, exc)
        raise AssertionError("unreachable")

    async def CancelBatchJob(
        self, request: jpb.CancelBatchJobRequest, context: Context
    ) -> jpb.CancelBatchJobResponse:
        try:
            job = await self.store.cancel(_job_id(request.id), self.codec.cancelled(), _scope())
            await self.runner.cancel(job.id)
            return jpb.CancelBatchJobResponse(job=convert.job_to_pb(job))
        except GengateError as exc:
            await abort(context, exc)
        raise AssertionError("unreachable")

    async def StreamBatchJobResults(
        self, request: jpb.StreamBatchJobResultsRequest, context: Context
    ) -> AsyncIterator[jpb.StreamBatchJobResultsResponse]:
        try:
            job_id = _job_id(request.id)
            owner = _scope()
            job = await self.store.get(job_id, owner)
            # A uint64 past the job's items means "nothing after it"; never an SQL integer overflow.
            after = min(request.after_index, job.total) if request.HasField("after_index") else -1
            while True:
                rows = await self.store.results(job_id, after, _READ_CHUNK)
                for index, result in rows:
                    if result is None:
                        break
                    yield _result_message(index, result)
                    after = index
                else:
                    if len(rows) == _READ_CHUNK:
                        continue  # a full page, all finished: read on
                    job = await self.store.get(job_id, owner)
                    if job.sealed and after >= job.total - 1:
                        return  # every item streamed
                if not request.follow:
                    return
                await asyncio.sleep(_FOLLOW_POLL_S)
        except GengateError as exc:
            await abort(context, exc)


def _result_message(index: int, result: ItemResult) -> jpb.StreamBatchJobResultsResponse:
    if result.failed:
        return jpb.StreamBatchJobResultsResponse(
            index=index, error=status_pb2.Status.FromString(result.payload)
        )
    return jpb.StreamBatchJobResultsResponse(
        index=index, response=gpb.GenerateResponse.FromString(result.payload)
    )
