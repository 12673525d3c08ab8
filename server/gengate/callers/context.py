"""The caller a call is served for, as the layers below the api see it.

The api sets it once per authenticated call (api/auth.py), in the handler's own context, so the
servicer, the core, the router's queues and every task they start see it; gengate.caller holds
the name (what metrics, spans and logs read), this module the caller's whole policy (what
admission and the queues read).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from gengate.caller import reset_caller, set_caller
from gengate.callers.identity import Caller

_policy: ContextVar[Caller | None] = ContextVar("gengate_caller_policy", default=None)


def current_policy() -> Caller | None:
    """The caller of the running call; None when authentication is off or outside a call
    (batch-job items run for no caller)."""
    return _policy.get()


def current_priority() -> int:
    """The running call's queue priority (0 without a caller)."""
    policy = _policy.get()
    return 0 if policy is None else policy.priority


def enter(caller: Caller) -> None:
    """Makes `caller` the current caller of this context, for the rest of it (a call's handler
    runs in its own context: nothing leaks to other calls)."""
    _policy.set(caller)
    set_caller(caller.name)


@contextmanager
def serving(caller: Caller | None) -> Iterator[None]:
    """`caller` is the current caller inside the block (tests, embedding code)."""
    policy_token = _policy.set(caller)
    name_token = set_caller(caller.name) if caller is not None else None
    try:
        yield
    finally:
        if name_token is not None:
            reset_caller(name_token)
        _policy.reset(policy_token)
