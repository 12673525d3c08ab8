"""The metric families a server records as calls end, in a registry of its own.

`Metrics` is the server's RequestObserver and RouteObserver (gengate.observation): the service
core tells it how each request ended, the router what the layers below noted of each routed
call. Families named after the OpenTelemetry GenAI semantic conventions (as Prometheus writes
them) sit beside gengate's own. Nothing here knows about gRPC or the backends: only outcomes.

Recording is on the event loop and costs a dict lookup and a few integer additions per series
(prometheus_client's own Counter and Histogram take a lock per increment: two per histogram
observation, ~3 µs each); the families are built from those numbers when a scrape (or the OTLP
bridge) collects the registry. A series is written by the event loop only; a scrape copies it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from gengate.config import ModelPrice
from gengate.domain import GenerationRequest
from gengate.observation import CallNotes, RequestOutcome

# A sample's value as prometheus_client writes it (Go's formatting: 1.0, +Inf, 1e+06).
_value_text: Callable[[float], str] = floatToGoString

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


class CounterSeries:
    """One labelled series of a counter."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramSeries:
    """One labelled series of a histogram: a count per bucket (the last one +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket with value <= le
        self.total += value


class Family:
    """A counter or histogram family: its name (a counter's without `_total`), help, label names
    and series by label values."""

    def __init__(
        self, name: str, help: str, labels: Sequence[str], buckets: Sequence[float] | None = None
    ) -> None:
        self.name = name
        self.help = help
        self.labels = tuple(labels)
        self.buckets = tuple(buckets) if buckets is not None else None
        self.kind = "counter" if buckets is None else "histogram"
        self._series: dict[tuple[str, ...], CounterSeries | HistogramSeries] = {}
        sample = f"{name}_total" if buckets is None else name
        escaped_help = help.replace("\\", r"\\").replace("\n", r"\n")
        self._header = f"# HELP {sample} {escaped_help}\n# TYPE {sample} {self.kind}\n"
        self._text_prefixes: dict[tuple[str, ...], list[str]] = {}

    def counter(self, *values: str) -> CounterSeries:
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = CounterSeries()
        assert isinstance(series, CounterSeries)
        return series

    def histogram(self, *values: str) -> HistogramSeries:
        series = self._series.get(values)
        if series is None:
            assert self.buckets is not None
            series = self._series[values] = HistogramSeries(self.buckets)
        assert isinstance(series, HistogramSeries)
        return series

    def collect(self) -> Metric:
        """The family as prometheus_client writes it, from a copy of every series."""
        series = list(self._series.items())  # one step under the GIL: the loop may add series
        if self.buckets is None:
            counter = CounterMetricFamily(self.name, self.help, labels=self.labels)
            for values, one in series:
                assert isinstance(one, CounterSeries)
                counter.add_metric(values, one.value)
            return counter
        histogram = HistogramMetricFamily(self.name, self.help, labels=self.labels)
        bounds = [*(_le(b) for b in self.buckets), "+Inf"]
        for values, one in series:
            assert isinstance(one, HistogramSeries)
            counts, total = list(one.counts), one.total
            cumulative, running = [], 0
            for bound, count in zip(bounds, counts, strict=True):
                running += count
                cumulative.append((bound, float(running)))
            histogram.add_metric(values, cumulative, total)
        return histogram

    def write_text(self, out: list[str]) -> None:
        """Appends the family in Prometheus text format 0.0.4, byte for byte as prometheus_client's
        generate_latest writes `collect()` (a test compares), without building its Metric objects:
        a scrape costs ~1/5 as much (callgrind), and a scrape's instructions are the server's too."""
        out.append(self._header)
        series = list(self._series.items())  # one step under the GIL: the loop may add series
        if self.buckets is None:
            for values, one in series:
                assert isinstance(one, CounterSeries)
                out.append(f"{self._prefixes(values)[0]}{_value_text(one.value)}\n")
            return
        for values, one in series:
            assert isinstance(one, HistogramSeries)
            prefixes = self._prefixes(values)  # a bucket's each, then _count's and _sum's
            counts, total = list(one.counts), one.total
            running = 0
            for prefix, count in zip(prefixes, counts, strict=False):
                running += count
                out.append(f"{prefix}{_value_text(running)}\n")
            out.append(f"{prefixes[-2]}{_value_text(running)}\n")
            out.append(f"{prefixes[-1]}{_value_text(total)}\n")

    def _prefixes(self, values: tuple[str, ...]) -> list[str]:
        """What precedes the value on each of a series' lines (made once per series)."""
        found = self._text_prefixes.get(values)
        if found is not None:
            return found
        pairs = list(zip(self.labels, values, strict=True))
        if self.buckets is None:
            found = [f"{self.name}_total{_label_text(pairs)} "]
        else:
            found = [
                f"{self.name}_bucket{_label_text([*pairs, ('le', le)])} "
                for le in (*(_le(b) for b in self.buckets), "+Inf")
            ]
            found += [f"{self.name}_count{_label_text(pairs)} ", f"{self.name}_sum{_label_text(pairs)} "]
        self._text_prefixes[values] = found
        return found


def _label_text(pairs: list[tuple[str, str]]) -> str:
    """`{name="value",...}` as prometheus_client writes labels: sorted by name, values escaped."""
    if not pairs:
        return ""
    return "{" + ",".join(f'{name}="{_escaped(value)}"' for name, value in sorted(pairs)) + "}"


def _escaped(value: str) -> str:
    """A label value with backslash, newline and double quote escaped (the text format's rule)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _le(bound: float) -> str:
    return repr(float(bound))


class _RequestSeries:
    """The series one (model, operation, caller) touches, looked up together."""

    __slots__ = ("input_usage", "output_usage", "tpot", "ttft")

    def __init__(self, metrics: Metrics, key: tuple[str, str, str]) -> None:
        self.ttft = metrics.time_to_first_token.histogram(*key)
        self.tpot = metrics.time_per_output_token.histogram(*key)
        self.input_usage = metrics.token_usage.histogram(*key, "input")
        self.output_usage = metrics.token_usage.histogram(*key, "output")


class _CallerSeries:
    """The token counters of one (model, caller)."""

    __slots__ = ("cached", "input", "output")

    def __init__(self, metrics: Metrics, model: str, caller: str) -> None:
        self.input = metrics.tokens.counter(model, caller, "input")
        self.output = metrics.tokens.counter(model, caller, "output")
        self.cached = metrics.tokens.counter(model, caller, "cached")


class _SucceededSeries:
    """Every series a successful request of one (model, operation, caller) adds to, found with
    one lookup and held directly (the common case: one dict lookup per request instead of six)."""

    __slots__ = (
        "cached_tokens", "duration", "input_tokens", "input_usage", "output_tokens", "output_usage",
        "price", "requests", "tpot", "ttft",
    )  # fmt: skip

    def __init__(self, metrics: Metrics, key: tuple[str, str, str]) -> None:
        model, _, caller = key
        self.duration = metrics.request_duration.histogram(*key, "")
        self.requests = metrics.requests.counter(model, caller, "OK")
        series = metrics._request_series(key)
        self.ttft, self.tpot = series.ttft, series.tpot
        self.input_usage, self.output_usage = series.input_usage, series.output_usage
        tokens = metrics._caller_series(model, caller)
        self.input_tokens, self.output_tokens, self.cached_tokens = tokens.input, tokens.output, tokens.cached
        self.price = metrics.prices.get(model)


# The token-usage bucket of each count up to TOKEN_INDEXED: bisect_left's answer, looked up
# (a dict subscript costs ~100 instructions, bisect_left ~1,200; two a request).
TOKEN_INDEXED = 4096
_TOKEN_BUCKET_OF = {count: bisect_left(TOKEN_BUCKETS, count) for count in range(TOKEN_INDEXED + 1)}


class Metrics:
    """One server's recorded families and the observer that records into them (a collector of
    its registry)."""

    def __init__(
        self, registry: CollectorRegistry | None = None, prices: Mapping[str, ModelPrice] | None = None
    ) -> None:
        self.prices = dict(prices or {})
        self.request_duration = Family(
            "gen_ai_server_request_duration_seconds",
            "Time from a request's arrival to its end (GenAI semconv gen_ai.server.request.duration); "
            "error_type is the gRPC code of a request that failed, empty when it succeeded.",
            [*GENAI, "error_type"],
            DURATION_BUCKETS,
        )
        self.time_to_first_token = Family(
            "gen_ai_server_time_to_first_token_seconds",
            "Streams: time from the request's arrival to its first generated text.",
            GENAI,
            TTFT_BUCKETS,
        )
        self.time_per_output_token = Family(
            "gen_ai_server_time_per_output_token_seconds",
            "Time per output token after the first, per generation of a successful request.",
            GENAI,
            TPOT_BUCKETS,
        )
        self.token_usage = Family(
            "gen_ai_client_token_usage_tokens",
            "Tokens per successful request, by gen_ai_token_type (input, output).",
            [*GENAI, TOKEN_TYPE],
            TOKEN_BUCKETS,
        )
        self.requests = Family(
            "gengate_requests",
            "Requests by the gRPC code they ended with (model empty: a name that is not served).",
            ["model", "caller", "code"],
        )
        self.tokens = Family(
            "gengate_tokens",
            "Tokens of successful requests: input, output, and cached (input tokens served from a "
            "prompt cache, also counted as input).",
            ["model", "caller", "type"],
        )
        self.cost = Family(
            "gengate_cost",
            "What successful requests cost by server.metrics.prices (per million input, cached "
            "input and output tokens; in the prices' currency): models with a price only.",
            ["model", "caller"],
        )
        self.structured = Family(
            "gengate_structured_requests",
            "Requests for structured output, by constraint kind and the enforcement that served it.",
            ["model", "kind", "enforcement"],
        )
        self.validation_failures = Family(
            "gengate_validation_failures",
            "Requests refused because a structured output did not validate (ABORTED "
            "VALIDATION_FAILED, INTERNAL CONSTRAINT_VIOLATED).",
            ["model", "kind", "enforcement"],
        )
        self.validation_retries = Family(
            "gengate_validation_retries",
            "Generations tried again because they did not validate: re-sampled by a local engine "
            "(method resample) or re-asked of a provider with the error (method reask).",
            ["model", "kind", "method"],
        )
        self.compile_cache = Family(
            "gengate_constraint_compile_cache",
            "Constraint compiles of the engines' compile caches: hit (cached or being compiled for "
            "another call) or miss (compiled for this call).",
            ["model", "result"],
        )
        self.compile_time = Family(
            "gengate_constraint_compile_duration_seconds",
            "How long an engine took to lower and compile a constraint it did not have cached.",
            ["model"],
            COMPILE_BUCKETS,
        )
        self.provider_retries = Family(
            "gengate_provider_retries",
            "Provider calls retried, by the reason of the error that was retried.",
            ["model", "reason"],
        )
        self.upstream = Family(
            "gengate_upstream_responses",
            "Provider attempts by their answer: ok, the HTTP status of an error, or timeout, "
            "unreachable, bad_response when there was none.",
            ["model", "status"],
        )
        self.families = [
            self.request_duration, self.time_to_first_token, self.time_per_output_token, self.token_usage,
            self.requests, self.tokens, self.cost, self.structured, self.validation_failures,
            self.validation_retries, self.compile_cache, self.compile_time, self.provider_retries,
            self.upstream,
        ]  # fmt: skip
        self._requests: dict[tuple[str, str, str], _RequestSeries] = {}
        self._durations: dict[tuple[str, str, str, str], HistogramSeries] = {}
        self._callers: dict[tuple[str, str], _CallerSeries] = {}
        self._succeeded: dict[tuple[str, str, str], _SucceededSeries] = {}
        if registry is not None:
            registry.register(self)

    def describe(self) -> list[Metric]:
        """The families, empty (read once, at registration): the names a scrape's `name[]`
        selection finds this collector by."""
        return [family.collect() for family in self.families]

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield family.collect()

    def text(self) -> str:
        """Every family in Prometheus text format 0.0.4, as generate_latest writes `collect()`."""
        out: list[str] = []
        for family in self.families:
            family.write_text(out)
        return "".join(out)

    # --- RequestObserver ------------------------------------------------------------------

    def _request_series(self, key: tuple[str, str, str]) -> _RequestSeries:
        series = self._requests.get(key)
        if series is None:
            series = self._requests[key] = _RequestSeries(self, key)
        return series

    def _caller_series(self, model: str, caller: str) -> _CallerSeries:
        counters = self._callers.get((model, caller))
        if counters is None:
            counters = self._callers[(model, caller)] = _CallerSeries(self, model, caller)
        return counters

    def request_done(self, outcome: RequestOutcome) -> None:
        model, caller, code = outcome.model, outcome.caller, outcome.code
        if code == "OK":
            self.succeeded(
                outcome.operation, model, caller, outcome.duration_s, outcome.input_tokens,
                outcome.output_tokens, outcome.cached_input_tokens, outcome.time_per_output_token_s,
                outcome.constraint_kind, outcome.enforcement, outcome.time_to_first_token_s,
            )  # fmt: skip
            return
        key = (model, outcome.operation, caller)
        if outcome.constraint_kind is not None:
            labels = (model, outcome.constraint_kind, outcome.enforcement or "none")
            self.structured.counter(*labels).inc()
            if outcome.validation_failed:
                self.validation_failures.counter(*labels).inc()
        duration = self._durations.get((*key, code))
        if duration is None:
            duration = self._durations[(*key, code)] = self.request_duration.histogram(*key, code)
        duration.observe(outcome.duration_s)
        self.requests.counter(model, caller, code).inc()
        if outcome.time_to_first_token_s is not None or outcome.time_per_output_token_s:
            self._observe_timings(self._request_series(key), outcome)

    def succeeded(
        self,
        operation: str,
        model: str,
        caller: str,
        duration_s: float,
        input_tokens: int,
        output_tokens: int,
        cached_input_tokens: int,
        time_per_output_token_s: tuple[float, ...],
        constraint_kind: str | None,
        enforcement: str | None,
        time_to_first_token_s: float | None = None,
    ) -> None:
        key = (model, operation, caller)
        if constraint_kind is not None:
            self.structured.counter(model, constraint_kind, enforcement or "none").inc()
        try:
            done = self._succeeded[key]  # a subscript costs less than .get()
        except KeyError:
            done = self._succeeded[key] = _SucceededSeries(self, key)
        # Once per successful request: the series' fields are updated here directly, without a
        # method call each (what .inc() and .observe() do, spelled out).
        duration = done.duration
        duration.counts[bisect_left(duration.bounds, duration_s)] += 1
        duration.total += duration_s
        done.requests.value += 1
        if time_to_first_token_s is not None:
            done.ttft.observe(time_to_first_token_s)
        if time_per_output_token_s:
            tpot = done.tpot
            for seconds in time_per_output_token_s:
                tpot.counts[bisect_left(tpot.bounds, seconds)] += 1
                tpot.total += seconds
        usage = done.input_usage
        try:
            bucket = _TOKEN_BUCKET_OF[input_tokens]
        except KeyError:  # over TOKEN_INDEXED (or not a whole number)
            bucket = bisect_left(usage.bounds, input_tokens)
        usage.counts[bucket] += 1
        usage.total += input_tokens
        usage = done.output_usage
        try:
            bucket = _TOKEN_BUCKET_OF[output_tokens]
        except KeyError:  # over TOKEN_INDEXED (or not a whole number)
            bucket = bisect_left(usage.bounds, output_tokens)
        usage.counts[bucket] += 1
        usage.total += output_tokens
        done.input_tokens.value += input_tokens
        done.output_tokens.value += output_tokens
        if cached_input_tokens:
            done.cached_tokens.value += cached_input_tokens
        if done.price is not None:
            cost = done.price.cost(input_tokens, output_tokens, cached_input_tokens)
            self.cost.counter(model, caller).inc(cost)

    @staticmethod
    def _observe_timings(series: _RequestSeries, outcome: RequestOutcome) -> None:
        if outcome.time_to_first_token_s is not None:
            series.ttft.observe(outcome.time_to_first_token_s)
        for seconds in outcome.time_per_output_token_s:
            series.tpot.observe(seconds)

    # --- RouteObserver --------------------------------------------------------------------

    def routed(self, model: str, request: GenerationRequest, notes: CallNotes) -> None:
        if not notes.noted:
            return
        structured = request.structured_output
        kind = structured.constraint.kind._value_ if structured is not None else "none"
        for method, count in notes.validation_retries.items():
            self.validation_retries.counter(model, kind, method).inc(count)
        if notes.compile_hits:
            self.compile_cache.counter(model, "hit").inc(notes.compile_hits)
        if notes.compile_misses:
            self.compile_cache.counter(model, "miss").inc(notes.compile_misses)
        for seconds in notes.compile_s:
            self.compile_time.histogram(model).observe(seconds)
        for reason, count in notes.provider_retries.items():
            self.provider_retries.counter(model, reason).inc(count)
        for status, count in notes.upstream.items():
            self.upstream.counter(model, status).inc(count)
