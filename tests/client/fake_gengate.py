"""A fake gengate server for client and CLI tests: canned answers and rich gRPC errors.

It is a thread-pool grpc.server, so both the blocking Client (from the test thread) and the
AsyncClient (from the test event loop) can call it. Every request it receives is recorded; a
test can replace `responder` to choose the answer per request.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from gengate_proto.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status


class Abort(Exception):
    """Raised by a responder to end the call with a rich google.rpc.Status."""

    def __init__(self, status: status_pb2.Status) -> None:
        super().__init__(status.message)
        self.status = status


def rich_status(
    code: int,
    message: str,
    *,
    reason: str = "",
    violations: tuple[tuple[str, str], ...] = (),
    retry_after_s: float | None = None,
) -> status_pb2.Status:
    """A google.rpc.Status with ErrorInfo, BadRequest and RetryInfo details, as the server sends."""
    status = status_pb2.Status(code=code, message=message)
    if reason:
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="gengate.dev", metadata={"model": "x"}))
        status.details.append(detail)
    if violations:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in violations
            ]
        )
        detail = any_pb2.Any()
        detail.Pack(bad)
        status.details.append(detail)
    if retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(retry_after_s * 1000))
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        status.details.append(detail)
    return status


MODELS = [
    types_pb2.ModelInfo(
        name="tiny",
        backend="llamacpp",
        capabilities=types_pb2.ModelCapabilities(
            constraints=[
                types_pb2.ConstraintSupport(kind=k, enforcement=types_pb2.ENFORCEMENT_ENGINE)
                for k in (
                    types_pb2.CONSTRAINT_KIND_JSON_SCHEMA,
                    types_pb2.CONSTRAINT_KIND_REGEX,
                    types_pb2.CONSTRAINT_KIND_CHOICE,
                    types_pb2.CONSTRAINT_KIND_GRAMMAR,
                )
            ],
            grammar_syntaxes=[types_pb2.GRAMMAR_SYNTAX_LARK, types_pb2.GRAMMAR_SYNTAX_GBNF],
            max_n=8,
            logprobs=True,
            max_top_logprobs=5,
            input_modalities=[types_pb2.MODALITY_TEXT],
            context_length=2048,
            seed=True,
            chat=True,
            backend_options=["ignore_eos", "min_tokens"],
        ),
    ),
    types_pb2.ModelInfo(
        name="remote",
        backend="openai",
        capabilities=types_pb2.ModelCapabilities(
            max_n=1, tools=types_pb2.ENFORCEMENT_NATIVE, reasoning_control=True, reasoning=True
        ),
    ),
]


def default_text(request: generation_pb2.GenerateRequest, index: int) -> str:
    """Text that satisfies the request's constraint, so parsing paths can be exercised."""
    so = request.structured_output
    kind = so.WhichOneof("kind")
    if kind == "choice":
        return so.choice.choices[index % len(so.choice.choices)]
    if kind == "regex":
        return "2024-01-31" if "\\d" in so.regex.pattern else "abc"
    if kind == "json_object":
        return '{"ok": true}'
    if kind == "json_schema":
        return json.dumps({"name": "Paris", "population": 2161000, "country_code": "FR"})
    if kind == "grammar":
        return "yes"
    prompt = request.prompt or " ".join(p.text for m in request.messages.messages for p in m.content)
    return f"echo {index}: {prompt}"


def default_responder(request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse:
    """Canned behaviour: NOT_FOUND for unknown models, INVALID_ARGUMENT for max_tokens 0."""
    if request.model not in {m.name for m in MODELS}:
        raise Abort(
            rich_status(
                code_pb2.NOT_FOUND, f"model {request.model!r} is not served", reason="MODEL_NOT_FOUND"
            )
        )
    if request.stopping.HasField("max_tokens") and request.stopping.max_tokens == 0:
        raise Abort(
            rich_status(
                code_pb2.INVALID_ARGUMENT,
                "stopping.max_tokens: must be > 0",
                reason="INVALID_FIELD",
                violations=(("stopping.max_tokens", "must be > 0"),),
            )
        )
    n = request.n if request.HasField("n") else 1
    if n > 8:
        raise Abort(
            rich_status(
                code_pb2.INVALID_ARGUMENT,
                f"n: {n} exceeds max_n 8",
                reason="N_TOO_LARGE",
                violations=(("n", "exceeds max_n 8"),),
            )
        )
    seed = request.sampling.seed if request.sampling.HasField("seed") else 1234
    kind = request.structured_output.WhichOneof("kind")
    generations = [
        types_pb2.Generation(
            index=i,
            text=default_text(request, i),
            finish_reason=types_pb2.FINISH_REASON_STOP,
            output_tokens=3,
        )
        for i in range(n)
    ]
    response = generation_pb2.GenerateResponse(
        request_id=request.request_id or "req-1",
        model=request.model,
        generations=generations,
        usage=types_pb2.Usage(input_tokens=5, output_tokens=3 * n),
        enforcement=types_pb2.ENFORCEMENT_ENGINE if kind else types_pb2.ENFORCEMENT_NONE,
    )
    response.effective_sampling.CopyFrom(request.sampling)
    response.effective_sampling.seed = seed
    response.timings.total.FromMilliseconds(12)
    return response


def chunks(text: str) -> list[str]:
    """Splits text into word-ish deltas."""
    return re.findall(r"\S+\s*|\s+", text) or [""]


def tool_call_fragments(
    index: int, position: int, call: types_pb2.ToolCall
) -> Iterator[generation_pb2.GenerateStreamResponse]:
    """A call as a server streams it: id and name first, the arguments in two pieces."""
    half = len(call.arguments_json) // 2
    pieces = [call.arguments_json[:half], call.arguments_json[half:]]
    for i, piece in enumerate(pieces):
        fragment = types_pb2.ToolCallDelta(index=position, arguments_fragment=piece)
        if i == 0:
            fragment.id, fragment.name = call.id, call.name
        yield generation_pb2.GenerateStreamResponse(
            delta=types_pb2.GenerationDelta(index=index, tool_calls=[fragment])
        )


@dataclass
class FakeGengate(generation_pb2_grpc.GenerationServiceServicer):
    responder: Callable[[generation_pb2.GenerateRequest], generation_pb2.GenerateResponse] = default_responder
    requests: list[Any] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    stream_error_after: int | None = None
    stream_cancelled: threading.Event = field(default_factory=threading.Event)
    stream_completed: threading.Event = field(default_factory=threading.Event)
    stream_delay_s: float = 0.0

    def _record(self, request: Any, context: grpc.ServicerContext) -> None:
        self.requests.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})

    def _answer(self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext) -> Any:
        try:
            return self.responder(request)
        except Abort as abort:
            context.abort_with_status(rpc_status.to_status(abort.status))

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record(request, context)
        return self._answer(request, context)

    def GenerateStream(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self._record(request, context)
        context.add_callback(lambda: None if self.stream_completed.is_set() else self.stream_cancelled.set())
        response = self._answer(request.request, context)
        yield generation_pb2.GenerateStreamResponse(
            start=types_pb2.StreamStart(
                request_id=response.request_id,
                model=response.model,
                input_tokens=response.usage.input_tokens,
                enforcement=response.enforcement,
                effective_sampling=response.effective_sampling,
            )
        )
        sent = 0
        for gen in response.generations:
            if gen.reasoning.text:
                yield generation_pb2.GenerateStreamResponse(
                    delta=types_pb2.GenerationDelta(index=gen.index, reasoning=gen.reasoning.text)
                )
            for position, call in enumerate(gen.tool_calls):
                yield from tool_call_fragments(gen.index, position, call)
            pieces = chunks(gen.text) if gen.text or not gen.tool_calls else []
            for piece in pieces:
                if self.stream_error_after is not None and sent >= self.stream_error_after:
                    status = rich_status(code_pb2.UNAVAILABLE, "engine worker died", reason="WORKER_CRASHED")
                    context.abort_with_status(rpc_status.to_status(status))
                yield generation_pb2.GenerateStreamResponse(
                    delta=types_pb2.GenerationDelta(index=gen.index, text=piece, token_count=1)
                )
                sent += 1
                time.sleep(self.stream_delay_s)
            end = types_pb2.GenerationEnd(
                index=gen.index,
                finish_reason=gen.finish_reason,
                usage=types_pb2.Usage(
                    input_tokens=response.usage.input_tokens, output_tokens=gen.output_tokens
                ),
                tool_calls=gen.tool_calls,
                reasoning_signatures=gen.reasoning.signatures,
            )
            end.timings.total.FromMilliseconds(7)
            yield generation_pb2.GenerateStreamResponse(end=end)
        self.stream_completed.set()

    def BatchGenerate(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self._record(request, context)
        # Answer in reverse order, as a server does when later items finish first.
        for index in reversed(range(len(request.requests))):
            try:
                yield generation_pb2.BatchGenerateResponse(
                    index=index, response=self.responder(request.requests[index])
                )
            except Abort as abort:
                yield generation_pb2.BatchGenerateResponse(index=index, error=abort.status)

    def ListModels(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record(request, context)
        return generation_pb2.ListModelsResponse(models=MODELS)


class RunningFake:
    """A started fake server: `.address`, `.servicer`, `.stop()`."""

    def __init__(self) -> None:
        self.servicer = FakeGengate()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def reset(self) -> None:
        self.servicer.responder = default_responder
        self.servicer.requests.clear()
        self.servicer.metadata.clear()
        self.servicer.stream_error_after = None
        self.servicer.stream_cancelled.clear()
        self.servicer.stream_completed.clear()
        self.servicer.stream_delay_s = 0.0

    def stop(self) -> None:
        self.server.stop(grace=None)
