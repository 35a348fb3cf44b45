"""Tenants' rate limits held by every replica at once, in Redis: fixed windows, one atomic Lua script.

Keys under the prefix P (`gateway.redis.key_prefix`), one per tenant and limit:

    P tenant:{<tenant>}:<limit>   HASH   w -> the current window (Redis's clock // the period: 60 s, or
                                         86400 s for tokens_per_day), n -> its count; expires at the
                                         window's end + 1 s

A charge (`MemoryLimitStore`'s rules, gateway/pipeline/tenants.py) is one EVALSHA of `CHARGE`: it
reads Redis's own clock (TIME), so replicas on hosts whose clocks differ agree on the window; reads
the tenant's counters, a counter of an older window counting as 0; and either refuses, writing
nothing, or adds every amount. A script runs alone on the server, so concurrent charges from any
number of replicas never both take the last unit of a window. The `{<tenant>}` hash tag keeps a
tenant's keys in one slot (one script touches one tenant only).

Adjustments (a request's real usage against its estimate, at its end) are not awaited by the
request: they are queued and sent by one task, many in one pipelined round trip (`ADJUST`, the
same rules as `MemoryLimitStore.adjust`).

Redis unreachable: a charge raises `LimitStoreUnavailable` after at most `timeout_ms`, and for a
backoff after that (0.1 s, doubling to 1 s while it stays away) charges raise at once instead of
each waiting for a timeout; `gateway.tenants.on_redis_error` then admits them uncounted (open) or
refuses them with 503 (closed). Adjustments that cannot be sent are dropped and logged (counted in
`dropped`): not retried, as a pipeline that timed out may have run on the server, and sent again it would
count twice. A refund dropped so leaves its window charged the request's whole bound until the window
ends (at most a minute, or the day for tokens_per_day), as the requests admitted uncounted while Redis was
away (`on_redis_error: open`) leave it charged less.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from gateway.pipeline.tenants import Charge, Limit, LimitStoreUnavailable, WindowUsage

log = structlog.get_logger("tenant_limits")

RETRY_MIN_S, RETRY_MAX_S = 0.1, 1.0

# KEYS: the tenant's counters; ARGV, three per key: period (s), limit, amount.
# Returns {1, window...} when charged, or {0, index (1-based), count, seconds to the window's end}.
CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local windows, counts = {}, {}
for i = 1, #KEYS do
  local w = math.floor(now / tonumber(ARGV[3 * i - 2]))
  local stored = redis.call('HMGET', KEYS[i], 'w', 'n')
  local count = 0
  if stored[1] and tonumber(stored[1]) == w then count = tonumber(stored[2]) end
  windows[i], counts[i] = w, count
  if count + tonumber(ARGV[3 * i]) > tonumber(ARGV[3 * i - 1]) then
    return {0, i, count, tostring((w + 1) * tonumber(ARGV[3 * i - 2]) - now)}
  end
end
for i = 1, #KEYS do
  local period = tonumber(ARGV[3 * i - 2])
  redis.call('HSET', KEYS[i], 'w', windows[i], 'n', counts[i] + tonumber(ARGV[3 * i]))
  redis.call('PEXPIREAT', KEYS[i], ((windows[i] + 1) * period + 1) * 1000)
end
local out = {1}
for i = 1, #KEYS do out[i + 1] = windows[i] end
return out
"""

# KEYS: the tenant's counters; ARGV, three per key: period (s), the window charged, delta. A delta goes
# into the current window when that is the window charged; a positive one into the current one anyway.
ADJUST = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 1, #KEYS do
  local period, delta = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i])
  local w = math.floor(now / period)
  if delta ~= 0 and (delta > 0 or w == tonumber(ARGV[3 * i - 1])) then
    local stored = redis.call('HMGET', KEYS[i], 'w', 'n')
    local count = 0
    if stored[1] and tonumber(stored[1]) == w then count = tonumber(stored[2]) end
    redis.call('HSET', KEYS[i], 'w', w, 'n', math.max(0, count + delta))
    redis.call('PEXPIREAT', KEYS[i], ((w + 1) * period + 1) * 1000)
  end
end
return 0
"""

# KEYS: the tenant's counters; ARGV: their periods. Returns, per key, its count and (as a string) the
# seconds to its window's end.
READ = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {}
for i = 1, #KEYS do
  local period = tonumber(ARGV[i])
  local w = math.floor(now / period)
  local stored = redis.call('HMGET', KEYS[i], 'w', 'n')
  local count = 0
  if stored[1] and tonumber(stored[1]) == w then count = tonumber(stored[2]) end
  out[2 * i - 1], out[2 * i] = count, tostring((w + 1) * period - now)
end
return out
"""


class RedisLimitStore:
    """`LimitStore` on one Redis shared by the replicas. `clock`: monotonic seconds, for the backoff."""

    def __init__(self, redis: Redis, key_prefix: str, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = redis
        self._prefix = key_prefix + "tenant:"
        self._timeout_s = timeout_s
        self._clock = clock
        self._charge = redis.register_script(CHARGE)
        self._adjust = redis.register_script(ADJUST)
        self._read = redis.register_script(READ)
        self._down_until = 0.0
        self._retry_s = 0.0
        self._pending: list[tuple[list[str], list[int]]] = []
        self._flushing: asyncio.Task[None] | None = None
        self.dropped = 0   # adjustments lost while Redis was away

    def keys(self, tenant: str, limits: Sequence[Limit]) -> list[str]:
        return [f"{self._prefix}{{{tenant}}}:{lim.reason}" for lim in limits]

    def _failed(self, exc: BaseException) -> LimitStoreUnavailable:
        if not self._retry_s:
            log.warning("tenant_limits_down", error=repr(exc))
        self._retry_s = min(RETRY_MAX_S, self._retry_s * 2) if self._retry_s else RETRY_MIN_S
        self._down_until = self._clock() + self._retry_s
        return LimitStoreUnavailable(f"Redis did not answer: {exc!r}")

    def _up(self) -> None:
        if self._retry_s:
            log.info("tenant_limits_up")
        self._retry_s = 0.0

    async def _call(self, script: AsyncScript, keys: list[str], args: list[int]) -> list[Any]:
        if self._clock() < self._down_until:
            raise LimitStoreUnavailable("Redis did not answer moments ago")
        try:
            result = await asyncio.wait_for(script(keys=keys, args=args), self._timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._failed(exc) from None
        self._up()
        return list(result)

    async def charge(self, tenant: str, limits: Sequence[Limit], amounts: Sequence[int]) -> Charge:
        args = [v for lim, amount in zip(limits, amounts, strict=True) for v in (lim.period_s, lim.limit, amount)]
        reply = await self._call(self._charge, self.keys(tenant, limits), args)
        if int(reply[0]) == 1:
            return Charge(True, tuple(int(w) for w in reply[1:]))
        return Charge(False, refused=int(reply[1]) - 1, used=int(reply[2]), retry_after_s=float(reply[3]))

    def adjust(self, tenant: str, limits: Sequence[Limit], windows: Sequence[int], deltas: Sequence[int]) -> None:
        args = [v for lim, w, d in zip(limits, windows, deltas, strict=True) for v in (lim.period_s, w, d)]
        self._pending.append((self.keys(tenant, limits), args))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Send the queued adjustments, those queued meanwhile in the next round trip."""
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                pipe = self._redis.pipeline(transaction=False)
                for keys, args in batch:
                    await self._adjust(keys=keys, args=args, client=pipe)
                await asyncio.wait_for(pipe.execute(), self._timeout_s)
            except (RedisError, OSError, TimeoutError) as exc:
                self.dropped += len(batch)
                log.warning("tenant_usage_dropped", adjustments=len(batch), error=repr(exc))

    async def read(self, tenant: str, limits: Sequence[Limit]) -> list[WindowUsage]:
        reply = await self._call(self._read, self.keys(tenant, limits), [lim.period_s for lim in limits])
        return [WindowUsage(int(reply[2 * i]), float(reply[2 * i + 1])) for i in range(len(limits))]
