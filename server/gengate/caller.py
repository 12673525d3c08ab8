"""The caller a request is served for (README "Callers"): set once per call where the call is
authenticated, read by admission and the queues (its policy), and by metrics, spans and logs
(its name: never a token, only the caller's configured name)."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from gengate.callers.identity import Caller

ANONYMOUS = "anonymous"  # no caller configured, or authentication off

# One variable for the whole caller: a call sets it once (each set costs ~1k instructions).
_current: ContextVar[Caller | None] = ContextVar("gengate_caller", default=None)

# The variable's own methods, not wrappers: read on every call, and a Python frame costs more
# than the lookup (~430 instructions; callgrind).
# The caller of the running call (a batch-job item's: its job's owner); None when authentication
# is off or outside a call.
current_policy = cast("Callable[[], Caller | None]", _current.get)
set_current = _current.set  # makes a caller current in this context (undo: reset_current)
reset_current = _current.reset


def current_caller() -> str:
    """The name of the caller the running call serves (ANONYMOUS without one)."""
    caller = _current.get()
    return ANONYMOUS if caller is None else caller.name
