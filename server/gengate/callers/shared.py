"""Caller quotas shared by replicas: the per-minute windows in Redis (`server.state:
redis://host:port/db`), checked and charged atomically by Lua scripts on Redis's own clock, so
one requests_per_minute holds across every replica.

A replica that loses Redis keeps serving with windows in its own memory (fail-open; each
replica then allows the whole quota) and says so: a warning in the log and the health service
`gengate.limits` NOT_SERVING, until Redis answers again. With `server.state_fail_closed: true`
calls of callers with per-minute quotas are refused instead (UNAVAILABLE, LIMITS_UNAVAILABLE).
max_concurrency stays per replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from gengate.callers.limits import STEP_S, STEPS, LimitState, LocalLimits, Refusal
from gengate.errors import ConfigError, Unavailable
from gengate.redaction import register_secret

log = logging.getLogger("gengate.limits")

# How long one Redis command may take before the replica counts Redis as lost.
REDIS_TIMEOUT_S = 0.5
# While Redis is lost, one call in this many seconds tries it again.
RETRY_S = 1.0
KEY_PREFIX = "gengate:limits:"

# Windows are hashes of step -> amount; both scripts read Redis's TIME, so replicas agree.
_WINDOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local step_s = tonumber(ARGV[1])
local steps = tonumber(ARGV[2])
local step = math.floor(now / step_s)
local function window(key)
  local fields = redis.call('HGETALL', key)
  local total, buckets = 0, {}
  for i = 1, #fields, 2 do
    local s, amount = tonumber(fields[i]), tonumber(fields[i + 1])
    if s <= step - steps then
      redis.call('HDEL', key, fields[i])
    else
      total = total + amount
      buckets[#buckets + 1] = {s, amount}
    end
  end
  table.sort(buckets, function(a, b) return a[1] < b[1] end)
  return total, buckets
end
local function wait(key, limit, cost)
  local total, buckets = window(key)
  local excess = total + cost - limit
  if excess <= 0 then return 0 end
  for _, bucket in ipairs(buckets) do
    excess = excess - bucket[2]
    if excess <= 0 then return (bucket[1] + steps) * step_s - now end
  end
  return steps * step_s
end
local function charge(key, amount)
  redis.call('HINCRBY', key, tostring(step), amount)
  redis.call('EXPIRE', key, steps * step_s + 1)
end
"""

# KEYS: requests, tokens. ARGV: step_s, steps, requests_per_minute, tokens_per_minute (0: none).
# Returns {0} admitted (one request charged), {1, wait} requests refused, {2, wait} tokens spent.
ADMIT_SCRIPT = (
    _WINDOW
    + """
local rpm, tpm = tonumber(ARGV[3]), tonumber(ARGV[4])
if tpm > 0 then
  local w = wait(KEYS[2], tpm, 1)
  if w > 0 then return {2, tostring(w)} end
end
if rpm > 0 then
  local w = wait(KEYS[1], rpm, 1)
  if w > 0 then return {1, tostring(w)} end
  charge(KEYS[1], 1)
end
return {0, '0'}
"""
)

# KEYS: tokens. ARGV: step_s, steps, tokens.
CHARGE_SCRIPT = (
    _WINDOW
    + """
charge(KEYS[1], tonumber(ARGV[3]))
return 1
"""
)


def describe_url(url: str) -> str:
    """The state's address as logs show it: scheme, host, port and database, no credentials."""
    parts = urlsplit(url)
    where = parts.hostname or parts.path or "?"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{where}{port}{parts.path if parts.hostname else ''}"


class RedisLimits:
    """The windows in Redis, falling back to (or refusing without) local windows when it is lost."""

    def __init__(
        self,
        url: str,
        *,
        fail_closed: bool = False,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        try:
            import redis.asyncio as redis_asyncio
            from redis.exceptions import RedisError
        except ImportError as exc:  # an optional extra
            raise ConfigError("server.state: a redis:// state needs `pip install 'gengate[redis]'`") from exc
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(
                f"server.state: {describe_url(url)!r} is not a redis://, rediss:// or unix:// URL"
            )
        register_secret(parts.password)  # never in a log line or an error
        self.url = describe_url(url)
        self.fail_closed = fail_closed
        self.on_change = on_change
        self._clock = clock
        try:
            self._redis: Any = redis_asyncio.Redis.from_url(
                url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
            )
        except ValueError as exc:
            raise ConfigError(f"server.state: {describe_url(url)!r}: {exc}") from None
        self._admit = self._redis.register_script(ADMIT_SCRIPT)
        self._charge = self._redis.register_script(CHARGE_SCRIPT)
        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        self.local = LocalLimits(clock)
        self.shared = True  # whether Redis answered last time
        self._retry_at = 0.0

    @staticmethod
    def _keys(caller: str) -> list[str]:
        # One hash tag per caller: its two windows live in one Redis Cluster slot.
        return [f"{KEY_PREFIX}{{{caller}}}:requests", f"{KEY_PREFIX}{{{caller}}}:tokens"]

    def _usable(self) -> bool:
        return self.shared or self._clock() >= self._retry_at

    def _lost(self, exc: BaseException) -> None:
        self._retry_at = self._clock() + RETRY_S
        if not self.shared:
            return
        self.shared = False
        what = "refusing calls with per-minute quotas" if self.fail_closed else "serving with local limits"
        log.warning("limits: the shared state %s is lost (%s); %s", self.url, type(exc).__name__, what)
        if self.on_change is not None:
            self.on_change(False)

    def _back(self) -> None:
        if self.shared:
            return
        self.shared = True
        log.info("limits: the shared state %s answers again; quotas are shared", self.url)
        if self.on_change is not None:
            self.on_change(True)

    def _refused(self) -> Unavailable:
        return Unavailable(
            "the shared quota state cannot be reached, and this server refuses calls without it "
            "(server.state_fail_closed)",
            reason="LIMITS_UNAVAILABLE",
            retry_after_s=RETRY_S,
        )

    async def admit(
        self, caller: str, requests_per_minute: int | None, tokens_per_minute: int | None
    ) -> Refusal | None:
        if self._usable():
            try:
                answer = await self._admit(
                    keys=self._keys(caller),
                    args=[STEP_S, STEPS, requests_per_minute or 0, tokens_per_minute or 0],
                )
            except self._errors as exc:
                self._lost(exc)
            else:
                self._back()
                kind, wait = int(answer[0]), float(answer[1])
                if kind == 0:
                    return None
                if kind == 1:
                    assert requests_per_minute is not None
                    return Refusal("requests_per_minute", requests_per_minute, wait)
                assert tokens_per_minute is not None
                return Refusal("tokens_per_minute", tokens_per_minute, wait)
        if self.fail_closed:
            raise self._refused()
        return self.local.admit_now(caller, requests_per_minute, tokens_per_minute)

    async def charge_tokens(self, caller: str, tokens: int) -> None:
        if self._usable():
            try:
                await self._charge(keys=self._keys(caller)[1:], args=[STEP_S, STEPS, tokens])
            except self._errors as exc:
                self._lost(exc)
            else:
                self._back()
                return
        self.local.charge_now(caller, tokens)

    def status(self) -> str:
        if self.shared:
            return f"shared in {self.url}"
        return f"{self.url} lost: " + ("refusing" if self.fail_closed else "local limits")

    async def ping(self) -> bool:
        """Whether Redis answers now (at start: says so in the log either way)."""
        try:
            await self._redis.ping()
        except self._errors as exc:
            self._lost(exc)
            return False
        self._back()
        return True

    async def aclose(self) -> None:
        await self._redis.aclose()


def open_state(
    url: str | None, *, fail_closed: bool = False, on_change: Callable[[bool], None] | None = None
) -> LimitState:
    """The windows' home: this process (no URL), or Redis."""
    if url is None:
        return LocalLimits()
    return RedisLimits(url, fail_closed=fail_closed, on_change=on_change)
