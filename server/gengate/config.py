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
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gengate.callers.config import CallerConfig, parse_callers
from gengate.errors import ConfigError
from gengate.limits import RequestLimits
from gengate.registry import backend_class

PositiveInt = Annotated[int, Field(strict=True, gt=0)]


class CommonModelKeys(BaseModel):
    """Keys every model entry may have, whatever its backend (the rest are the backend's options)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(min_length=1, description="The model name callers ask for.")
    backend: str = Field(min_length=1, description="The backend kind (llamacpp, openai, scripted, ...).")
    max_concurrency: PositiveInt = Field(default=64, description="Requests in flight at once.")
    max_queue: PositiveInt = Field(default=1024, description="Requests waiting for a slot before QUEUE_FULL.")
    isolation: Literal["process", "inline"] | None = Field(
        default=None, description="Local engines: own worker process (default) or in the server process."
    )
    devices: Literal["auto", "cpu"] | list[Annotated[int, Field(strict=True, ge=0)]] | None = Field(
        default=None, description="GPUs: auto, cpu (none), or a list of distinct NVML indices."
    )
    num_gpus: PositiveInt | None = Field(default=None, description="How many GPUs the worker gets.")
    share_devices: bool = Field(
        default=False, strict=True, description="Let other workers use the same GPUs."
    )
    cpu_threads: PositiveInt | None = Field(
        default=None, description="Threads a CPU engine worker computes with."
    )

    @model_validator(mode="after")
    def _placement(self) -> CommonModelKeys:
        if isinstance(self.devices, list) and (
            not self.devices or len(set(self.devices)) != len(self.devices)
        ):
            raise ValueError("'devices' must be 'auto', 'cpu' or a list of distinct GPU indices")
        if self.num_gpus is not None:
            if self.devices == "cpu":
                raise ValueError("'num_gpus' does not go with 'devices: cpu'")
            if isinstance(self.devices, list) and len(self.devices) != self.num_gpus:
                raise ValueError(f"'num_gpus' is {self.num_gpus} but 'devices' lists {len(self.devices)}")
        return self


COMMON_MODEL_KEYS = frozenset(CommonModelKeys.model_fields)

# What a wrong common key is told it must be.
_COMMON_KEY_EXPECTS = {
    "name": "a non-empty string",
    "backend": "a non-empty string",
    "max_concurrency": "a positive integer",
    "max_queue": "a positive integer",
    "isolation": "'process' or 'inline'",
    "devices": "'auto', 'cpu' or a list of distinct GPU indices",
    "num_gpus": "a positive integer",
    "share_devices": "true or false",
    "cpu_threads": "a positive integer",
}


@dataclass(frozen=True)
class ModelConfig:
    """One served model: its name, backend kind, limits and validated backend options."""

    name: str
    backend: str
    options: BaseModel
    max_concurrency: int = CommonModelKeys.model_fields["max_concurrency"].default
    max_queue: int = CommonModelKeys.model_fields["max_queue"].default
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


ENV_PREFIX = "GENGATE_SERVER_"


def server_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """`GENGATE_SERVER_<KEY>` variables as `server:` keys (`__` descends: GENGATE_SERVER_METRICS__PORT
    is server.metrics.port); each value is read as a YAML scalar, so 30, true and null are typed."""
    overrides: dict[str, Any] = {}
    for variable, text in sorted(env.items()):
        if not variable.startswith(ENV_PREFIX) or variable == ENV_PREFIX:
            continue
        path = variable[len(ENV_PREFIX) :].lower().split("__")
        try:
            value = read_yaml(text) if text.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{variable}: not a valid YAML value: {exc}") from exc
        target = overrides
        for key in path[:-1]:
            target = target.setdefault(key, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{variable}: {'.'.join(path[:-1])} is set as a value by another variable")
        target[path[-1]] = value
    return overrides


def _merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        below = merged.get(key)
        merged[key] = (
            _merged(below, value) if isinstance(value, dict) and isinstance(below, Mapping) else value
        )
    return merged


def parse_with_environment(data: Any, env: Mapping[str, str], source: str) -> ServerConfig:
    """`parse_config` of `data` with the `GENGATE_SERVER_*` overrides of `env` merged into its
    `server:` section; an error in that section names the variables that took part."""
    overrides = server_overrides(env)
    if overrides and isinstance(data, Mapping):
        server = data.get("server") or {}
        if not isinstance(server, Mapping):
            raise ConfigError(f"{source}: 'server' must be a mapping")
        data = {**data, "server": _merged(server, overrides)}
    try:
        return parse_config(data, source=source)
    except ConfigError as exc:
        if overrides and f"{source}: server" in str(exc):
            names = ", ".join(sorted(k for k in env if k.startswith(ENV_PREFIX)))
            raise ConfigError(f"{exc} (server keys set from the environment: {names})") from exc
        raise


class ConfigLoader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans: only true/false. PyYAML's 1.1 rules read `on`, `off`, `yes`,
    `no` as booleans, so a fallback's `on: [UNAVAILABLE]` would become the key True."""


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def read_yaml(text: str) -> Any:
    """A config document (or an override's value) as gengate reads YAML: YAML 1.2 booleans."""
    return yaml.load(text, Loader=ConfigLoader)


def load_config(path: str | Path | None, env: Mapping[str, str] | None = None) -> ServerConfig:
    """Reads a YAML config file, or returns the embedded default when `path` is None; the
    `GENGATE_SERVER_*` variables of `env` (default: the process's) override its `server:` keys."""
    env = os.environ if env is None else env
    if path is None:
        return default_config(env)
    source = str(path)
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config: {exc.strerror}") from exc
    try:
        data = read_yaml(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    return parse_with_environment(data, env, source)


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
    common = _common_keys(raw, where)
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
    devices = common.devices
    return ModelConfig(
        name=name,
        backend=kind,
        options=options,
        max_concurrency=common.max_concurrency,
        max_queue=common.max_queue,
        isolation=common.isolation,
        devices=tuple(devices) if isinstance(devices, list) else devices,
        num_gpus=common.num_gpus,
        share_devices=common.share_devices,
        cpu_threads=common.cpu_threads,
    )


def _common_keys(raw: Mapping[str, Any], where: str) -> CommonModelKeys:
    """The entry's common keys, validated; each problem says what the key must be."""
    try:
        return CommonModelKeys.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = str(err["loc"][0]) if err["loc"] else ""
            if key in _COMMON_KEY_EXPECTS:
                problems.append(f"{key!r} must be {_COMMON_KEY_EXPECTS[key]}")
            else:  # a check across keys (_placement): its own sentence
                problems.append(str(err.get("ctx", {}).get("error", err["msg"])))
        raise ConfigError(f"{where}: {'; '.join(dict.fromkeys(problems))}") from exc


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
    return parse_with_environment({"models": entries}, env, "<default>")
