"""The metric families a server records as calls end, in a registry of its own.

`Metrics` is the server's RequestObserver and RouteObserver (gengate.observation): the service
core tells it how each request ended, the router what the layers below noted of each routed
call. Families named after the OpenTelemetry GenAI semantic conventions (as Prometheus writes
them) sit beside gengate's own. Nothing here knows about gRPC or the backends: only outcomes.

Each request touches a handful of series; the label children are looked up once per label
combination and kept (prometheus_client's `labels()` costs a lock and a dict lookup per call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics import MetricWrapperBase

from gengate.domain import GenerationRequest
from gengate.observation import CallNotes, RequestOutcome

M = TypeVar("M", bound=MetricWrapperBase)

# Bucket boundaries the GenAI semantic conventions advise for each histogram.
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

MODEL = "gen_ai_request_model"
OPERATION = "gen_ai_operation_name"
TOKEN_TYPE = "gen_ai_token_type"
GENAI = (MODEL, OPERATION, "caller")

# The semantic-convention name and attribute keys of each GenAI family (for the OTLP bridge).
SEMCONV_NAMES = {
    "gen_ai_server_request_duration_seconds": "gen_ai.server.request.duration",
    "gen_ai_server_time_to_first_token_seconds": "gen_ai.server.time_to_first_token",
    "gen_ai_server_time_per_output_token_seconds": "gen_ai.server.time_per_output_token",
    "gen_ai_client_token_usage_tokens": "gen_ai.client.token.usage",
}
SEMCONV_LABELS = {
    MODEL: "gen_ai.request.model",
    OPERATION: "gen_ai.operation.name",
    TOKEN_TYPE: "gen_ai.token.type",
    "error_type": "error.type",
}


@dataclass(frozen=True, slots=True)
class _RequestSeries:
    """The series of one (model, operation, caller)."""

    ttft: Histogram
    tpot: Histogram
    input_usage: Histogram
    output_usage: Histogram


@dataclass(frozen=True, slots=True)
class _CallerSeries:
    """The token counters of one (model, caller)."""

    input: Counter
    output: Counter
    cached: Counter


class Metrics:
    """One server's metric families and the observer that records into them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.request_duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "Time from a request's arrival to its end (GenAI semconv gen_ai.server.request.duration); "
            "error_type is the gRPC code of a request that failed, empty when it succeeded.",
            [*GENAI, "error_type"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Streams: time from the request's arrival to its first generated text.",
            GENAI,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Time per output token after the first, per generation of a successful request.",
            GENAI,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.token_usage = Histogram(
            "gen_ai_client_token_usage_tokens",
            "Tokens per successful request, by gen_ai_token_type (input, output).",
            [*GENAI, TOKEN_TYPE],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "gengate_requests",
            "Requests by the gRPC code they ended with (model empty: a name that is not served).",
            ["model", "caller", "code"],
            registry=r,
        )
        self.tokens = Counter(
            "gengate_tokens",
            "Tokens of successful requests: input, output, and cached (input tokens served from a "
            "prompt cache, also counted as input).",
            ["model", "caller", "type"],
            registry=r,
        )
        self.structured = Counter(
            "gengate_structured_requests",
            "Requests for structured output, by constraint kind and the enforcement that served it.",
            ["model", "kind", "enforcement"],
            registry=r,
        )
        self.validation_failures = Counter(
            "gengate_validation_failures",
            "Requests refused because a structured output did not validate (ABORTED "
            "VALIDATION_FAILED, INTERNAL CONSTRAINT_VIOLATED).",
            ["model", "kind", "enforcement"],
            registry=r,
        )
        self.validation_retries = Counter(
            "gengate_validation_retries",
            "Generations tried again because they did not validate: re-sampled by a local engine "
            "(method resample) or re-asked of a provider with the error (method reask).",
            ["model", "kind", "method"],
            registry=r,
        )
        self.compile_cache = Counter(
            "gengate_constraint_compile_cache",
            "Constraint compiles of the engines' compile caches: hit (cached or being compiled for "
            "another call) or miss (compiled for this call).",
            ["model", "result"],
            registry=r,
        )
        self.compile_time = Histogram(
            "gengate_constraint_compile_duration_seconds",
            "How long an engine took to lower and compile a constraint it did not have cached.",
            ["model"],
            buckets=COMPILE_BUCKETS,
            registry=r,
        )
        self.provider_retries = Counter(
            "gengate_provider_retries",
            "Provider calls retried, by the reason of the error that was retried.",
            ["model", "reason"],
            registry=r,
        )
        self.upstream = Counter(
            "gengate_upstream_responses",
            "Provider attempts by their answer: ok, the HTTP status of an error, or timeout, "
            "unreachable, bad_response when there was none.",
            ["model", "status"],
            registry=r,
        )
        self._requests: dict[tuple[str, str, str], _RequestSeries] = {}
        self._durations: dict[tuple[str, str, str, str], Histogram] = {}
        self._callers: dict[tuple[str, str], _CallerSeries] = {}
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}

    # --- RequestObserver ------------------------------------------------------------------

    def request_done(self, outcome: RequestOutcome) -> None:
        model, caller, code = outcome.model, outcome.caller, outcome.code
        ok = code == "OK"
        key = (model, outcome.operation, caller)
        duration = self._durations.get((*key, code))
        if duration is None:
            duration = self.request_duration.labels(*key, "" if ok else code)
            self._durations[(*key, code)] = duration
        duration.observe(outcome.duration_s)
        self._child(self.requests, (model, caller, code)).inc()
        if outcome.constraint_kind is not None:
            enforcement = outcome.enforcement or "none"
            labels = (model, outcome.constraint_kind, enforcement)
            self._child(self.structured, labels).inc()
            if outcome.validation_failed:
                self._child(self.validation_failures, labels).inc()
        if outcome.time_to_first_token_s is None and not outcome.time_per_output_token_s and not ok:
            return
        series = self._requests.get(key)
        if series is None:
            series = _RequestSeries(
                ttft=self.time_to_first_token.labels(*key),
                tpot=self.time_per_output_token.labels(*key),
                input_usage=self.token_usage.labels(*key, "input"),
                output_usage=self.token_usage.labels(*key, "output"),
            )
            self._requests[key] = series
        if outcome.time_to_first_token_s is not None:
            series.ttft.observe(outcome.time_to_first_token_s)
        for seconds in outcome.time_per_output_token_s:
            series.tpot.observe(seconds)
        if not ok:
            return
        series.input_usage.observe(outcome.input_tokens)
        series.output_usage.observe(outcome.output_tokens)
        counters = self._callers.get((model, caller))
        if counters is None:
            counters = _CallerSeries(
                input=self.tokens.labels(model, caller, "input"),
                output=self.tokens.labels(model, caller, "output"),
                cached=self.tokens.labels(model, caller, "cached"),
            )
            self._callers[(model, caller)] = counters
        counters.input.inc(outcome.input_tokens)
        counters.output.inc(outcome.output_tokens)
        if outcome.cached_input_tokens:
            counters.cached.inc(outcome.cached_input_tokens)

    # --- RouteObserver --------------------------------------------------------------------

    def routed(self, model: str, request: GenerationRequest, notes: CallNotes) -> None:
        if notes.empty():
            return
        structured = request.structured_output
        kind = structured.constraint.kind.value if structured is not None else "none"
        for method, count in notes.validation_retries.items():
            self._child(self.validation_retries, (model, kind, method)).inc(count)
        if notes.compile_hits:
            self._child(self.compile_cache, (model, "hit")).inc(notes.compile_hits)
        if notes.compile_misses:
            self._child(self.compile_cache, (model, "miss")).inc(notes.compile_misses)
        for seconds in notes.compile_s:
            self._child(self.compile_time, (model,)).observe(seconds)
        for reason, count in notes.provider_retries.items():
            self._child(self.provider_retries, (model, reason)).inc(count)
        for status, count in notes.upstream.items():
            self._child(self.upstream, (model, status)).inc(count)

    def _child(self, family: M, labels: tuple[str, ...]) -> M:
        """`family.labels(*labels)`, looked up once."""
        key = (family, labels)
        child = self._children.get(key)
        if child is None:
            child = family.labels(*labels)
            self._children[key] = child
        return cast(M, child)
