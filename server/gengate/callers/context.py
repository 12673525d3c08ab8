"""The caller a call is served for, as the layers below the api see it.

The api sets it once per authenticated call (api/auth.py), in the call's own context, so the
servicer, the core, the router's queues and every task they start see it. The variable lives in
gengate.caller (metrics, spans and logs read the name there); this module serves the policy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gengate.caller import current_policy, reset_current, set_current
from gengate.callers.identity import Caller, CallerDirectory
from gengate.errors import PermissionDenied

# A batch job's owner who is no longer configured: its items still to run fail with this.
JOB_OWNER_UNKNOWN = "JOB_OWNER_UNKNOWN"

__all__ = ["JOB_OWNER_UNKNOWN", "current_policy", "current_priority", "serving", "serving_owner"]


def current_priority() -> int:
    """The running call's queue priority (0 without a caller)."""
    policy = current_policy()
    return 0 if policy is None else policy.priority


@contextmanager
def serving(caller: Caller | None) -> Iterator[None]:
    """`caller` is the current caller inside the block (tests, embedding code)."""
    token = set_current(caller)
    try:
        yield
    finally:
        reset_current(token)


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
