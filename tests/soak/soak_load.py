"""The mixed load of the soak test: what each kind of call does, which outcomes it may end with,
and how outcomes are recorded and summarised. The scenario itself (server, kill -9, final
checks) is in test_soak_mixed_load.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import jsonschema
from gengate_client import errors as client_errors
from gengate_client.aio import AsyncClient
from gengate_client.output_types import Choice, JsonSchema, Regex
from gengate_client.types import FinishReason, StreamDelta, StreamEnd, StreamFrame, StreamStart
from gengate_proto.v1 import generation_pb2 as g
from gengate_proto.v1 import generation_pb2_grpc
from gengate_proto.v1 import types_pb2 as t

SLACK_S = 5.0  # a call that outlives its own deadline by this much is a hang
CALL_TIMEOUT_S = 30.0  # deadline of every ordinary call: generous, so DEADLINE_EXCEEDED there is a failure

ECHO, TINY, TINY_HF = "echo", "tiny", "tinyhf"
ALL_MODELS = (ECHO, TINY, TINY_HF)
CONSTRAINED_MODELS = (TINY, TINY_HF)

REGEX = r"[0-9]{3}-[A-Z]{2}"
CHOICES = ("red", "green", "blue")
# Bounded everywhere (no free strings, integer range), so random weights cannot ramble to max_tokens.
RECORD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "label": {"enum": ["a", "b", "c"]},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "label", "ok"],
    "additionalProperties": False,
}


@dataclass(frozen=True, slots=True)
class Item:
    """One recorded outcome: a call, or one item of a batch."""

    label: str
    model: str
    kind: str  # "OK", "CANCELLED", "TRUNCATED", "INVALID_OUTPUT", "HANG", a gRPC code name, "EXCEPTION ..."
    started: float
    ended: float
    detail: str = ""

    @property
    def latency_s(self) -> float:
        return self.ended - self.started


# Outcomes each label may end with (besides UNAVAILABLE on the killed model during its restart).
EXPECTED: dict[str, frozenset[str]] = {
    "unary": frozenset({"OK"}),
    "stream_full": frozenset({"OK"}),
    "stream_cancel": frozenset({"CANCELLED", "OK"}),
    "unary_cancel": frozenset({"CANCELLED", "OK"}),
    "deadline_unary": frozenset({"DEADLINE_EXCEEDED", "OK"}),
    "deadline_stream": frozenset({"DEADLINE_EXCEEDED", "OK"}),
    "structured_regex": frozenset({"OK"}),
    "structured_choice": frozenset({"OK"}),
    # JSON may (rarely) spend max_tokens on whitespace: a truncated result is reported, never parsed.
    "structured_json": frozenset({"OK", "TRUNCATED"}),
    "batch": frozenset({"OK"}),
    "batch_item:good": frozenset({"OK"}),
    "batch_item:unknown_model": frozenset({"NOT_FOUND"}),
    "batch_item:n_zero": frozenset({"INVALID_ARGUMENT"}),
    "batch_item:bad_regex": frozenset({"INVALID_ARGUMENT"}),
    "bad_unknown_model": frozenset({"NOT_FOUND"}),
    "bad_n_zero": frozenset({"INVALID_ARGUMENT"}),
    "bad_regex": frozenset({"INVALID_ARGUMENT"}),
    "bad_unsupported_constraint": frozenset({"UNIMPLEMENTED"}),
    "kill_probe": frozenset({"UNAVAILABLE"}),
    "after_restart": frozenset({"OK"}),
}


@dataclass
class KillWindow:
    """When the worker of `model` was killed and when it served again (monotonic seconds)."""

    model: str
    killed_at: float | None = None
    serving_again_at: float | None = None

    def covers(self, item: Item) -> bool:
        """True when `item` overlapped the restart, so UNAVAILABLE is a correct answer for it."""
        if item.model != self.model or self.killed_at is None:
            return False
        until = (self.serving_again_at or time.monotonic()) + 1.0
        return item.started <= until and item.ended >= self.killed_at - 0.5


@dataclass
class Soak:
    """Shared state of one soak run: connections, randomness and everything recorded."""

    client: AsyncClient
    stub: generation_pb2_grpc.GenerationServiceStub
    rng: random.Random
    kill: KillWindow
    items: list[Item] = field(default_factory=list)
    op_ends: list[tuple[float, str]] = field(default_factory=list)  # (end, model) per load call
    validated: Counter[str] = field(default_factory=Counter)

    def record(self, item: Item) -> None:
        self.items.append(item)

    def unexpected(self) -> list[Item]:
        return [
            i
            for i in self.items
            if i.kind not in EXPECTED[i.label] and not (i.kind == "UNAVAILABLE" and self.kill.covers(i))
        ]


def _prompt(rng: random.Random) -> str:
    return " ".join(
        rng.choice(("tell", "me", "a", "story", "about", "cats", "and", "dogs")) for _ in range(6)
    )


def closing_stream(stream: AsyncIterator[StreamFrame]) -> contextlib.aclosing[AsyncGenerator[StreamFrame]]:
    """The client's stream (an async generator) closed on leaving the block, also when the caller
    is cancelled mid-stream, so the gRPC call is cancelled then and there rather than at GC."""
    return contextlib.aclosing(cast(AsyncGenerator[StreamFrame], stream))


def _check_stream(frames: list[Any], n: int) -> str:
    """A complete stream: StreamStart first, then one StreamEnd per generation, nothing after."""
    if not frames or not isinstance(frames[0], StreamStart):
        return "INVALID_STREAM no StreamStart first"
    ends = sorted(f.index for f in frames if isinstance(f, StreamEnd))
    if ends != list(range(n)):
        return f"INVALID_STREAM ends {ends} for n={n}"
    ended: set[int] = set()
    for frame in frames[1:]:
        if isinstance(frame, StreamDelta) and frame.index in ended:
            return f"INVALID_STREAM delta after the end of generation {frame.index}"
        if isinstance(frame, StreamEnd):
            ended.add(frame.index)
    return "OK"


# --- the calls ------------------------------------------------------------------------------------
# Each takes the run, a model and a deadline; returns its outcome kind (errors are raised and
# classified by `run_op`).

OpFn = Callable[[Soak, str, float], Awaitable[str]]


async def op_unary(soak: Soak, model: str, timeout: float) -> str:
    n = soak.rng.choice((1, 1, 2))
    reply = await soak.client.generate(
        model, _prompt(soak.rng), max_tokens=soak.rng.randint(4, 40), n=n, timeout=timeout
    )
    if len(reply.generations) != n or not all(
        gen.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for gen in reply.generations
    ):
        return f"INVALID_REPLY {[gen.finish_reason for gen in reply.generations]}"
    return "OK"


async def op_stream_full(soak: Soak, model: str, timeout: float) -> str:
    n = soak.rng.choice((1, 1, 2))
    closing = closing_stream(
        soak.client.generate_stream(
            model, _prompt(soak.rng), max_tokens=soak.rng.randint(4, 60), n=n, timeout=timeout
        )
    )
    async with closing as stream:
        frames = [frame async for frame in stream]
    return _check_stream(frames, n)


def _raw_request(soak: Soak, model: str, max_tokens: int) -> g.GenerateRequest:
    return g.GenerateRequest(
        model=model, prompt=_prompt(soak.rng), stopping=t.StoppingCriteria(max_tokens=max_tokens)
    )


async def op_stream_cancel(soak: Soak, model: str, timeout: float) -> str:
    """Raw stub: reads a random number of frames, then cancels the call."""
    call = cast(
        "grpc.aio.UnaryStreamCall[g.GenerateStreamRequest, g.GenerateStreamResponse]",
        soak.stub.GenerateStream(
            g.GenerateStreamRequest(request=_raw_request(soak, model, 200)), timeout=timeout
        ),
    )
    keep = soak.rng.randint(1, 8)
    seen = 0
    async for _ in call:
        seen += 1
        if seen >= keep:
            call.cancel()
            break
    code = await call.code()
    return "OK" if code == grpc.StatusCode.OK else str(code.name)


async def op_unary_cancel(soak: Soak, model: str, timeout: float) -> str:
    """Cancels the asyncio task of a unary call at a random point."""
    task = asyncio.create_task(
        soak.client.generate(model, _prompt(soak.rng), max_tokens=200, timeout=timeout)
    )
    await asyncio.sleep(soak.rng.uniform(0.0, 0.08))
    if not task.done():
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
        return "CANCELLED"
    return "OK"


async def op_deadline_unary(soak: Soak, model: str, timeout: float) -> str:
    await soak.client.generate(model, _prompt(soak.rng), max_tokens=300, timeout=timeout)
    return "OK"


async def op_deadline_stream(soak: Soak, model: str, timeout: float) -> str:
    closing = closing_stream(
        soak.client.generate_stream(model, _prompt(soak.rng), max_tokens=300, timeout=timeout)
    )
    async with closing as stream:
        frames = [frame async for frame in stream]
    return _check_stream(frames, 1)


def _validate_texts(soak: Soak, kind: str, texts: list[str], check: Callable[[str], bool]) -> str:
    for text in texts:
        if not check(text):
            return f"INVALID_OUTPUT {text!r}"
    soak.validated[kind] += len(texts)
    return "OK"


async def op_structured_regex(soak: Soak, model: str, timeout: float) -> str:
    reply = await soak.client.generate(
        model, _prompt(soak.rng), output_type=Regex(REGEX), max_tokens=32, n=soak.rng.choice((1, 2)),
        timeout=timeout,
    )  # fmt: skip
    return _validate_texts(soak, "regex", reply.texts, lambda s: re.fullmatch(REGEX, s) is not None)


async def op_structured_choice(soak: Soak, model: str, timeout: float) -> str:
    reply = await soak.client.generate(
        model, _prompt(soak.rng), output_type=Choice(CHOICES), max_tokens=16, timeout=timeout
    )
    return _validate_texts(soak, "choice", reply.texts, lambda s: s in CHOICES)


def _valid_record(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), RECORD_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def op_structured_json(soak: Soak, model: str, timeout: float) -> str:
    reply = await soak.client.generate(
        model, _prompt(soak.rng), output_type=JsonSchema(RECORD_SCHEMA), max_tokens=120,
        seed=soak.rng.randint(0, 2**31), timeout=timeout,
    )  # fmt: skip
    return _validate_texts(soak, "json_schema", reply.texts, _valid_record)


BATCH_BAD_ITEMS: list[tuple[str, dict[str, Any]]] = [
    ("unknown_model", {"model": "no-such-model", "prompt": "x"}),
    ("n_zero", {"model": ECHO, "prompt": "x", "n": 0}),
    ("bad_regex", {"model": TINY, "prompt": "x", "output_type": Regex("([a-z")}),
]


async def op_batch(soak: Soak, model: str, timeout: float) -> str:
    """A batch of good items on every model with one or two bad ones mixed in; records each item."""
    labels: list[tuple[str, str]] = []
    requests: list[dict[str, Any]] = []
    for _ in range(soak.rng.randint(2, 6)):
        good = soak.rng.choice(ALL_MODELS)
        labels.append(("good", good))
        requests.append({"model": good, "prompt": _prompt(soak.rng), "max_tokens": soak.rng.randint(4, 24)})
    for name, request in soak.rng.sample(BATCH_BAD_ITEMS, soak.rng.randint(1, 2)):
        position = soak.rng.randint(0, len(requests))
        labels.insert(position, (name, str(request["model"])))
        requests.insert(position, request)
    started = time.monotonic()
    results = await soak.client.batch_generate(requests, timeout=timeout)
    ended = time.monotonic()
    if [r.index for r in results] != list(range(len(requests))):
        return f"INVALID_BATCH indexes {[r.index for r in results]}"
    for (name, item_model), result in zip(labels, results, strict=True):
        if result.error is None:
            kind = "OK"
        elif isinstance(result.error, client_errors.GengateError):
            kind = result.error.code_name
        else:
            kind = f"EXCEPTION {result.error!r}"
        soak.record(Item(f"batch_item:{name}", item_model, kind, started, ended, str(result.error or "")))
    return "OK"


async def op_bad_unknown_model(soak: Soak, model: str, timeout: float) -> str:
    await soak.client.generate("no-such-model", "x", timeout=timeout)
    return "OK"


async def op_bad_n_zero(soak: Soak, model: str, timeout: float) -> str:
    await soak.client.generate(model, "x", n=0, timeout=timeout)
    return "OK"


async def op_bad_regex(soak: Soak, model: str, timeout: float) -> str:
    await soak.client.generate(model, "x", output_type=Regex("([a-z"), timeout=timeout)
    return "OK"


async def op_bad_unsupported_constraint(soak: Soak, model: str, timeout: float) -> str:
    await soak.client.generate(model, "x", output_type=Regex(REGEX), timeout=timeout)
    return "OK"


@dataclass(frozen=True)
class Op:
    """A kind of call in the mix: how often, on which models, with what deadline."""

    label: str
    run: OpFn
    models: tuple[str, ...]
    weight: float
    timeout: Callable[[random.Random], float] = lambda _rng: CALL_TIMEOUT_S


def _tiny_deadline(rng: random.Random) -> float:
    return rng.uniform(0.001, 0.05)


OPS: tuple[Op, ...] = (
    Op("unary", op_unary, ALL_MODELS, 6),
    Op("stream_full", op_stream_full, ALL_MODELS, 5),
    Op("stream_cancel", op_stream_cancel, ALL_MODELS, 3),
    Op("unary_cancel", op_unary_cancel, ALL_MODELS, 2),
    Op("deadline_unary", op_deadline_unary, ALL_MODELS, 2, _tiny_deadline),
    Op("deadline_stream", op_deadline_stream, ALL_MODELS, 2, _tiny_deadline),
    Op("structured_regex", op_structured_regex, CONSTRAINED_MODELS, 3),
    Op("structured_choice", op_structured_choice, CONSTRAINED_MODELS, 3),
    Op("structured_json", op_structured_json, CONSTRAINED_MODELS, 3),
    Op("batch", op_batch, ("batch",), 2),
    Op("bad_unknown_model", op_bad_unknown_model, ("no-such-model",), 0.4),
    Op("bad_n_zero", op_bad_n_zero, ALL_MODELS, 0.4),
    Op("bad_regex", op_bad_regex, CONSTRAINED_MODELS, 0.4),
    Op("bad_unsupported_constraint", op_bad_unsupported_constraint, (ECHO,), 0.4),
)


def classify(exc: BaseException) -> str:
    """The outcome kind of a call that raised."""
    if isinstance(exc, client_errors.TruncatedOutputError):
        return "TRUNCATED"
    if isinstance(exc, client_errors.OutputError):
        return f"INVALID_OUTPUT {exc}"
    if isinstance(exc, client_errors.GengateError):
        return exc.code_name
    if isinstance(exc, grpc.aio.AioRpcError):
        return str(exc.code().name)
    return f"EXCEPTION {type(exc).__name__}: {exc}"


async def run_op(soak: Soak, op: Op, model: str) -> Item:
    """Runs one call under a hang guard (its deadline + SLACK_S) and records its outcome."""
    timeout = op.timeout(soak.rng)
    started = time.monotonic()
    detail = ""
    try:
        kind = await asyncio.wait_for(op.run(soak, model, timeout), timeout + SLACK_S)
    except TimeoutError:
        kind = "HANG"
    except Exception as exc:
        kind = classify(exc)
        detail = str(exc)[:300]
    item = Item(op.label, model, kind, started, time.monotonic(), detail)
    soak.record(item)
    return item


async def load_loop(soak: Soak, stop_at: float) -> None:
    """One closed-loop caller: picks a call from the mix, runs it, repeats until `stop_at`."""
    weights = [op.weight for op in OPS]
    while time.monotonic() < stop_at:
        op = soak.rng.choices(OPS, weights)[0]
        model = soak.rng.choice(op.models)
        await run_op(soak, op, model)
        soak.op_ends.append((time.monotonic(), model))


def _percentile(values: list[float], q: int) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.quantiles(values, n=100, method='inclusive')[q - 1]:.1f}"


def summary_table(soak: Soak, extra: list[str]) -> str:
    """Counts per label and outcome kind, p50/p95 latency of the OK ones, and extra lines."""
    lines = [f"{'call':<28} {'model':<14} {'n':>6}  {'p50 ms':>8} {'p95 ms':>8}  outcomes"]
    groups: dict[tuple[str, str], list[Item]] = {}
    for item in soak.items:
        groups.setdefault((item.label, item.model), []).append(item)
    for (label, model), items in sorted(groups.items()):
        ok = [i.latency_s * 1000 for i in items if i.kind == "OK"]
        kinds = Counter(i.kind.split(" ")[0] for i in items)
        outcome = ", ".join(f"{k}={v}" for k, v in kinds.most_common())
        lines.append(
            f"{label:<28} {model:<14} {len(items):>6}  {_percentile(ok, 50):>8} "
            f"{_percentile(ok, 95):>8}  {outcome}"
        )
    totals = Counter(i.kind.split(" ")[0] for i in soak.items)
    lines.append("all outcomes: " + ", ".join(f"{k}={v}" for k, v in totals.most_common()))
    lines.append(
        "validated structured outputs: " + ", ".join(f"{k}={v}" for k, v in sorted(soak.validated.items()))
    )
    return "\n".join([*lines, *extra])


def install_tracer_provider() -> None:
    """Tracing on, as with GENGATE_TRACES_FILE or OTLP: an SDK provider (one per process, so reuse
    one another test installed), which makes start_server add the OpenTelemetry interceptor."""
    from gengate.telemetry import tracing_enabled
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    assert tracing_enabled()
