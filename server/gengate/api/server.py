"""Builds and runs the grpc.aio server: GenerationService, health, reflection, tracing, metrics."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from gengate_proto.v1 import generation_pb2, jobs_pb2, jobs_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gengate import compiled
from gengate.api.auth import CallerInterceptor
from gengate.api.drain import Drain
from gengate.api.health import GuardedHealthServicer
from gengate.api.jobs import BatchJobServicer, ItemCodec
from gengate.api.servicer import GenerationServicer, add_guarded, add_to_server
from gengate.api.tracing import tracing_interceptor
from gengate.backend import ReportsHealth
from gengate.callers.context import serving_owner
from gengate.callers.identity import CallerDirectory
from gengate.callers.limits import Admission
from gengate.callers.shared import RedisLimits, open_state
from gengate.config import ServerConfig, ServerSettings
from gengate.errors import ConfigError
from gengate.jobs.runner import JobRunner, RunnerSettings
from gengate.jobs.store import JobStore, open_store
from gengate.metrics import ServerMetrics, start_metrics
from gengate.redaction import install_log_redaction
from gengate.router import Router, Slots
from gengate.service import GenerationCore
from gengate.telemetry import configure_tracing

log = logging.getLogger("gengate")

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
JOBS_SERVICE_NAME = jobs_pb2.DESCRIPTOR.services_by_name["BatchJobService"].full_name


# Health of the shared quota state (server.state): NOT_SERVING while Redis is lost. Open, like
# overall health: it tells no caller anything about models.
LIMITS_HEALTH_NAME = "gengate.limits"


def model_health_name(model: str) -> str:
    """Health-check service name of one model: clients may watch a single model's state."""
    return f"{SERVICE_NAME}/{model}"


@dataclass
class RunningServer:
    """A started server: its bound port and how to stop it."""

    server: grpc.aio.Server
    router: Router
    health: health.aio.HealthServicer
    host: str
    port: int
    core: GenerationCore | None = None
    jobs: JobRunner | None = None
    job_store: JobStore | None = None
    drain_state: Drain = field(default_factory=Drain)
    callers: CallerDirectory | None = None
    metrics: ServerMetrics | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def drain(self, timeout_s: float, interrupt: asyncio.Event | None = None) -> bool:
        """Health goes NOT_SERVING (overall, the service, every model) and new calls are refused
        (UNAVAILABLE, DRAINING) at once; then waits for the calls in flight, streams included,
        at most `timeout_s` (or until `interrupt` is set). True when every call finished."""
        self.drain_state.start()
        await self.health.enter_graceful_shutdown()
        if self.jobs is not None:  # job items in flight go back to the store for other replicas
            jobs, self.jobs = self.jobs, None
            await jobs.aclose()
        log.info("draining: %d call(s) in flight", self.drain_state.in_flight)
        finished = await self.drain_state.wait(timeout_s, interrupt)
        if finished:
            log.info("drained: every call finished")
        else:
            log.warning("drain: %d call(s) still in flight; they are cancelled", self.drain_state.in_flight)
        return finished

    @property
    def metrics_address(self) -> str | None:
        """HOST:PORT of the Prometheus endpoint (`server.metrics.port`), or None when off."""
        return None if self.metrics is None else self.metrics.address

    async def stop(self, grace: float = 5.0) -> None:
        """Stops taking calls, lets in-flight ones finish for `grace` seconds, closes backends."""
        self.drain_state.start()
        await self.health.enter_graceful_shutdown()
        if self.jobs is not None:  # first: items in flight go back to the store unfinished
            await self.jobs.aclose()
        await self.server.stop(grace)
        if self.job_store is not None:
            await self.job_store.close()
        await self.router.close_all()
        if self.core is not None:
            await self.core.aclose()
        if self.metrics is not None:  # last: OTLP sends the final counts
            await asyncio.to_thread(self.metrics.close)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def _interceptors(interceptor: CallerInterceptor) -> list[grpc.aio.ServerInterceptor]:
    """Tracing first (so refused calls are traced too, and the caller goes on the RPC span),
    then drain and caller authentication."""
    chain: list[grpc.aio.ServerInterceptor] = []
    tracing = tracing_interceptor()
    if tracing is not None:
        chain.append(tracing)
    interceptor.spans = tracing is not None
    chain.append(interceptor)
    return chain


def _connection_age_options(settings: ServerSettings) -> list[tuple[str, int]]:
    if settings.max_connection_age_s is None:
        return []
    age_ms = int(settings.max_connection_age_s * 1000)
    return [("grpc.max_connection_age_ms", age_ms), ("grpc.max_connection_age_grace_ms", 30_000)]


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"server.{what}: cannot read {path}: {exc.strerror}") from exc


def _server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured PEM files (mTLS when a client CA is given)."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    chain = _read(settings.tls_cert_file, "tls_cert_file")
    key = _read(settings.tls_key_file, "tls_key_file")
    client_ca = (
        _read(settings.tls_client_ca_file, "tls_client_ca_file") if settings.tls_client_ca_file else None
    )
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


async def start_server(
    config: ServerConfig, *, host: str | None = None, port: int | None = None
) -> RunningServer:
    """Loads every configured model, then binds and starts serving. Port 0 picks a free port."""
    configure_tracing()
    install_log_redaction()  # on the handlers logging has by now (`gengate serve`: basicConfig's)
    settings = config.server
    host = host or settings.host
    port = settings.port if port is None else port
    # Configuration errors (a token variable not set, two callers with one token) surface
    # before models load.
    directory = CallerDirectory.from_config(config.callers, legacy_tokens_env=settings.auth_tokens_env)
    drain = Drain()
    interceptors = _interceptors(CallerInterceptor(directory, drain))
    credentials = _server_credentials(settings)
    metrics = start_metrics(settings.metrics, host)  # a metrics port in use fails before models load
    try:
        return await _start(config, host, port, interceptors, credentials, directory, drain, metrics)
    except BaseException:
        if metrics is not None:
            metrics.close()
        raise


async def _start(
    config: ServerConfig,
    host: str,
    port: int,
    interceptors: list[grpc.aio.ServerInterceptor],
    credentials: grpc.ServerCredentials | None,
    directory: CallerDirectory | None,
    drain: Drain,
    metrics: ServerMetrics | None,
) -> RunningServer:
    from gengate.workers.factory import with_cpu_thread_shares

    settings = config.server
    job_store = open_store(settings.jobs.store, Path(settings.jobs.data_dir).expanduser())
    await job_store.open()  # a store that cannot be opened stops the start, in one line
    observer = None if metrics is None else metrics.metrics
    router = Router.from_config(with_cpu_thread_shares(config), observer=observer)
    try:
        await router.start_all()
    except BaseException:
        await router.close_all()  # the models that did start (worker processes) go too
        await job_store.close()
        raise
    max_bytes = settings.max_message_mb * 1024 * 1024
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes),
            ("grpc.so_reuseport", 0),
            *_connection_age_options(settings),
        ],
    )
    state = open_state(settings.state, fail_closed=settings.state_fail_closed, lease_s=settings.state_lease_s)
    core = GenerationCore(
        router,
        max_batch_items=settings.max_batch_items,
        limits=settings.limits,
        admission=Admission(state),
        observer=observer,
    )
    try:
        await core.warm_constraints()
    except BaseException:  # a warm constraint the checks refuse stops the start, like a bad config
        await core.aclose()
        await router.close_all()
        await job_store.close()
        raise
    servicer = GenerationServicer(core, default_timeout_s=settings.request_timeout_s)
    add_to_server(servicer, server)
    for route in router.routes:  # job items leave room for interactive calls on every model
        if isinstance(route.slots, Slots):
            route.slots.idle_background = settings.jobs.per_model_concurrency
            route.slots.busy_background = settings.jobs.busy_per_model_concurrency
            route.slots.quiet_s = settings.jobs.quiet_s
            route.slots.aging_s = settings.priority_aging_s
    codec = ItemCodec(settings.limits.max_constraint_bytes)
    jobs = settings.jobs
    runner = JobRunner(
        job_store,
        lambda request: core.generate(request, queue_bounded=False, background=True, operation="batch_job"),
        codec,
        RunnerSettings(
            concurrency=jobs.concurrency,
            lease_s=jobs.lease_s,
            poll_s=jobs.poll_s,
            offline_poll_s=jobs.offline_poll_s,
        ),
        offline=core,
        as_owner=functools.partial(serving_owner, directory),
    )
    add_guarded(server, jobs_pb2_grpc.add_BatchJobServiceServicer_to_server,
                BatchJobServicer(job_store, runner, codec, jobs),
                jobs_pb2.DESCRIPTOR.services_by_name["BatchJobService"].full_name)  # fmt: skip
    # Overall and service health stay open for probes; a single model's needs the caller token.
    health_servicer = GuardedHealthServicer(
        directory, open_names=("", SERVICE_NAME, LIMITS_HEALTH_NAME), model_prefix=model_health_name("")
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            JOBS_SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = (
            server.add_insecure_port(address)
            if credentials is None
            else server.add_secure_port(address, credentials)
        )
    except RuntimeError:  # grpc raises instead of returning 0 for some bind failures
        bound = 0
    if bound == 0:
        await router.close_all()
        await core.aclose()
        await job_store.close()
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    await runner.start()
    if metrics is not None:
        metrics.attach(router, core, runner)
    serving = health_pb2.HealthCheckResponse.SERVING
    await health_servicer.set("", serving)
    await health_servicer.set(SERVICE_NAME, serving)
    for route in router.routes:
        await health_servicer.set(model_health_name(route.name), serving)
        _watch_model_health(route.backend, route.name, health_servicer)
    if isinstance(state, RedisLimits):
        await _watch_shared_state(state, health_servicer)
    return RunningServer(
        server=server,
        router=router,
        health=health_servicer,
        host=host,
        port=bound,
        core=core,
        jobs=runner,
        job_store=job_store,
        drain_state=drain,
        callers=directory,
        metrics=metrics,
    )


def _watch_model_health(backend: object, name: str, servicer: health.aio.HealthServicer) -> None:
    """Backends that can go down (worker processes) report it; health follows per model."""
    if not isinstance(backend, ReportsHealth):
        return
    loop = asyncio.get_running_loop()

    def changed(serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(servicer.set(model_health_name(name), status))
        )

    backend.add_serving_listener(changed)


async def _watch_shared_state(state: RedisLimits, servicer: health.aio.HealthServicer) -> None:
    """`gengate.limits` follows whether the shared quota state answers (checked at start, then
    by every call that uses it)."""
    loop = asyncio.get_running_loop()

    def changed(shared: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if shared else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        loop.call_soon(lambda: asyncio.ensure_future(servicer.set(LIMITS_HEALTH_NAME, status)))

    state.on_change = changed
    shared = await state.ping()
    status = health_pb2.HealthCheckResponse.SERVING if shared else health_pb2.HealthCheckResponse.NOT_SERVING
    await servicer.set(LIMITS_HEALTH_NAME, status)
    log.info("limits: callers' per-minute windows %s", state.status())


def serve(config: ServerConfig, host: str | None = None, port: int | None = None) -> None:
    """Runs the server until SIGINT/SIGTERM (the `gengate serve` command), then drains: health
    NOT_SERVING and new calls refused at once, calls in flight given server.drain_timeout_s to
    finish (a second signal ends the wait), then workers stop and this returns (exit 0)."""

    async def main() -> None:
        stop = asyncio.Event()
        again = asyncio.Event()
        loop = asyncio.get_running_loop()

        def signalled() -> None:
            (again if stop.is_set() else stop).set()

        for sig in (signal.SIGINT, signal.SIGTERM):  # before "serving" is printed: no gap for SIGTERM
            loop.add_signal_handler(sig, signalled)
        running = await start_server(config, host=host, port=port)
        names = ", ".join(r.name for r in running.router.routes)
        log.info(
            "gengate serving on %s (models: %s); hot paths %s", running.address, names, compiled.status()
        )
        print(f"gengate serving on {running.address} (models: {names})", flush=True)
        if running.metrics_address is not None:  # after the line scripts wait for
            print(f"gengate metrics on http://{running.metrics_address}/metrics", flush=True)
        await stop.wait()
        log.info("shutting down: draining for at most %gs", config.server.drain_timeout_s)
        await running.drain(config.server.drain_timeout_s, again)
        await running.stop(grace=_STOP_GRACE_S)
        log.info("stopped")
        provider = configure_tracing()  # the one installed at start, if any: flush its spans
        if provider is not None:
            provider.shutdown()

    asyncio.run(main())


# After the drain, how long grpc is given to send the last replies before it cancels what is left.
_STOP_GRACE_S = 1.0
