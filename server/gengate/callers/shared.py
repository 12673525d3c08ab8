"""Caller quotas shared by replicas: the per-minute windows in Redis (`server.state:
redis://host:port/db`), checked and charged atomically by Lua scripts on Redis's own clock, so
one requests_per_minute holds across every replica.

max_concurrency holds across replicas too: each call in flight holds a lease, a member
`<replica>:<call>` of a sorted set per caller scored by its expiry (Redis's clock), taken by a
script that drops expired members, counts, and adds only under the limit. One heartbeat task
per replica extends all of its live leases every lease_s/3; a call's end removes its lease. A
replica that dies leaves leases that stop counting when they expire (`server.state_lease_s`).

A replica that loses Redis keeps serving with windows and a max_concurrency in its own memory
(fail-open; each replica then allows the whole quota) and says so: a warning in the log and the
health service `gengate.limits` NOT_SERVING, until Redis answers again. With
`server.state_fail_closed: true` calls of callers with per-minute quotas or a max_concurrency
are refused instead (UNAVAILABLE, LIMITS_UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from gengate.callers.limits import IN_THIS_PROCESS, STEP_S, STEPS, CallHold, LimitState, LocalLimits, Refusal
from gengate.errors import ConfigError, Unavailable
from gengate.redaction import register_secret

log = logging.getLogger("gengate.limits")

# How long one Redis command may take before the replica counts Redis as lost.
REDIS_TIMEOUT_S = 0.5
# While Redis is lost, one call in this many seconds tries it again.
RETRY_S = 1.0
KEY_PREFIX = "gengate:limits:"
# How long a call's lease counts without its replica's heartbeat (server.state_lease_s).
LEASE_S = 30.0

# KEYS: the caller's calls. ARGV: max_concurrency, lease_s, member. 1: held, 0: refused.
HOLD_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease_s = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + lease_s, ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(lease_s * 1000) + 1000)
return 1
"""

# KEYS: the caller's calls. ARGV: lease_s, members. XX: a lease released (or expired) since the
# heartbeat read its members is never brought back, so no ended call holds a slot.
RENEW_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease_s = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + lease_s, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], math.ceil(lease_s * 1000) + 1000)
return 1
"""

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

# KEYS: requests, tokens, the caller's calls. ARGV: step_s, steps, requests_per_minute,
# tokens_per_minute (0: none), max_concurrency, lease_s, member: ADMIT_SCRIPT and HOLD_SCRIPT in
# one round trip. Returns {3} when max_concurrency calls hold leases, else ADMIT_SCRIPT's answer;
# the lease is taken only with {0} (admitted).
ADMIT_HOLD_SCRIPT = (
    _WINDOW
    + """
local lease_s = tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[5]) then return {3, '0'} end
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
redis.call('ZADD', KEYS[3], now + lease_s, ARGV[7])
redis.call('PEXPIRE', KEYS[3], math.ceil(lease_s * 1000) + 1000)
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
        lease_s: float = LEASE_S,
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
        self._hold = self._redis.register_script(HOLD_SCRIPT)
        self._admit_hold = self._redis.register_script(ADMIT_HOLD_SCRIPT)
        self._renew = self._redis.register_script(RENEW_SCRIPT)
        self.lease_s = lease_s
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._call_ids = itertools.count()
        self.leases: dict[str, set[str]] = {}  # caller -> this replica's live lease members
        self._heartbeat: asyncio.Task[None] | None = None
        self._releasing: set[asyncio.Task[None]] = set()
        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        self.local = LocalLimits(clock)
        self.shared = True  # whether Redis answered last time
        self._retry_at = 0.0

    @staticmethod
    def _keys(caller: str) -> list[str]:
        # One hash tag per caller: its two windows live in one Redis Cluster slot.
        return [f"{KEY_PREFIX}{{{caller}}}:requests", f"{KEY_PREFIX}{{{caller}}}:tokens"]

    @staticmethod
    def calls_key(caller: str) -> str:
        """The sorted set of the caller's leases (in the same Cluster slot as its windows)."""
        return f"{KEY_PREFIX}{{{caller}}}:calls"

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

    @staticmethod
    def _refusal(
        answer: Any, requests_per_minute: int | None, tokens_per_minute: int | None
    ) -> Refusal | None:
        """ADMIT_SCRIPT's answer as a Refusal (None: admitted)."""
        kind, wait = int(answer[0]), float(answer[1])
        if kind == 0:
            return None
        if kind == 1:
            assert requests_per_minute is not None
            return Refusal("requests_per_minute", requests_per_minute, wait)
        assert tokens_per_minute is not None
        return Refusal("tokens_per_minute", tokens_per_minute, wait)

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
                return self._refusal(answer, requests_per_minute, tokens_per_minute)
        if self.fail_closed:
            raise self._refused()
        return self.local.admit_now(caller, requests_per_minute, tokens_per_minute)

    async def admit_and_hold(
        self,
        caller: str,
        requests_per_minute: int | None,
        tokens_per_minute: int | None,
        max_concurrency: int,
    ) -> Refusal | CallHold | None:
        if self._usable():
            keys = [*self._keys(caller), self.calls_key(caller)]
            windows = [STEP_S, STEPS, requests_per_minute or 0, tokens_per_minute or 0]
            got = await self._leasing(
                caller,
                lambda member: self._admit_hold(
                    keys=keys, args=[*windows, max_concurrency, self.lease_s, member]
                ),
            )
            if got is not None:
                answer, member = got
                kind = int(answer[0])
                if kind not in (0, 3):  # a window refused: no lease taken
                    self._forget(caller, member)
                    return self._refusal(answer, requests_per_minute, tokens_per_minute)
                return self._granted(caller, member, kind == 0)
        if self.fail_closed:
            raise self._refused()
        return self.local.admit_now(caller, requests_per_minute, tokens_per_minute) or IN_THIS_PROCESS

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

    async def hold_call(self, caller: str, max_concurrency: int) -> CallHold | None:
        if self._usable():
            key = [self.calls_key(caller)]
            got = await self._leasing(
                caller, lambda member: self._hold(keys=key, args=[max_concurrency, self.lease_s, member])
            )
            if got is not None:
                held, member = got
                return self._granted(caller, member, bool(int(held)))
        if self.fail_closed:
            raise self._refused()
        return IN_THIS_PROCESS  # Admission's own semaphore: this replica's calls only

    async def _leasing(self, caller: str, run: Callable[[str], Awaitable[Any]]) -> tuple[Any, str] | None:
        """Runs a script that may take a lease for a new member; (its answer, the member), or None
        when Redis did not answer (then counted lost)."""
        member = f"{self.replica}:{next(self._call_ids)}"
        live = self.leases.setdefault(caller, set())
        live.add(member)  # before the script: a cancel while it runs still removes the lease
        try:
            answer = await run(member)
        except self._errors as exc:
            self._forget(caller, member)
            self._lost(exc)
            return None
        except BaseException:
            self._release(caller, member)
            raise
        self._back()
        return answer, member

    def _granted(self, caller: str, member: str, held: bool) -> CallHold | None:
        """The lease a script took (kept alive by the heartbeat), or None when it took none."""
        if not held:
            self._forget(caller, member)
            return None
        self._start_heartbeat()
        return _Lease(self, caller, member)

    def _forget(self, caller: str, member: str) -> bool:
        """Stops extending a lease; False when it was not live."""
        live = self.leases.get(caller)
        if live is None or member not in live:
            return False
        live.discard(member)
        if not live:
            del self.leases[caller]
        return True

    def _release(self, caller: str, member: str) -> None:
        """Forgets a lease and removes it from Redis in the background; where Redis does not
        answer, it expires."""
        if not self._forget(caller, member):
            return
        task = asyncio.get_running_loop().create_task(self._remove(caller, member))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _remove(self, caller: str, member: str) -> None:
        if not self._usable():
            return
        try:
            await self._redis.zrem(self.calls_key(caller), member)
        except self._errors as exc:
            self._lost(exc)
        else:
            self._back()

    def _start_heartbeat(self) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.get_running_loop().create_task(
                self._beat(), name="gengate-limits-leases"
            )

    async def _beat(self) -> None:
        """Extends every live lease of this replica, every lease_s/3, while it has any."""
        while self.leases:
            await asyncio.sleep(self.lease_s / 3)
            await self.renew()

    async def renew(self) -> None:
        """Extends this replica's live leases now (one script per caller)."""
        for caller, members in list(self.leases.items()):
            if not members or not self._usable():
                continue
            try:
                await self._renew(keys=[self.calls_key(caller)], args=[self.lease_s, *members])
            except self._errors as exc:
                self._lost(exc)
            else:
                self._back()

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
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        for caller, members in list(self.leases.items()):  # calls cut short by the stop
            for member in list(members):
                self._release(caller, member)
        await asyncio.gather(*self._releasing, return_exceptions=True)
        await self._redis.aclose()


class _Lease:
    """One call's lease in Redis, released when the call ends."""

    __slots__ = ("_caller", "_limits", "_member")

    def __init__(self, limits: RedisLimits, caller: str, member: str) -> None:
        self._limits = limits
        self._caller = caller
        self._member = member

    def release(self) -> None:
        self._limits._release(self._caller, self._member)


def open_state(
    url: str | None,
    *,
    fail_closed: bool = False,
    on_change: Callable[[bool], None] | None = None,
    lease_s: float = LEASE_S,
) -> LimitState:
    """The windows' home: this process (no URL), or Redis."""
    if url is None:
        return LocalLimits()
    return RedisLimits(url, fail_closed=fail_closed, on_change=on_change, lease_s=lease_s)
