"""Exactly one replica supervises the managed engines: a leader lease in Redis.

The lease is one key, `P leader` = the holder's replica id, taken with SET NX PX and renewed every
third of the lease by a Lua script that extends it only for its holder. A leader that dies stops
renewing, and once the key has expired another replica takes the lease. The engines outlive it and
keep serving every replica meanwhile (their process guards do not follow a dead gateway, and they
heartbeat to the engines' control port that every replica on the host shares): the new leader adopts
each engine it can prove is the one the deployment admitted (gateway/control/adoption.py) and
supervises it from then on. For the others (not on this host, or not running) it waits until none
is heartbeating (at most `takeover_wait_s`) before it launches its own, so two sets of engines never
run side by side.

Redis unreachable: the leader keeps its engines (fail open; requests need them) and retakes the key
as soon as Redis answers; the others wait one full lease of Redis answering before they compete for
a missing key, so the incumbent wins after a Redis restart. A leader that finds the key held by
another replica stops its engines at once. Limit: a leader cut off from a Redis that the others still
reach keeps its engines while another takes over, until it sees Redis again.

A leader that stops (SIGTERM) while it sees another replica on its host hands its engines over: it
leaves them running, releases the lease, and the next leader adopts them as above; the last replica
to stop stops them (and a `kind: openai` command is stopped either way: it is not adopted).
Replicas that all stop at once may each see the others and leave the engines running: those exit by
themselves once no replica hears them (`engine_orphan_s`).

Each renewal also announces, under `P identities`, the digests of the identities the leader gives its
engines (engine_identities.py): the script writes them only for the holder, so every replica can
check the current leader's engines and a deposed leader cannot overwrite them. It replaces the hash
whole (the leader's digests in effect are the announcement: a backend no longer managed leaves it, and
an empty announcement deletes it) and sets its expiry (`engine_keys_ttl_s`): while leaders renew it
stays; once none has for that long the engines it names have exited (`engine_orphan_s`), and it leaves
Redis instead of staying for good.

The supervisor is started and stopped from outside (`make_supervisor` builds a fresh one for every
term of leadership); without Redis the single process supervises from the start.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Protocol

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.config.sections import RedisConfig
from gateway.control.supervisor import Process

log = structlog.get_logger("leadership")

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if KEYS[2] ~= KEYS[1] then  -- the same key: no announce key, nothing announced
    redis.call('DEL', KEYS[2])
    if #ARGV > 3 then
      redis.call('HSET', KEYS[2], unpack(ARGV, 4))
      redis.call('PEXPIRE', KEYS[2], ARGV[3])
    end
  end
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
return 0
"""
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# Renewal result: extended / key missing (Redis restarted: retake it) / held by another replica.
RENEWED, MISSING, LOST = 1, -1, 0
ANNOUNCE_TTL_MS = round(RedisConfig().engine_keys_ttl_s * 1000)   # the configured default


class Supervised(Protocol):
    def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def leave(self) -> None: ...


class LeaderLease:
    def __init__(
        self, redis: Redis, key: str, holder: str, lease_ms: int, timeout_s: float,
        announce_key: str = "", announced: Mapping[str, str] | None = None, announce_ttl_ms: int = ANNOUNCE_TTL_MS,
    ) -> None:
        """`announced`: the hash written to `announce_key` with every renewal, replacing what is there, with
        an expiry of `announce_ttl_ms` (the engines' digests, read at each renewal: they change when the
        leader adopts engines or launches its own); nothing is announced without `announce_key`."""
        self._redis = redis
        self.key = key
        self.holder = holder
        self.lease_ms = lease_ms
        self._timeout_s = timeout_s
        self._announce_key = announce_key
        self._announced = {} if announced is None or not announce_key else announced   # live: not a copy
        self._announce_ttl_ms = announce_ttl_ms

    async def acquire(self) -> bool:
        return bool(await asyncio.wait_for(
            self._redis.set(self.key, self.holder, nx=True, px=self.lease_ms), self._timeout_s))

    async def current(self) -> str | None:
        holder = await asyncio.wait_for(self._redis.get(self.key), self._timeout_s)
        return None if holder is None else str(holder)

    async def renew(self) -> int:
        result = await asyncio.wait_for(
            self._redis.eval(_RENEW, 2, self.key, self._announce_key or self.key, self.holder, self.lease_ms,
                             self._announce_ttl_ms, *(x for pair in self._announced.items() for x in pair)),
            self._timeout_s)
        return int(result)

    async def release(self) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self._redis.eval(_RELEASE, 1, self.key, self.holder), self._timeout_s)


class Supervision:
    """Runs `make_supervisor()` on this replica while it holds the lease (always, without a lease)."""

    def __init__(
        self, make_supervisor: Callable[[Mapping[str, Process]], Supervised], lease: LeaderLease | None,
        engines_silent: Callable[[Collection[str]], bool], takeover_wait_s: float, clock: Callable[[], float],
        on_term: Callable[[bool, Collection[str]], None] = lambda leading, adopted: None,
        adopt: Callable[[Collection[str]], Mapping[str, Process]] = lambda adopted: {},
        hand_over: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        """`make_supervisor(adopted)`: the supervisor of one term, given the engines adopted from the
        previous leader (backend id -> its process guard). `adopt(adopted)`: the previous leader's
        engines, other than those, that can be adopted now (with a lease only). `engines_silent(adopted)`:
        no managed backend but those is heartbeating. `on_term(True, adopted)` when this replica takes
        the engines over (before launching), `on_term(False, ())` when it stops supervising them (their
        identities follow: control_auth.ControlAuth.identities). `hand_over()`, awaited when this replica
        stops as leader: True where its engines outlive it and another replica is there to adopt them
        (and now hears them), so they are left running (a rolling restart of the leader fails no other
        replica's requests) and the lease is released for that replica to take at once."""
        self._make = make_supervisor
        self._adopt = adopt
        self._on_term = on_term
        self._hand_over = hand_over
        self._lease = lease
        self._engines_silent = engines_silent
        self._takeover_wait_s = takeover_wait_s
        self._clock = clock
        self.supervisor: Supervised | None = None
        self.terms = 0                         # times this replica became leader
        # Since when Redis has answered without a break (-inf: since start-up, so no wait then).
        self._reachable_since: float | None = float("-inf")

    @property
    def leading(self) -> bool:
        return self.supervisor is not None

    async def run(self, stop: asyncio.Event) -> None:
        if self._lease is None:
            await self._lead(stop)
            await stop.wait()
        else:
            tick_s = self._lease.lease_ms / 3000
            while not stop.is_set():
                await self._tick(self._lease, stop)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), tick_s)
        leave = False
        if self._hand_over is not None and self._lease is not None and self.leading:
            try:
                leave = await self._hand_over()
            except Exception as exc:   # the engines are then stopped, as without a peer
                log.warning("engines_hand_over_failed", error=repr(exc))
        await self._step_down(leave=leave)
        if self._lease is not None:
            await self._lease.release()

    async def _tick(self, lease: LeaderLease, stop: asyncio.Event) -> None:
        try:
            if self.leading:
                result = await lease.renew()
                if result == MISSING and await lease.acquire():
                    log.info("leader_lease_retaken", replica=lease.holder)
                elif result == LOST:
                    log.warning("leader_lease_lost", replica=lease.holder)
                    await self._step_down()
                return
            holder = await lease.current()
            now = self._clock()
            if self._reachable_since is None:
                self._reachable_since = now
            if holder is None and now - self._reachable_since >= lease.lease_ms / 1000 and await lease.acquire():
                log.info("leader_lease_acquired", replica=lease.holder)
                await self._lead(stop)
        except (RedisError, OSError, TimeoutError) as exc:
            if self._reachable_since is not None:
                log.warning("leader_lease_unreachable", replica=lease.holder, leading=self.leading, error=repr(exc))
            self._reachable_since = None

    async def _lead(self, stop: asyncio.Event) -> None:
        """Adopt the previous leader's engines that still run, wait for its other engines to fall
        silent (holding the lease), announce our engines' identities, then launch what is missing."""
        deadline = self._clock() + self._takeover_wait_s
        adopted: dict[str, Process] = {}
        renewed = float("-inf")   # renew at once
        while True:
            if self._lease is not None:
                if self._clock() - renewed >= self._lease.lease_ms / 3000:
                    renewed = self._clock()
                    await self._renew_quietly(self._lease)
                adopted.update(self._adopt(adopted.keys()))
            if self._engines_silent(adopted.keys()) or self._clock() >= deadline or stop.is_set():
                break
            with contextlib.suppress(TimeoutError):   # polls the state table: heartbeats set no event
                await asyncio.wait_for(stop.wait(), 0.05)
        self._on_term(True, adopted.keys())
        if self._lease is not None:   # the engines about to start are admitted by every replica
            await self._renew_quietly(self._lease)
        self.terms += 1
        self.supervisor = self._make(adopted)
        self.supervisor.start()

    @staticmethod
    async def _renew_quietly(lease: LeaderLease) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await lease.renew()

    async def _step_down(self, leave: bool = False) -> None:
        """Stop the engines, or with `leave` leave them running for the next leader to adopt."""
        if self.supervisor is not None:
            supervisor, self.supervisor = self.supervisor, None
            if leave:
                await supervisor.leave()
                log.info("engines_handed_over", replica=self._lease.holder if self._lease else None)
            else:
                await supervisor.stop()
            self._on_term(False, ())
