"""The caller a request is served for (README "Callers"): set once per call where the call is
authenticated, read by metrics, spans, logs and the queues. Never a token: only the caller's
configured name."""

from __future__ import annotations

from contextvars import ContextVar

ANONYMOUS = "anonymous"  # no caller configured, or authentication off

_current: ContextVar[str] = ContextVar("gengate_caller", default=ANONYMOUS)


# The context variable's own methods, not wrappers: read on every call, and a Python frame costs
# more than the lookup (~430 instructions; callgrind).
current_caller = _current.get  # the name of the caller the running call serves
set_caller = _current.set  # makes a name the current caller of this context (undo with reset_caller)
reset_caller = _current.reset
