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
from gengate.callers.identity import Caller, CallerDirectory
from gengate.errors import PermissionDenied

# A batch job's owner who is no longer configured: its items still to run fail with this.
JOB_OWNER_UNKNOWN = "JOB_OWNER_UNKNOWN"

_policy: ContextVar[Caller | None] = ContextVar("gengate_caller_policy", default=None)


# The caller of the running call (a batch-job item's: its job's owner); None when authentication
# is off or outside a call. The variable's own method: a wrapper's frame costs more than the lookup.
current_policy = _policy.get


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


@contextmanager
def serving_owner(directory: CallerDirectory | None, owner: str) -> Iterator[None]:
    """A batch-job item runs as `owner`, the caller who created the job: its metrics, logs and
    spans name it, and its models are checked (quotas are not charged: the core admits
    background calls without them). No callers configured, or a job from before jobs had
    owners (""): no caller, as before. PermissionDenied when `owner` is no longer configured."""
    if directory is None or not owner:
        yield
        return
    caller = directory.by_name(owner)
    if caller is None:
        raise PermissionDenied(
            f"the batch job's owner {owner!r} is no longer a configured caller",
            reason=JOB_OWNER_UNKNOWN,
            metadata={"caller": owner},
        )
    with serving(caller):
        yield
