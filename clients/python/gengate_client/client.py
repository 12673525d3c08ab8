"""The synchronous client: `Client("host:port").generate("tiny", "Hello")`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar, Unpack

import grpc
from gengate_proto.v1 import generation_pb2, generation_pb2_grpc

from gengate_client import _convert as convert
from gengate_client._convert import BaseOptions, CallSettings, GenerateOptions, MetadataLike
from gengate_client._progress import BatchProgress
from gengate_client._retry import RetryPolicy, channel_options, retry_policy
from gengate_client.errors import error_from_rpc
from gengate_client.jobs import BatchJobs
from gengate_client.types import ItemResult, ModelInfo, Request, Response, StreamFrame

T = TypeVar("T")


class Client:
    """A blocking gengate client over one gRPC channel.

    `credentials` (grpc.ChannelCredentials) switches to TLS; `metadata` is sent with every call
    (e.g. an authorization header) and `timeout` is the default deadline in seconds. A call the
    server refuses for now (UNAVAILABLE, RESOURCE_EXHAUSTED) is retried up to `max_retries` times
    (default 2; 0: never) as `retry` (a RetryPolicy) says, honouring the server's RetryInfo.
    """

    def __init__(
        self,
        address: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: MetadataLike | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        max_retries: int | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.address = address
        self.retry = retry_policy(retry, max_retries)
        options = channel_options(options, self.retry)
        if credentials is not None:
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._metadata = metadata
        self._timeout = timeout
        # Durable jobs on the server: create, get, list, cancel, results (gengate_client.jobs).
        self.batch_jobs = BatchJobs(self._channel, CallSettings(None, metadata), timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _kwargs(self, call: CallSettings) -> dict[str, Any]:
        return call.kwargs(self._timeout, self._metadata)

    def generate(self, model: str, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> Response:
        """Runs one request; with `output_type` every generation is parsed into `.parsed`."""
        request, call = convert.split_options(model, prompt, options)
        pb, spec = convert.build_request(request)
        try:
            reply = self._stub.Generate(pb, **self._kwargs(call))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return convert.response(reply, spec)

    def generate_object(
        self, model: str, prompt: str | None = None, *, output_type: type[T], **options: Unpack[BaseOptions]
    ) -> T:
        """The first generation parsed as `output_type` (e.g. a pydantic model instance)."""
        parsed: T = self.generate(model, prompt, output_type=output_type, **options).parsed
        return parsed

    def generate_stream(
        self, model: str, prompt: str | None = None, **options: Unpack[GenerateOptions]
    ) -> Iterator[StreamFrame]:
        """Yields a StreamStart, then StreamDelta frames as text arrives, and a StreamEnd per generation.

        Leaving the loop early cancels the call on the server.
        """
        request, call = convert.split_options(model, prompt, options)
        pb, spec = convert.build_request(request)
        stream = self._stub.GenerateStream(
            generation_pb2.GenerateStreamRequest(request=pb), **self._kwargs(call)
        )
        try:
            for frame in stream:
                yield convert.stream_frame(frame, spec.tools)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            stream.cancel()

    def batch_generate_iter(
        self,
        requests: Sequence[Request | Mapping[str, Any]],
        *,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
    ) -> Iterator[ItemResult]:
        """Yields each item's outcome as soon as it finishes (completion order, see `.index`)."""
        pb, specs = convert.build_batch(requests)
        stream = self._stub.BatchGenerate(pb, **self._kwargs(CallSettings(timeout, metadata)))
        try:
            for item in stream:
                yield convert.batch_item(item, specs)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            stream.cancel()

    def batch_generate(
        self,
        requests: Sequence[Request | Mapping[str, Any]],
        *,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
        progress: bool = False,
    ) -> list[ItemResult]:
        """Every item's outcome, ordered by index; one failed item never fails the others.

        `progress=True` shows a progress bar on stderr (tqdm if installed).
        """
        bar = BatchProgress(len(requests), enabled=progress)
        items: list[ItemResult] = []
        try:
            for item in self.batch_generate_iter(requests, timeout=timeout, metadata=metadata):
                items.append(item)
                bar.update(item)
        finally:
            bar.close()
        return sorted(items, key=lambda item: item.index)

    def list_models(
        self, *, timeout: float | None = None, metadata: MetadataLike | None = None
    ) -> list[ModelInfo]:
        """Every served model and what it can do."""
        try:
            reply = self._stub.ListModels(
                generation_pb2.ListModelsRequest(), **self._kwargs(CallSettings(timeout, metadata))
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return [convert.model_info(m) for m in reply.models]
