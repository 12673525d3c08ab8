"""Logging for the server and its workers: one configuration (`configure_logging`), text or one
JSON object per line, and the request every line is about (request id, model, caller) added from
context, so a line logged anywhere while a call is served names it. Upstream SDKs' per-request
HTTP lines (httpx) are DEBUG, not INFO."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Literal

from gengate.caller import ANONYMOUS, current_caller

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Libraries that log one INFO line per upstream HTTP call: DEBUG only. The openai and anthropic
# SDKs send through httpx2 (and httpcore2); cohere, TGI's and others through httpx.
CHATTY_HTTP_LOGGERS = ("httpx", "httpcore", "httpx2", "httpcore2")

_request: ContextVar[tuple[str, str] | None] = ContextVar("gengate_log_request", default=None)
_format: LogFormat = "text"
# The attribute an exception leaving about_request carries its request on.
_ABOUT = "_gengate_log_request"


@contextlib.contextmanager
def about_request(request_id: str | None, model: str) -> Iterator[None]:
    """Lines logged inside name this request (id and model). An exception leaving it carries the
    request with it (the innermost one), so the line that later logs it names the request too."""
    about = (request_id or "", model)
    token = _request.set(about)
    try:
        yield
    except Exception as exc:
        if getattr(exc, _ABOUT, None) is None:
            with contextlib.suppress(AttributeError, TypeError):  # an exception without a __dict__
                setattr(exc, _ABOUT, about)
        raise
    finally:
        with contextlib.suppress(ValueError):  # a stream closed from another task's context
            _request.reset(token)


def log_unexpected(logger: logging.Logger, exc: BaseException, message: str, *args: object) -> None:
    """Logs `exc`'s traceback naming the request it escaped from (see about_request), even when
    it is caught after that request's log context has closed; the context ends with the line."""
    about: tuple[str, str] | None = getattr(exc, _ABOUT, None)
    scope = about_request(*about) if about is not None else contextlib.nullcontext()
    with scope:
        logger.error(message, *args, exc_info=exc)


class RequestContext(logging.Filter):
    """Adds `request_id`, `model` and `caller` (or None) to every record, from context."""

    def filter(self, record: logging.LogRecord) -> bool:
        if hasattr(record, "request_id"):  # a worker's line, forwarded with its own
            return True
        about = _request.get()
        record.request_id, record.model = about if about is not None else (None, None)
        caller = current_caller()
        record.caller = None if caller == ANONYMOUS else caller
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message [request_id=... model=... caller=...]`."""

    def __init__(self, worker: str | None = None) -> None:
        where = f" worker[{worker}]" if worker else ""
        super().__init__(f"%(asctime)s %(levelname)s{where} %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        tags = [
            f"{key}={value}"
            for key in ("request_id", "model", "caller")
            if (value := getattr(record, key, None))
        ]
        return f"{text} [{' '.join(tags)}]" if tags else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, and the request's
    id, model and caller, the worker's name, and the exception, where there are any."""

    def __init__(self, worker: str | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "model", "caller"):
            value = getattr(record, key, None)
            if value:
                line[key] = value
        worker = getattr(record, "worker", None) or self.worker
        if worker:
            line["worker"] = worker
        # exc_text and stack_info as the redacting filter left them (secrets out, length bounded)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = record.stack_info
        return json.dumps(line, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is when a record comes (a test's capture, then the real one),
    never to a stream that was closed since configure_logging ran."""

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def configure_logging(level: str = "INFO", fmt: LogFormat = "text", *, worker: str | None = None) -> None:
    """One handler on stderr in `fmt` on the root logger (replacing the one an earlier call
    installed, leaving others alone: an embedding application's or a test runner's); records
    carry their request. Workers are configured the same way, with the server's level and format."""
    global _format
    _format = fmt
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter(worker) if fmt == "json" else TextFormatter(worker))
    handler.addFilter(RequestContext())
    root.addHandler(handler)
    root.setLevel(level)
    http_level = logging.DEBUG if root.level <= logging.DEBUG else logging.WARNING
    for name in CHATTY_HTTP_LOGGERS:
        logging.getLogger(name).setLevel(http_level)
    from gengate.redaction import install_log_redaction

    install_log_redaction()


def current_format() -> LogFormat:
    """The format configure_logging set in this process (workers inherit it)."""
    return _format


def worker_log_level() -> str:
    """A worker's level: DEBUG where the server logs DEBUG, else WARNING (engines are chatty)."""
    return "DEBUG" if logging.getLogger().getEffectiveLevel() <= logging.DEBUG else "WARNING"


def forward_worker_line(worker: str, text: str) -> bool:
    """Logs a worker's JSON log line (`--log-format json`) in the server's log at its own level,
    under `gengate.worker.<model>`, with its request, model and caller as bounded strings (a
    worker's line cannot pick the server's loggers or forge lines); False when it is not one."""
    if not text.startswith("{"):
        return False
    try:
        data = json.loads(text)
    except ValueError:
        return False
    if not isinstance(data, dict) or not isinstance(data.get("message"), str):
        return False
    level = logging.getLevelName(str(data.get("level", "")))
    if not isinstance(level, int):
        return False
    fields = {key: _field(data.get(key)) for key in ("request_id", "model", "caller")}
    message = f"{_field(data.get('logger'), 200) or '?'}: {data['message']}"
    if data.get("exception"):
        message += f"\n{data['exception']}"
    logging.getLogger(f"gengate.worker.{worker}").log(
        level, "%s", message.replace("\r", "\\r").replace("\n", "\n  "), extra={**fields, "worker": worker}
    )
    return True


def _field(value: object, limit: int = 128) -> str | None:
    """A worker-given field as one bounded line of text (None when absent)."""
    if value is None or value == "":
        return None
    return " ".join(str(value).split())[:limit]
