"""The caller a request is served for (README "Callers"): set once per call where the call is
authenticated, read by metrics, spans, logs and the queues. Never a token: only the caller's
configured name."""

from __future__ import annotations

from contextvars import ContextVar, Token

ANONYMOUS = "anonymous"  # no caller configured, or authentication off

_current: ContextVar[str] = ContextVar("gengate_caller", default=ANONYMOUS)


def current_caller() -> str:
    """The name of the caller the running call serves."""
    return _current.get()


def set_caller(name: str) -> Token[str]:
    """Makes `name` the current caller of this context (undo with `reset_caller`)."""
    return _current.set(name)


def reset_caller(token: Token[str]) -> None:
    _current.reset(token)
