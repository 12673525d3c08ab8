"""The service core: checks, routing, validation of every structured result, timings, tracing.

Sits between the api layer (protobuf, gRPC) and the backends (domain objects only). Whatever
enforced a constraint, each finished structured generation is validated here against the
original constraint before it is returned, and so is every tool call against the request's
tools (gengate.tools): an invalid result is never a success.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing

from gengate import tools
from gengate.backend import aclose_stream
from gengate.caller import ANONYMOUS, current_caller, current_policy
from gengate.callers.identity import Caller
from gengate.callers.limits import Admission
from gengate.checks import prepare
from gengate.constraints.sandbox import ConstraintSandbox
from gengate.conversation import MagpieWriter
from gengate.domain import (
    ConstraintKind,
    Enforcement,
    FinishReason,
    Generation,
    GenerationDelta,
    GenerationEnd,
    GenerationRequest,
    GenerationResult,
    ModelInfo,
    StreamEvent,
    StreamStart,
    StructuredOutput,
    evolve,
)
from gengate.errors import (
    ECHO_CHARS,
    Aborted,
    ConfigError,
    FieldViolation,
    GengateError,
    Internal,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unimplemented,
    echo,
)
from gengate.limits import LIMIT_REASON, RequestLimits
from gengate.logs import about_request, log_unexpected
from gengate.observation import RequestObserver, RequestOutcome
from gengate.router import Route, Router

log = logging.getLogger(__name__)
# An output nested past what the validator can walk: not shown valid, so never a success, but
# not proof of an engine fault either (ABORTED, not INTERNAL).
_TOO_DEEP = "nested too deeply to validate"
# Requests larger than this (serialized) are converted and checked off the event loop.
INLINE_REQUEST_BYTES = 64 * 1024
_JSON_KINDS = frozenset({ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT})

# Outcome of one batch item: the result, or the error that ended it.
BatchItem = tuple[int, GenerationResult | GengateError]
# The reasons of a refusal because an output did not validate (OutputValidator, constraints.retries).
_VALIDATION_REASONS = frozenset({"VALIDATION_FAILED", "CONSTRAINT_VIOLATED", "VALIDATION_TIMEOUT"})
# The constraint kind metrics count a request with tools under (its calls are validated output).
TOOLS_KIND = "tools"
# Why a generation's tool calls are refused when it ended before they could be complete.
TOOL_CALLS_INCOMPLETE = "TOOL_CALLS_INCOMPLETE"


class GenerationCore:
    """What the gRPC servicer calls; owns the router, the request limits and the constraint sandbox.

    `observer` (metrics) sees every request once as it ends (gengate.observation); None: no one.
    """

    def __init__(
        self,
        router: Router,
        *,
        max_batch_items: int = 4096,
        batch_parallelism: int = 256,
        limits: RequestLimits | None = None,
        admission: Admission | None = None,
        observer: RequestObserver | None = None,
    ) -> None:
        self.router = router
        # Callers' quotas; a call is admitted under them when it runs for a caller (callers.context).
        self.admission = admission if admission is not None else Admission()
        self.observer = observer
        self.max_batch_items = max_batch_items
        self.batch_parallelism = batch_parallelism
        self.limits = limits or RequestLimits()
        self.sandbox = ConstraintSandbox(self.limits)
        self.validator = OutputValidator(self.limits.validation_timeout_s)

    def list_models(self) -> list[ModelInfo]:
        """The served models, as far as the current caller may use them."""
        caller = current_policy()
        models = self.router.models()
        if caller is None or caller.models is None:
            return models
        return [m for m in models if caller.may_use(m.name)]

    def _quota_caller(self, request: GenerationRequest, *, quotas: bool = True) -> Caller | None:
        """The current caller when its quotas apply to this request, after checking it may use
        the model (PermissionDenied otherwise). None: no caller, one without quotas, or `quotas`
        off (batch-job items: they run only in spare capacity, below every caller, so a caller's
        own job never locks it out)."""
        caller = current_policy()
        if caller is None:
            return None
        models = caller.models  # Caller.may_use, spelled out: once per call
        if request.model and models is not None and request.model not in models:
            raise not_allowed(caller, request.model)
        return caller if caller.limited and quotas else None

    async def _prepare(self, request: GenerationRequest) -> tuple[Route, GenerationRequest]:
        """Routes and checks the request: limits and capabilities here (in a thread when the request
        is large), the constraint's content in the sandbox (a crash or a bomb costs this request only)."""
        route = self.router.route(request.model)
        large = request.wire_bytes > INLINE_REQUEST_BYTES
        if large:
            request = await asyncio.to_thread(self._checked, route, request)
        else:
            request = self._checked(route, request)
        structured = request.structured_output
        if structured is not None:
            kind = structured.constraint.kind
            native_json = (
                route.backend.capabilities.constraints.get(kind) is Enforcement.NATIVE and kind in _JSON_KINDS
            )
            await self.sandbox.check(structured, trial_compile=not native_json, off_loop=large)
        if request.tools:
            # Each tool's schema is a json_schema constraint, judged (and its verdict cached) alike.
            native = route.backend.capabilities.tools is Enforcement.NATIVE
            for i, tool in enumerate(request.tools):
                try:
                    await self.sandbox.check(
                        tools.tool_structured(tool), trial_compile=not native, off_loop=large
                    )
                except (InvalidArgument, Unimplemented) as exc:
                    raise tools.at_tool(exc, i) from None
        return route, request

    async def warm_constraints(self) -> None:
        """Each model's `warm_constraints` through the checks and the sandbox, as their first request
        would go (the engines compiled them when they loaded): that request then skips both."""
        for route in self.router.routes:
            for constraint in getattr(route.config.options, "warm_constraints", ()):
                warm = GenerationRequest(
                    model=route.name, prompt="warm", structured_output=constraint.structured()
                )
                try:
                    await self._prepare(warm)
                except GengateError as exc:
                    raise ConfigError(f"model {route.name!r}: warm_constraints: {exc.message}") from None

    async def prepare(self, request: GenerationRequest) -> tuple[Route, GenerationRequest]:
        """The route and the checked request (defaults filled in) that `generate` would run:
        for work that reaches the backend another way (an offline job's provider batch). The
        current caller must be allowed the model; no quota is charged."""
        caller = current_policy()
        if caller is not None and request.model and not caller.may_use(request.model):
            raise not_allowed(caller, request.model)
        return await self._prepare(request)

    async def finish(
        self, route: Route, request: GenerationRequest, result: GenerationResult, arrived: float | None = None
    ) -> GenerationResult:
        """A backend's result as callers get it: every generation validated against the
        original constraint and its tool calls against the request's tools (an invalid one
        raises, never a success), named for the route and the request, timed from `arrived`
        (time.monotonic()) where given."""
        enforcement = _enforcement(route, request, result.enforcement)
        generations = []
        for generation in result.generations:
            await self.validator.check(request.structured_output, generation, enforcement.value)
            generations.append(await self.validator.check_calls(request, generation, enforcement.value))
        timings = result.timings
        if arrived is not None:
            timings = evolve(timings, total_s=time.monotonic() - arrived)
        return evolve(
            result,
            request_id=request.request_id,
            model=route.name,
            timings=timings,
            enforcement=enforcement,
            generations=tuple(generations),
        )

    def _checked(self, route: Route, request: GenerationRequest) -> GenerationRequest:
        request_id = None if request.request_id else uuid.uuid4().hex
        return prepare(request, route.backend.capabilities, request_id=request_id, limits=self.limits)

    async def aclose(self) -> None:
        await self.sandbox.aclose()
        self.validator.close()
        await self.admission.aclose()

    async def generate(
        self,
        request: GenerationRequest,
        *,
        queue_bounded: bool = True,
        background: bool = False,
        operation: str = "generate",
    ) -> GenerationResult:
        """One request, checked, routed and validated. `background` (batch jobs) yields the
        model's slots to interactive calls (Route.slot) and charges no caller quota.
        `operation` names it to the observer."""
        arrived = time.monotonic()
        if self.observer is None:
            return await self._admitted(request, queue_bounded, background, arrived)
        policy = current_policy()  # current_caller(), spelled out: once per call
        caller = ANONYMOUS if policy is None else policy.name
        try:
            result = await self._admitted(request, queue_bounded, background, arrived)
        except BaseException as exc:
            self._observe(operation, request, caller, arrived, error=exc)
            raise
        self._observe_success(operation, request, caller, arrived, result)
        return result

    async def _admitted(
        self, request: GenerationRequest, queue_bounded: bool, background: bool, arrived: float
    ) -> GenerationResult:
        """The request under the current caller's quotas (its tokens charged once known)."""
        caller = self._quota_caller(request, quotas=not background)
        if caller is None:
            return await self._generate(request, arrived, queue_bounded, background)
        # admit_now: no coroutine per call where the quota state needs no await (in this process)
        wait = not queue_bounded
        admission = self.admission
        admitted = admission.admit_now(caller, wait=wait) or await admission.admit(caller, wait=wait)
        try:
            result = await self._generate(request, arrived, queue_bounded, background)
            tokens = result.usage.input_tokens + result.usage.output_tokens
            if not admitted.charge_now(tokens):
                await admitted.charge(tokens)
            return result
        finally:
            admitted.release()

    async def _generate(
        self, request: GenerationRequest, arrived: float, queue_bounded: bool, background: bool
    ) -> GenerationResult:
        route, request = await self._prepare(request)
        with about_request(request.request_id, route.name):
            if request.magpie is not None:
                writer = MagpieWriter(route, request, bounded=queue_bounded, background=background)
                return await self.finish(route, request, await writer.write(), arrived)
            result = await route.generate(request, bounded=queue_bounded, background=background)
            return await self.finish(route, request, result, arrived)

    def generate_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        """One request's stream, checked, routed, each generation validated at its end (observed
        when there is an observer; without one, no generator more than before)."""
        if self.observer is None:
            return self._admitted_stream(request, None)
        return self._observed_stream(request)

    async def _observed_stream(self, request: GenerationRequest) -> AsyncIterator[StreamEvent]:
        watch = StreamWatch(time.monotonic())
        caller = current_caller()
        error: BaseException | None = None
        try:
            # aclosing: a consumer that closes this stream closes the one below now (its finally
            # aborts the engine request), not whenever the garbage collector gets to it.
            async with contextlib.aclosing(self._admitted_stream(request, watch)) as events:
                async for event in events:
                    yield event
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._observe("generate_stream", request, caller, watch.arrived, error=error, stream=watch)

    async def _admitted_stream(
        self, request: GenerationRequest, watch: StreamWatch | None
    ) -> AsyncGenerator[StreamEvent, None]:
        """The stream under the current caller's quotas: its tokens are charged as the stream
        tells them (input at the start, output at each generation's end)."""
        arrived = time.monotonic()
        caller = self._quota_caller(request)
        admitted = None
        if caller is not None:
            admitted = self.admission.admit_now(caller) or await self.admission.admit(caller)
        # aclosing: a stream dropped by its caller closes the inner one here, in this task, at
        # once (not later from the event loop's finalizer, in another task).
        async with aclosing(self._stream(request, arrived, watch)) as events:
            if admitted is None:
                async for event in events:
                    yield event
                return
            try:
                async for event in events:
                    if isinstance(event, StreamStart):
                        if not admitted.charge_now(event.input_tokens):
                            await admitted.charge(event.input_tokens)
                    elif isinstance(event, GenerationEnd):
                        if not admitted.charge_now(event.usage.output_tokens):
                            await admitted.charge(event.usage.output_tokens)
                    yield event
            finally:
                admitted.release()

    async def _stream(
        self, request: GenerationRequest, arrived: float, watch: StreamWatch | None
    ) -> AsyncGenerator[StreamEvent, None]:
        route, request = await self._prepare(request)
        if request.magpie is not None:
            raise Unimplemented(
                "a Magpie request is answered whole, turn after turn: use Generate or BatchGenerate",
                reason="MAGPIE_NOT_STREAMED",
                violations=[FieldViolation("request.magpie", "not served by GenerateStream")],
            )
        texts: dict[int, list[str]] = {}
        enforcement = "none"
        stream = route.generate_stream(request)
        try:
            with about_request(request.request_id, route.name):
                async for event in stream:
                    if isinstance(event, StreamStart):
                        declared = _enforcement(route, request, event.enforcement)
                        enforcement = declared.value
                        event = evolve(
                            event, request_id=request.request_id, model=route.name, enforcement=declared
                        )
                    elif isinstance(event, GenerationDelta):
                        texts.setdefault(event.index, []).append(event.text)
                    elif isinstance(event, GenerationEnd):
                        generation = Generation(
                            index=event.index,
                            text="".join(texts.pop(event.index, [])),
                            finish_reason=event.finish_reason,
                            tool_calls=event.tool_calls,
                        )
                        await self.validator.check(request.structured_output, generation, enforcement)
                        # The end frame's calls are the complete ones: checked here, ids filled.
                        checked = await self.validator.check_calls(request, generation, enforcement)
                        timings = evolve(event.timings, total_s=time.monotonic() - arrived)
                        event = evolve(
                            event,
                            timings=timings,
                            tool_calls=checked.tool_calls,
                            finish_reason=checked.finish_reason,
                        )
                    if watch is not None:
                        watch.saw(event)
                    yield event
        finally:
            await aclose_stream(stream)

    def refused(self, operation: str, model: str, error: GengateError, duration_s: float) -> None:
        """A request refused before it reached the core (it could not be converted)."""
        if self.observer is None:
            return
        self.observer.request_done(
            RequestOutcome(
                operation=operation,
                model=model if self.router.serves(model) else "",
                caller=current_caller(),
                code=error.code.value,
                duration_s=duration_s,
            )
        )

    def _observe_success(
        self,
        operation: str,
        request: GenerationRequest,
        caller: str,
        arrived: float,
        result: GenerationResult,
    ) -> None:
        """`_observe` of a unary success, told field by field (`succeeded`: no RequestOutcome is
        built; its model is served). Positional and enums read by `_value_` (`Enum.value` is a
        Python-level property): it runs once per request (counted with callgrind)."""
        assert self.observer is not None
        structured = request.structured_output
        kind = structured.constraint.kind._value_ if structured is not None else None
        if kind is None and request.tools:
            kind = TOOLS_KIND
        usage, timings = result.usage, result.timings
        output_tokens = usage.output_tokens
        tpot: tuple[float, ...] = ()
        first = timings.time_to_first_token_s
        if output_tokens > 1 and first is not None and timings.total_s is not None and request.n == 1:
            tpot = ((timings.total_s - first) / (output_tokens - 1),)
        self.observer.succeeded(
            operation, request.model, caller, time.monotonic() - arrived, usage.input_tokens,
            output_tokens, usage.cached_input_tokens, tpot, kind, result.enforcement._value_,
        )  # fmt: skip

    def _observe(
        self,
        operation: str,
        request: GenerationRequest,
        caller: str,
        arrived: float,
        *,
        error: BaseException | None = None,
        stream: StreamWatch | None = None,
    ) -> None:
        """Tells the observer how a request that failed, or a stream, ended (a unary success:
        `_observe_success`)."""
        assert self.observer is not None
        structured = request.structured_output
        kind: str | None = structured.constraint.kind._value_ if structured is not None else None
        if kind is None and request.tools:
            kind = TOOLS_KIND
        enforcement: str | None = None
        served = self.router.serves(request.model)
        tokens = (0, 0, 0)  # input, output, cached
        ttft = None
        tpot: tuple[float, ...] = ()
        if stream is not None:
            enforcement = stream.enforcement
            tokens = (stream.input_tokens, stream.output_tokens, stream.cached_tokens)
            ttft = stream.first_token_s
            tpot = tuple(stream.per_token_s)
        if isinstance(error, GengateError) and kind is not None and enforcement is None:
            enforcement = error.metadata.get("enforcement")
        if kind is not None and enforcement is None and served:
            caps = self.router.route(request.model).backend.capabilities
            declared = caps.tools if structured is None else caps.constraints.get(structured.constraint.kind)
            enforcement = declared._value_ if declared is not None else Enforcement.NONE._value_
        self.observer.request_done(
            RequestOutcome(
                operation=operation,
                model=request.model if served else "",
                caller=caller,
                code=_code_of(error),
                duration_s=time.monotonic() - arrived,
                input_tokens=tokens[0],
                output_tokens=tokens[1],
                cached_input_tokens=tokens[2],
                time_to_first_token_s=ttft,
                time_per_output_token_s=tpot,
                constraint_kind=kind,
                enforcement=enforcement,
                validation_failed=isinstance(error, GengateError) and error.reason in _VALIDATION_REASONS,
            )
        )

    def check_batch_size(self, count: int) -> None:
        """Refuses a batch over max_batch_items, before any item is converted or checked."""
        if count > self.max_batch_items:
            raise InvalidArgument.field(
                "requests",
                f"the number of items is {count}, over the limit of {self.max_batch_items} "
                "(server.max_batch_items)",
                reason=LIMIT_REASON,
            )

    async def batch(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[BatchItem]:
        """Runs every item concurrently (bounded); yields (index, result or error) as each finishes."""
        self.check_batch_size(len(requests))
        if not requests:
            raise InvalidArgument.field("requests", "must contain at least one request")
        gate = asyncio.Semaphore(self.batch_parallelism)
        # Per model, a batch keeps at most max_concurrency items in flight and lets them wait for a
        # slot past max_queue: a large batch is one caller, and its items queue instead of failing.
        per_model: dict[str, asyncio.Semaphore] = {}
        for request in requests:
            if request.model not in per_model:
                limit = self.router.concurrency_of(request.model)
                per_model[request.model] = asyncio.Semaphore(limit or self.batch_parallelism)
        done: asyncio.Queue[BatchItem] = asyncio.Queue()

        async def run(index: int, request: GenerationRequest) -> None:
            async with per_model[request.model], gate:  # a saturated model holds no batch-wide slot
                try:
                    outcome: GenerationResult | GengateError = await self.generate(
                        request, queue_bounded=False, operation="batch_generate"
                    )
                except GengateError as exc:
                    outcome = exc
                except Exception as exc:  # one broken item never fails the batch
                    log_unexpected(log, exc, "batch item %d failed", index)
                    outcome = Internal(
                        f"item failed: unexpected server error ({type(exc).__name__})", reason="UNEXPECTED"
                    )
            await done.put((index, outcome))

        tasks = [asyncio.create_task(run(i, r)) for i, r in enumerate(requests)]
        try:
            for _ in tasks:
                yield await done.get()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _enforcement(route: Route, request: GenerationRequest, reported: Enforcement) -> Enforcement:
    """The enforcement a response reports: with tools, how the backend enforces tool calls (what
    it reported, else what it declared); otherwise what it reported."""
    if not request.tools or reported is not Enforcement.NONE:
        return reported
    return route.backend.capabilities.tools or Enforcement.NONE


def not_allowed(caller: Caller, model: str) -> PermissionDenied:
    """PERMISSION_DENIED for a model outside the caller's `models` (whether or not it is served:
    a caller learns nothing about the models it may not use)."""
    allowed = ", ".join(sorted(caller.models or ())) or "none"
    return PermissionDenied(
        f"caller {caller.name!r} may not use model {echo(model)} (its models: {allowed})",
        reason="MODEL_NOT_ALLOWED",
        metadata={"model": model[:ECHO_CHARS], "caller": caller.name},
    )


def _code_of(error: BaseException | None) -> str:
    """The gRPC code's name a request ends with (as api/servicer.py answers it)."""
    if error is None:
        return "OK"
    if isinstance(error, GengateError):
        return error.code.value
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    return "INTERNAL"  # the servicer answers anything else INTERNAL UNEXPECTED


class StreamWatch:
    """What an observed stream showed on its way through: tokens, enforcement, when text came."""

    __slots__ = (
        "_first_at", "arrived", "cached_tokens", "enforcement", "first_token_s", "input_tokens",
        "output_tokens", "per_token_s",
    )  # fmt: skip

    def __init__(self, arrived: float) -> None:
        self.arrived = arrived
        self.enforcement: str | None = None
        self.input_tokens = 0
        self.output_tokens = 0
        self.cached_tokens = 0
        self.first_token_s: float | None = None
        self.per_token_s: list[float] = []
        self._first_at: dict[int, float] = {}  # generation index -> when its first text came

    def saw(self, event: StreamEvent) -> None:
        if isinstance(event, GenerationDelta):
            if event.index not in self._first_at:
                now = time.monotonic()
                self._first_at[event.index] = now
                if self.first_token_s is None:
                    self.first_token_s = now - self.arrived
        elif isinstance(event, GenerationEnd):
            tokens = event.usage.output_tokens
            self.output_tokens += tokens
            self.cached_tokens = max(self.cached_tokens, event.usage.cached_input_tokens)
            first = self._first_at.get(event.index)
            if first is not None and tokens > 1:
                self.per_token_s.append((time.monotonic() - first) / (tokens - 1))
        elif isinstance(event, StreamStart):
            self.input_tokens = event.input_tokens
            self.enforcement = event.enforcement.value


class OutputValidator:
    """Validates finished generations against the original constraint, off the event loop.

    Matching is linear-time (RE2 / llguidance, never a backtracking `re`), and each check runs in
    a small thread pool under a time budget, so no output can stall other callers.
    Generations cut by max_tokens or a stop string are incomplete and returned as such (their
    finish reason says so); a complete one that does not validate is an error, never a success.
    """

    def __init__(self, timeout_s: float, *, threads: int = 4) -> None:
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gengate-validate")

    async def check(
        self, structured: StructuredOutput | None, generation: Generation, enforcement: str
    ) -> None:
        """Raises INTERNAL (enforced) or ABORTED (validated) when a complete generation is invalid."""
        if structured is None or generation.finish_reason is not FinishReason.STOP:
            return
        from gengate.constraints import cheap_to_validate, validate_output

        if cheap_to_validate(structured, generation.text):
            self._judge(structured, generation, enforcement, validate_output(structured, generation.text))
            return
        kind = structured.constraint.kind.value
        problem = await self._off_loop(
            lambda: validate_output(structured, generation.text),
            f"generation {generation.index}: validating it against the {kind} constraint",
            enforcement,
        )
        self._judge(structured, generation, enforcement, problem)

    async def check_calls(
        self, request: GenerationRequest, generation: Generation, enforcement: str
    ) -> Generation:
        """The generation as returned: its tool calls checked against the request's tools
        (tools.ToolSet.call_errors, off the event loop), ids filled where the backend gave none,
        finish reason TOOL_CALLS exactly when there are calls. Raises when the calls are not what
        the request allows: INTERNAL CONSTRAINT_VIOLATED where an engine enforced them (a server
        fault), else ABORTED VALIDATION_FAILED (a provider's or a validated backend's answer);
        calls from a generation cut short (max_tokens, a stop string, ...) are ABORTED
        TOOL_CALLS_INCOMPLETE, never returned."""
        calls, finish = generation.tool_calls, generation.finish_reason
        if not request.tools and not calls and finish is not FinishReason.TOOL_CALLS:
            return generation
        if calls and finish not in (FinishReason.STOP, FinishReason.TOOL_CALLS):
            raise Aborted(
                f"generation {generation.index} ended ({finish.value}) with tool calls that may be "
                "incomplete; none is returned (raise stopping.max_tokens, or drop the stop strings)",
                reason=TOOL_CALLS_INCOMPLETE,
                metadata={"enforcement": enforcement, "finish_reason": finish.value},
            )
        if finish is FinishReason.TOOL_CALLS and not calls:
            problem: str | None = "the finish reason is tool_calls but the model made no call"
        elif not calls:
            # A generation cut short without calls is returned as such (its finish reason says so).
            incomplete = finish is not FinishReason.STOP
            problem = None if incomplete else tools.ToolSet(request).call_errors(calls)  # no arguments
        else:
            toolset = tools.ToolSet(request)
            problem = await self._off_loop(
                lambda: toolset.call_errors(calls),
                f"generation {generation.index}: validating its tool calls",
                enforcement,
            )
        if problem is not None:
            detail = f"generation {generation.index}'s tool calls are not what the request allows: {problem}"
            metadata = {"enforcement": enforcement, "constraint_kind": TOOLS_KIND}
            if enforcement == Enforcement.ENGINE.value and problem != _TOO_DEEP:
                raise Internal(detail, reason="CONSTRAINT_VIOLATED", metadata=metadata)
            raise Aborted(detail, reason="VALIDATION_FAILED", metadata=metadata)
        if not calls:
            return generation
        filled = tuple(call if call.id else evolve(call, id=tools.new_call_id()) for call in calls)
        return evolve(generation, tool_calls=filled, finish_reason=FinishReason.TOOL_CALLS)

    async def _off_loop(self, validate: Callable[[], str | None], what: str, enforcement: str) -> str | None:
        """`validate()` in the pool under the time budget: RESOURCE_EXHAUSTED when the pool is
        too busy to start it in time, ABORTED VALIDATION_TIMEOUT when it ran out of time."""
        started: list[float] = []

        def run() -> str | None:
            started.append(time.monotonic())
            try:
                return validate()
            except RecursionError:
                return _TOO_DEEP

        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._executor, run)
        try:
            return await asyncio.wait_for(asyncio.shield(work), self.timeout_s)
        except TimeoutError:
            if not started or time.monotonic() - started[0] < self.timeout_s / 2:
                raise ResourceExhausted(
                    "the output validators are busy; try again shortly",
                    reason="VALIDATORS_BUSY",
                    retry_after_s=1.0,
                ) from None
            raise Aborted(
                f"{what} took over {self.timeout_s:g} s",
                reason="VALIDATION_TIMEOUT",
                metadata={"enforcement": enforcement},
            ) from None

    def _judge(
        self, structured: StructuredOutput, generation: Generation, enforcement: str, problem: str | None
    ) -> None:
        if problem is None:
            return
        kind = structured.constraint.kind.value
        detail = f"generation {generation.index} does not satisfy the {kind} constraint: {problem}"
        if enforcement in ("engine", "native") and problem != _TOO_DEEP:
            raise Internal(detail, reason="CONSTRAINT_VIOLATED", metadata={"enforcement": enforcement})
        raise Aborted(detail, reason="VALIDATION_FAILED", metadata={"enforcement": enforcement})

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
