"""Client retries through gRPC's own retry (gRFC A6), configured as a channel service config.

gRPC then retries what the policy allows: it waits the server's `grpc-retry-pushback-ms` (gengate
sends its RetryInfo delay there, and -1 — no retry — when the delay is past its cap or the caller's
deadline), else an exponential backoff with jitter; the deadline covers all attempts; a stream is
retried only before its first message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

# gRPC caps a call's attempts at 5 (gRFC A6), so at most 4 retries.
MAX_RETRIES = 4

# What is retried: every generation call; of the job calls, only those that change nothing or
# change it the same way twice (creating or uploading a job is never retried).
_RETRIED_METHODS: tuple[dict[str, str], ...] = (
    {"service": "gengate.v1.GenerationService"},
    {"service": "gengate.v1.BatchJobService", "method": "GetBatchJob"},
    {"service": "gengate.v1.BatchJobService", "method": "ListBatchJobs"},
    {"service": "gengate.v1.BatchJobService", "method": "CancelBatchJob"},
    {"service": "gengate.v1.BatchJobService", "method": "StreamBatchJobResults"},
)


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries a call the server refused for now (UNAVAILABLE, RESOURCE_EXHAUSTED).

    `max_retries` retries after the first attempt (0: none; at most 4). Between attempts it waits
    the server's pushback when sent, else a random time up to `initial_backoff_s` growing by
    `backoff_multiplier` to `max_backoff_s`.
    """

    max_retries: int = 2
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    backoff_multiplier: float = 2.0
    retryable_codes: tuple[str, ...] = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")

    def __post_init__(self) -> None:
        if not 0 <= self.max_retries <= MAX_RETRIES:
            raise ValueError(f"max_retries must be 0..{MAX_RETRIES} (gRPC makes at most 5 attempts)")
        if self.initial_backoff_s <= 0 or self.max_backoff_s <= 0 or self.backoff_multiplier <= 0:
            raise ValueError("backoffs and backoff_multiplier must be > 0")
        if not self.retryable_codes:
            raise ValueError("retryable_codes must name at least one status code (or set max_retries=0)")

    def service_config(self) -> str | None:
        """The service config JSON that makes gRPC retry this way (None: no retries)."""
        if self.max_retries == 0:
            return None
        policy = {
            "maxAttempts": self.max_retries + 1,
            "initialBackoff": f"{self.initial_backoff_s}s",
            "maxBackoff": f"{self.max_backoff_s}s",
            "backoffMultiplier": self.backoff_multiplier,
            "retryableStatusCodes": [code.upper() for code in self.retryable_codes],
        }
        return json.dumps({"methodConfig": [{"name": list(_RETRIED_METHODS), "retryPolicy": policy}]})


DEFAULT_RETRY = RetryPolicy()


def retry_policy(retry: RetryPolicy | None, max_retries: int | None) -> RetryPolicy:
    """The policy a client uses: `retry` (default DEFAULT_RETRY) with `max_retries` if given."""
    policy = retry or DEFAULT_RETRY
    return policy if max_retries is None else replace(policy, max_retries=max_retries)


def channel_options(options: Sequence[tuple[str, Any]] | None, policy: RetryPolicy) -> list[tuple[str, Any]]:
    """`options` with the policy's service config, unless the caller set one of its own."""
    merged = list(options or ())
    config = policy.service_config()
    if config is not None and not any(name == "grpc.service_config" for name, _ in merged):
        merged += [("grpc.service_config", config), ("grpc.enable_retries", 1)]
    return merged
