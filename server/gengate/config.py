"""Server configuration: one YAML file whose `models:` list says what is served and by what.

    models:
      - name: tiny
        backend: llamacpp
        tiny: true            # backend options: validated by the backend's own Options model
        max_concurrency: 4    # common keys: see ModelConfig

Unknown keys are an error at start-up, naming the file, the entry and the key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gengate.callers.config import CallerConfig, parse_callers
from gengate.errors import ConfigError
from gengate.limits import RequestLimits
from gengate.registry import backend_class

# Keys every model entry may have, whatever its backend.
COMMON_MODEL_KEYS = frozenset(
    {
        "name",
        "backend",
        "max_concurrency",
        "max_queue",
        "isolation",
        "devices",
        "num_gpus",
        "share_devices",
        "cpu_threads",
    }
)


@dataclass(frozen=True)
class ModelConfig:
    """One served model: its name, backend kind, limits and validated backend options."""

    name: str
    backend: str
    options: BaseModel
    max_concurrency: int = 64
    max_queue: int = 1024
    # Local engines: "process" (own worker process; the default for llamacpp/transformers/mlx/vllm)
    # or "inline" (in the server process). None = the kind's default (gengate.workers.factory).
    isolation: str | None = None
    # GPUs: "auto" or explicit NVML indices; "cpu" = no GPU, also for vllm (its CPU build);
    # None = none for CPU engines, auto for vllm.
    devices: str | tuple[int, ...] | None = None
    num_gpus: int | None = None
    share_devices: bool = False
    # Threads a CPU engine worker computes with (OMP_NUM_THREADS in its process); None = the
    # engine's default, or a share of the cores when several CPU workers run (workers.factory).
    cpu_threads: int | None = None


def default_data_dir() -> str:
    """Where the server keeps what must outlive it (the job store): $GENGATE_DATA_DIR, else
    ~/.local/share/gengate."""
    return os.environ.get("GENGATE_DATA_DIR") or str(Path.home() / ".local" / "share" / "gengate")


class JobSettings(BaseModel):
    """`server.jobs`: durable batch jobs (README "Batch jobs")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # sqlite:///relative.db (under data_dir), sqlite:////absolute/path.db, or postgresql://...
    store: str = "sqlite:///jobs.db"
    data_dir: str = Field(default_factory=default_data_dir)
    # Items in flight at once across this server's jobs, and the most items one job may hold.
    concurrency: int = Field(default=8, gt=0, le=100_000)
    max_items: int = Field(default=10_000_000, gt=0)
    # Job items in flight on one model while it serves no interactive call (none for
    # `quiet_s`), and while it does: by default none start then, so calls never wait behind job
    # items in the engine (README "Batch jobs": a model never quiet gives a job no time).
    per_model_concurrency: int = Field(default=16, gt=0)
    busy_per_model_concurrency: int = Field(default=0, ge=0)
    quiet_s: float = Field(default=0.5, ge=0)
    # A runner that dies leaves its items to the others after this many seconds.
    lease_s: float = Field(default=60.0, gt=0)
    poll_s: float = Field(default=1.0, gt=0)
    # How often an offline job's provider batches are polled (they take minutes to a day).
    offline_poll_s: float = Field(default=30.0, gt=0)


class ModelPrice(BaseModel):
    """What a model's tokens cost, per million (any currency: the metric is in whatever it is)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_per_million: float = Field(ge=0)
    output_per_million: float = Field(ge=0)
    # Input tokens a prompt cache served, where the provider prices them lower; None: as input.
    cached_input_per_million: float | None = Field(default=None, ge=0)

    def cost(self, input_tokens: int, output_tokens: int, cached_input_tokens: int = 0) -> float:
        """The cost of one request's tokens (cached input tokens are part of `input_tokens`)."""
        cached = min(cached_input_tokens, input_tokens)
        cached_price = self.cached_input_per_million
        if cached_price is None:
            cached_price = self.input_per_million
        return (
            (input_tokens - cached) * self.input_per_million
            + cached * cached_price
            + output_tokens * self.output_per_million
        ) / 1_000_000


class MetricsSettings(BaseModel):
    """`server.metrics`: Prometheus text exposition on an HTTP port of its own (README "Metrics")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # model name -> its price: the metrics then count gengate_cost_total{model,caller}.
    prices: dict[str, ModelPrice] = Field(default_factory=dict)

    # None: no metrics endpoint (OTLP export may still run, when configured); 0 picks a free port.
    port: int | None = Field(default=None, ge=0, le=65535)
    # None: the gRPC server's host.
    host: str | None = None


class ServerSettings(BaseModel):
    """The `server:` section: where to listen, limits, TLS and caller authentication."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=50051, ge=0, le=65535)
    max_batch_items: int = Field(default=4096, gt=0)
    # gRPC's message size limit is a signed 32-bit byte count: at most 2047 MiB.
    max_message_mb: int = Field(default=64, gt=0, le=2047)
    # Deadline applied to calls that arrive without one (seconds); None = no limit.
    request_timeout_s: float | None = Field(default=None, gt=0)
    # Close client connections after this long (with a grace period), so clients reconnect and
    # spread over replicas added by a scale-up; None keeps connections for their lifetime.
    max_connection_age_s: float | None = Field(default=None, gt=0)
    # TLS: certificate chain and key (PEM); with a client CA, callers must present certificates (mTLS).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    # Caller authentication: bearer tokens, comma-separated, read from this environment variable
    # (one caller, "default", with no quota); the top-level `callers:` list names callers.
    auth_tokens_env: str | None = None
    # SIGTERM: health goes NOT_SERVING, new calls are refused (UNAVAILABLE, DRAINING) and calls
    # in flight get this long to finish (deploy/helm: terminationGracePeriodSeconds follows it).
    drain_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    # Where callers' per-minute windows and calls in flight (max_concurrency) are counted: None =
    # this process; redis://host:port/db = shared by every replica using it (callers/shared.py).
    # A replica that loses Redis serves with local limits and says so (health `gengate.limits`),
    # or refuses calls with `state_fail_closed`.
    state: str | None = None
    state_fail_closed: bool = False
    # With `state`, each call in flight holds a lease in Redis (max_concurrency across replicas),
    # extended every third of this while it runs: a replica that dies frees its calls' slots
    # after this long.
    state_lease_s: float = Field(default=30.0, gt=0, le=3600)
    # A call waiting for a model's slot gains one priority point per this many seconds waited,
    # so a low-priority caller still progresses under a stream of higher-priority calls.
    priority_aging_s: float = Field(default=1.0, gt=0)
    # What one request may ask for, checked before any work (gengate.limits; README "Limits").
    limits: RequestLimits = Field(default_factory=RequestLimits)
    jobs: JobSettings = Field(default_factory=JobSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)

    @field_validator("state")
    @classmethod
    def _state_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be a redis://host:port/db (or rediss://, unix://) URL")
        return value

    @model_validator(mode="after")
    def _pairs(self) -> ServerSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        if self.metrics.port and self.metrics.port == self.port and self.metrics.host in (None, self.host):
            raise ValueError(f"metrics.port {self.metrics.port} is the gRPC port: give metrics its own")
        return self


@dataclass(frozen=True)
class ServerConfig:
    models: tuple[ModelConfig, ...]
    server: ServerSettings = field(default_factory=ServerSettings)
    source: str = "<default>"
    callers: tuple[CallerConfig, ...] = ()


def option_keys(options_model: type[BaseModel]) -> frozenset[str]:
    """The keys a config file writes for a backend's options: each field's alias where it has one
    (mlx's `model_config`, a name pydantic keeps for itself)."""
    return frozenset(field.alias or name for name, field in options_model.model_fields.items())


def load_config(path: str | Path | None) -> ServerConfig:
    """Reads a YAML config file, or returns the embedded default when `path` is None."""
    if path is None:
        return default_config()
    source = str(path)
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    return parse_config(data, source=source)


def parse_config(data: Any, *, source: str = "<config>") -> ServerConfig:
    """Validates a config mapping; every error names `source` and where in it."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping with a 'models' list")
    unknown = set(data) - {"models", "server", "callers"}
    if unknown:
        raise ConfigError(
            f"{source}: unknown top-level key(s) {sorted(unknown)}; expected 'models', 'server', 'callers'"
        )
    entries = data.get("models")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{source}: 'models' must be a non-empty list")
    models = tuple(_parse_model(entry, i, source) for i, entry in enumerate(entries))
    names = [m.name for m in models]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"{source}: duplicate model name(s) {duplicates}")
    _check_members(models, source)
    server = _parse_server(data.get("server") or {}, source)
    unpriced = sorted(set(server.metrics.prices) - set(names))
    if unpriced:
        raise ConfigError(f"{source}: server.metrics.prices names model(s) not configured: {unpriced}")
    callers = parse_callers(
        data.get("callers"),
        models=names,
        source=source,
        legacy_tokens=bool(server.auth_tokens_env),
        mutual_tls=server.tls_client_ca_file is not None,
    )
    return ServerConfig(models=models, server=server, source=source, callers=callers)


def _check_members(models: tuple[ModelConfig, ...], source: str) -> None:
    """Composite models (options with `members()`) may name only configured models."""
    names = {m.name for m in models}
    for index, model in enumerate(models):
        members = getattr(model.options, "members", None)
        missing = [n for n in members() if n not in names] if callable(members) else []
        if missing:
            raise ConfigError(
                f"{source}: models[{index}] ({model.name}): member(s) {missing} are not configured models "
                f"(configured: {', '.join(sorted(names))})"
            )


def _parse_server(raw: Any, source: str) -> ServerSettings:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: 'server' must be a mapping")
    try:
        return ServerSettings.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: server: {_describe(exc)}") from exc


def _describe(exc: ValidationError) -> str:
    """Pydantic errors as `key: problem; ...`, with unknown keys called unknown."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '<entry>'}: "
        + ("unknown key" if err["type"] == "extra_forbidden" else err["msg"])
        for err in exc.errors()
    )


def _parse_model(raw: Any, index: int, source: str) -> ModelConfig:
    where = f"{source}: models[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a mapping with at least 'name' and 'backend'")
    name, kind = raw.get("name"), raw.get("backend")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: 'name' is required and must be a non-empty string")
    where = f"{where} ({name})"
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"{where}: 'backend' is required")
    cls = backend_class(kind)
    options_model: type[BaseModel] = cls.Options
    backend_keys = {k: v for k, v in raw.items() if k not in COMMON_MODEL_KEYS}
    allowed = option_keys(options_model) | COMMON_MODEL_KEYS
    unknown = sorted(set(backend_keys) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} for backend {kind!r}; known: {sorted(allowed)}")
    try:
        options = options_model.model_validate(backend_keys)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<entry>'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"{where}: {problems}") from exc
    limits: dict[str, Any] = {}
    for key in ("max_concurrency", "max_queue"):
        if key in raw:
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{where}: {key!r} must be a positive integer")
            limits[key] = value
    return ModelConfig(name=name, backend=kind, options=options, **limits, **_parse_placement(raw, where))


def _parse_placement(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The isolation, GPU and CPU-thread keys of a model entry, checked."""
    out: dict[str, Any] = {}
    isolation = raw.get("isolation")
    if isolation is not None:
        if isolation not in ("process", "inline"):
            raise ConfigError(f"{where}: 'isolation' must be 'process' or 'inline'")
        out["isolation"] = isolation
    devices = raw.get("devices")
    if devices is not None:
        valid_list = isinstance(devices, list) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices
        )
        if devices not in ("auto", "cpu") and not (
            valid_list and devices and len(set(devices)) == len(devices)
        ):
            raise ConfigError(f"{where}: 'devices' must be 'auto', 'cpu' or a list of distinct GPU indices")
        out["devices"] = devices if devices in ("auto", "cpu") else tuple(devices)
    num_gpus = raw.get("num_gpus")
    if num_gpus is not None:
        if out.get("devices") == "cpu":
            raise ConfigError(f"{where}: 'num_gpus' does not go with 'devices: cpu'")
        if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus <= 0:
            raise ConfigError(f"{where}: 'num_gpus' must be a positive integer")
        if isinstance(out.get("devices"), tuple) and len(out["devices"]) != num_gpus:
            raise ConfigError(f"{where}: 'num_gpus' is {num_gpus} but 'devices' lists {len(out['devices'])}")
        out["num_gpus"] = num_gpus
    share = raw.get("share_devices", False)
    if not isinstance(share, bool):
        raise ConfigError(f"{where}: 'share_devices' must be true or false")
    out["share_devices"] = share
    threads = raw.get("cpu_threads")
    if threads is not None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads <= 0:
            raise ConfigError(f"{where}: 'cpu_threads' must be a positive integer")
        out["cpu_threads"] = threads
    return out


def default_config(env: Mapping[str, str] | None = None) -> ServerConfig:
    """The embedded default: the tiny local model on llama.cpp, plus every provider whose
    standard API-key variable is set in the environment."""
    env = os.environ if env is None else env
    entries: list[dict[str, Any]] = [{"name": "tiny", "backend": "llamacpp", "tiny": True}]
    try:
        from gengate.providers.defaults import default_provider_entries
    except ImportError:
        pass
    else:
        entries.extend(default_provider_entries(env))
    return parse_config({"models": entries}, source="<default>")
