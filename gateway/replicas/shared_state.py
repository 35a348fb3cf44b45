"""Cluster state shared by gateway replicas through Redis, refreshed off the request path: the
Redis signal store of gateway/routing/signals.py (`SharedState`).

Keys under the prefix P (`gateway.redis.key_prefix`):

    P replicas            SET     replica ids that publish counts (a member whose key is gone is pruned);
                                  PX replica_ttl_ms, renewed on every refresh: once no replica has
                                  refreshed for that long it names dead ones only
    P inflight:<replica>  HASH    backend -> this replica's in-flight requests, `v:<backend>` -> image
                                  tokens it has sent to that encoder, `p:`/`b:`/`k:<backend>` -> its
                                  leases there: requests before their first token, their prompt tokens
                                  (the prefill backlog), KV tokens reserved; PX replica_ttl_ms,
                                  rewritten on every refresh, so a replica killed with SIGKILL drops
                                  out of every view within replica_ttl_ms + one refresh
    P hb:<backend>        STRING  the backend's last heartbeat (JSON) as received by whichever replica
                                  it pushes to (a scraped backend's readings are each replica's own,
                                  not shared); PX = miss limit × heartbeat interval
    P identities          HASH    managed backend -> digest of its engine's identity, replaced whole by
                                  the leader with every renewal (leadership.py, engine_identities.py),
                                  read on every refresh; PX engine_keys_ttl_s (below)
    P engines_port        STRING  the managed engines' control port on this host (`engines_port`), set
                                  again (if absent) and its expiry renewed on every refresh by every
                                  replica; PX engine_keys_ttl_s
    P prefix              STREAM  what each replica routed with cache-aware routing on: one entry per
                                  replica and refresh, holding its routed requests (backend, the
                                  prompt's block hashes, session key, prompt tokens) and which encoder
                                  got which images (their content digests), at most
                                  `prefix_stream_max` entries (trimmed approximately); every
                                  replica applies the others' entries to its prefix index and its
                                  encoders' index, so all predict from what all routed and a
                                  conversation's turns stay together whichever replica gets them;
                                  PX prefix_stream_ttl_s, renewed with every entry appended

Expiries. Every key expires once no replica writes it: the counts and heartbeats within a second, so
that what they say is current; the members with the counts. The engines' identities and port must
outlive every replica (engines outlive their leader, and a replica started meanwhile must hear them
on the same port and admit them with the same digests) but no longer than an engine with no replica
left runs (`engine_orphan_s`), so they expire `engine_keys_ttl_s` after the last rewrite (the config
refuses a TTL within `engine_orphan_s` or three leases). The prefix stream, bounded in entries but up
to `prefix_stream_max` × `prefix_batch_max` records, expires `prefix_stream_ttl_s` after the last
append: predictions of the engines' caches from a deployment idle that long are stale, and a stopped
deployment's would otherwise stay in Redis for good. The leader lease has its own PX (leadership.py).

Every `refresh_ms` one pipeline, one round trip, writes this replica's counts and the heartbeats it
received since the last refresh, and reads the members, every peer's counts, every backend's
heartbeat with its remaining TTL (from which the heartbeat's age follows without comparing clocks
across hosts) and the engines' identity digests. The request path never waits on Redis: policies
read the state table, whose in-flight count for a backend is this replica's live count + the peers'
counts as of the last refresh, so a decision between refreshes already counts this replica's own new
dispatches. The same round trip appends the requests this replica routed since the last refresh to
the prefix stream, as one entry, and reads the entries after the last one it read (at most
`prefix_batch_max` records published, `prefix_read_max` entries read; a replica that starts reads the
stream from its start, so it learns what is cached before it routes much).

Redis unreachable or restarted: each replica fails open on its own view. Peers' counts drop to zero;
backends last heard through Redis ("held") keep their last reported state and stay candidates for
`fail_open_hold_s`; past that, those that answer this replica's own checks stay (direct_checks.py: a
gRPC call to the engine's address, or the upstream probe's verdict for kind: openai; at most one a
backend every `held_check_interval_s`, each bounded by `held_check_timeout_s`). A held backend that
fails `held_check_failures` checks in a row leaves at once, within the hold or past it, until Redis is
back. Pricing of a held backend while Redis is away: its report is as old as the outage and the other
replicas' requests there are unseen, so its peers' load is taken as this replica's own load there
(in-flight, image tokens, leases) times the peers seen at the last refresh, recomputed on every tick;
Q_i = max(own + that, last report) never falls below what it last reported. `heterogate_shared_state_up`
is 0, `heterogate_shared_state_held_backends` counts those kept; `shared_state_down`,
`shared_state_hold_expired` (kept and unverified backends) and `shared_state_held_unreachable` are
logged. The first refresh that succeeds resumes sharing and logs that.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.config.sections import RedisConfig
from gateway.replicas.direct_checks import DirectChecks
from gateway.routing.backend_entry import NO_PEER_LOAD, BackendEntry, PeerLoad, Reported
from gateway.routing.encoder_index import EncoderIndex, Sent
from gateway.routing.prefix_index import PrefixIndex, Routed
from gateway.routing.state_table import StateTable

log = structlog.get_logger("shared_state")

# Hash fields of a replica's counts: backend id, or one of these prefixes + backend id, in the order
# of PeerLoad's fields (in-flight requests have no prefix).
FIELD_PREFIXES = ("", "v:", "p:", "b:", "k:")
_REPORTED_FIELDS = tuple(f.name for f in dataclasses.fields(Reported))
# A refresh that fails is retried after this long at first, doubling up to the cap (refreshes keep
# running at `refresh_ms` while Redis answers).
RETRY_MIN_S, RETRY_MAX_S = 0.1, 1.0


def connect(config: RedisConfig, url: str) -> Redis:
    """One pooled client per process; every call bounded by `timeout_ms`. A call that fails to connect
    or finds its connection closed is retried once, at once, on a new connection: a pooled connection
    outlives a Redis restart, and each would otherwise fail once when next used, seconds after Redis is
    back. A timeout is not retried (that would double the bound)."""
    timeout_s = config.timeout_ms / 1000
    return Redis.from_url(
        url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)), health_check_interval=0,
    )


def redacted(url: str) -> str:
    """A URL without the password in it (a Redis URL may carry one, in its user part or as a `password`
    query parameter), for messages and logs; the rest as written, whatever the URL (it never raises)."""
    url = _USER_PASSWORD.sub(r"\1***@", url, count=1)
    return _QUERY_PASSWORD.sub(r"\1***", url)


_USER_PASSWORD = re.compile(r"^([a-z][a-z0-9+.-]*://[^/@:?#]*:)[^/@?#]*@", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def own_load(e: BackendEntry) -> tuple[int, ...]:
    """This replica's load on a backend, in the order of FIELD_PREFIXES and PeerLoad's fields."""
    return e.in_flight, e.vision_in_flight_tokens, e.prefilling, e.prefill_backlog_tokens, e.kv_reserved_tokens


def encode_heartbeat(address: str | None, reported: Reported) -> str:
    return orjson.dumps({"address": address or "", **dataclasses.asdict(reported)}).decode()


def encode_batch(replica_id: str, routed: list[Routed], sent: list[Sent]) -> dict[str, bytes | str]:
    """One prefix-stream entry for everything a replica routed since its last refresh: one XADD a refresh,
    not one a request, and one read and decode of it by each other replica. `p`: [backend, block hashes
    (signed 64-bit), session or null, prompt tokens] per routed request; `e`: [encoder, image digests
    (unsigned 64-bit)] per encode."""
    return {"r": replica_id, "p": orjson.dumps([[b, list(h), s, n] for b, h, s, n in routed]),
            "e": orjson.dumps([[e, list(d)] for e, d in sent])}


def decode_batch(fields: dict[str, str]) -> tuple[str, list[Routed], list[Sent]]:
    """(the replica that wrote it, its prefix records, its encoder records)."""
    routed: list[Routed] = [(str(b), [int(x) for x in h], None if s is None else int(s), int(n))
                            for b, h, s, n in orjson.loads(fields["p"])]
    sent: list[Sent] = [(str(e), [int(x) for x in d]) for e, d in orjson.loads(fields["e"])]
    return fields["r"], routed, sent


def decode_heartbeat(raw: str) -> tuple[str, Reported]:
    data = orjson.loads(raw)
    return str(data["address"]), Reported(**{k: data[k] for k in _REPORTED_FIELDS if k in data})


class SharedState:
    """This replica's side of the shared state: takes reports, publishes, refreshes, fails open."""

    def __init__(
        self, table: StateTable, redis: Redis, config: RedisConfig, replica_id: str,
        on_heartbeat: Callable[[str, str], None] = lambda backend_id, address: None,
        on_identities: Callable[[dict[str, str]], None] = lambda digests: None,
        prefixes: PrefixIndex | None = None,
        encoders: EncoderIndex | None = None,
    ) -> None:
        """`on_heartbeat(backend_id, address)`: after each report taken, here or through Redis;
        `prefixes`, `encoders`: this replica's prefix index and encoders' index, shared with the
        others' (None: cache-aware routing off)."""
        self.table = table
        self._prefixes, self._encoders = prefixes, encoders
        for index in (prefixes, encoders):
            if index is not None:
                index.share(config.prefix_batch_max)
        self._prefix_key = f"{config.key_prefix}prefix"
        self._prefix_last = "0"   # the last stream entry read
        self.prefix_entries_applied = 0
        self._on_identities = on_identities
        self._redis = redis
        self._config = config
        self.replica_id = replica_id
        self._on_heartbeat = on_heartbeat
        prefix = config.key_prefix
        self.members_key = f"{prefix}replicas"
        self.identities_key = f"{prefix}identities"
        self._counts_prefix = f"{prefix}inflight:"
        self._backend_ids = [e.id for e in table.entries()]
        self._fields = [p + b for b in self._backend_ids for p in FIELD_PREFIXES]
        self._hb_key = {b: f"{prefix}hb:{b}" for b in self._backend_ids}
        self._hb_keys = list(self._hb_key.values())
        self._hb_ttl_ms = max(1, round(table.miss_limit * table.heartbeat_interval_s * 1000))
        self._dirty: set[str] = set()        # heartbeats received here since the last refresh
        self._remote: set[str] = set()       # backends whose latest heartbeat came through Redis
        self._held: set[str] = set()         # ... and that are kept alive while Redis is away
        self._checks = DirectChecks(table, config.held_check_interval_s, config.held_check_timeout_s,
                                    config.held_check_failures)
        self._peers_before = 0               # peers seen at the last refresh before Redis went away
        self._hold_expired = False           # logged for this outage
        self.holding = 0                     # held backends kept as candidates at the last tick
        self._peers: list[str] = []
        self._gone: list[str] = []           # members whose counts key has expired
        self._down_since: float | None = None
        self._kept: dict[str, str] = {}      # keys set again (NX) at every refresh: a restarted Redis gets them back
        self._kept_ttl_ms = round(config.engine_keys_ttl_s * 1000)
        self._hold_until = 0.0
        self.up = False
        self.errors = 0
        self.peer_count = 0

    def peers_on(self, host: str) -> int:
        """The other replicas seen at the last refresh that run on `host` (a replica id starts with its
        host's name: replica.new_replica_id)."""
        return sum(1 for peer in self._peers if peer.rsplit("-", 2)[0] == host)

    def key(self, replica_id: str) -> str:
        return self._counts_prefix + replica_id

    def heartbeat(self, backend_id: str, seq: int, address: str, reported: Reported) -> BackendEntry | None:
        """A heartbeat on this replica's Control service: into the table, and published on the next refresh."""
        entry = self.table.apply_heartbeat(backend_id, seq, address, reported)
        if entry is not None:
            self._on_heartbeat(backend_id, address)
            self._dirty.add(backend_id)
            self._remote.discard(backend_id)
            if backend_id in self._held:
                self._held.discard(backend_id)
                if self._down_since is not None:   # heard here now: its reports count every replica's requests
                    self.table.set_peer_load(backend_id, NO_PEER_LOAD)
        return entry

    async def engines_port(self, pick: Callable[[], int]) -> int:
        """The port where every replica on this host takes the managed engines' heartbeats: the first
        replica to ask stores `pick()` under `P engines_port`, the others read it. Each replica then sets
        it again (if absent) at every refresh: a Redis restarted without its data gets the port back from
        the running replicas before a new one could pick another, whose engines' heartbeats the running
        ones would then not hear. It expires `engine_keys_ttl_s` after the last replica renewed it."""
        key = self._config.key_prefix + "engines_port"
        timeout_s = self._config.timeout_ms / 1000
        await asyncio.wait_for(self._redis.set(key, pick(), nx=True, px=self._kept_ttl_ms), timeout_s)
        port = await asyncio.wait_for(self._redis.get(key), timeout_s)
        if port is None:   # deleted in between: another replica's next start picks one again
            raise OSError(f"{key} vanished from Redis")
        self._kept[key] = str(port)
        return int(port)

    async def refresh(self) -> None:
        """One round trip: publish own counts and new heartbeats; read peers' counts and heartbeats."""
        table = self.table
        own_key = self.key(self.replica_id)
        counts: dict[str, int] = {}
        for e in table.entries():
            for prefix, value in zip(FIELD_PREFIXES, own_load(e), strict=True):
                counts[prefix + e.id] = value
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(own_key, mapping=counts)   # type: ignore[arg-type]
        pipe.pexpire(own_key, self._config.replica_ttl_ms)
        pipe.sadd(self.members_key, self.replica_id)
        pipe.pexpire(self.members_key, self._config.replica_ttl_ms)
        for key, kept in self._kept.items():
            pipe.set(key, kept, nx=True, px=self._kept_ttl_ms)
            pipe.pexpire(key, self._kept_ttl_ms)
        if self._gone:
            pipe.srem(self.members_key, *self._gone)
        dirty, self._dirty = self._dirty, set()
        now = table.clock()
        for backend_id in dirty:
            entry = table.get(backend_id)
            # with the time left of its freshness, so its age reads right when it was received a while
            # ago (Redis was away); one no longer fresh is not news (the stale marker always is)
            left_ms = self._hb_ttl_ms if entry is None or entry.last_heartbeat is None else \
                self._hb_ttl_ms - round((now - entry.last_heartbeat) * 1000)
            if entry is not None and left_ms > 0:
                pipe.set(self._hb_key[backend_id], encode_heartbeat(entry.address, entry.reported), px=left_ms)
        pipe.smembers(self.members_key)
        peers = self._peers
        for peer in peers:
            pipe.hgetall(self.key(peer))
        for k in self._hb_keys:
            pipe.get(k)
            pipe.pttl(k)
        pipe.hgetall(self.identities_key)
        sharing = self._prefixes is not None or self._encoders is not None
        routed = self._prefixes.take_routed() if self._prefixes is not None else []
        sent = self._encoders.take_sent() if self._encoders is not None else []
        entries = [encode_batch(self.replica_id, routed, sent)] if routed or sent else []
        for fields in entries:   # the prefix stream last: its replies come off the end below
            pipe.xadd(self._prefix_key, fields,  # type: ignore[arg-type]
                      maxlen=self._config.prefix_stream_max, approximate=True)
            pipe.pexpire(self._prefix_key, round(self._config.prefix_stream_ttl_s * 1000))
        if sharing:
            pipe.xrange(self._prefix_key, min=f"({self._prefix_last}", count=self._config.prefix_read_max)
        results: list[Any] = await pipe.execute()
        if sharing:
            self._apply_routed(results.pop())
            del results[len(results) - 2 * len(entries):]   # the appended entries' ids and expiries
        tail = results[-(2 + len(peers) + 2 * len(self._hb_keys)):]   # the reads, after the writes
        members, peer_maps, heartbeats = tail[0], tail[1:1 + len(peers)], tail[1 + len(peers):-1]
        self._on_identities(tail[-1])
        self._apply_peers(peers, peer_maps)
        self._apply_heartbeats(heartbeats)
        self._peers = sorted(m for m in members if m != self.replica_id)
        self._resumed()

    def _apply_routed(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        """The other replicas' records since the last read, into this replica's indexes (its own skipped)."""
        prefixes, encoders = self._prefixes, self._encoders
        for entry_id, fields in entries:
            self._prefix_last = entry_id
            try:
                replica, routed, sent = decode_batch(fields)
            except (KeyError, ValueError, TypeError, orjson.JSONDecodeError) as exc:
                log.warning("shared_prefix_unreadable", entry=entry_id, error=str(exc))
                continue
            if replica == self.replica_id:
                continue
            if prefixes is not None:
                for record in routed:
                    prefixes.peer_routed(*record)
            if encoders is not None:
                for encoder, digests in sent:
                    encoders.peer_sent(encoder, digests)
            self.prefix_entries_applied += len(routed) + len(sent)

    def _apply_peers(self, peers: list[str], maps: list[dict[str, str]]) -> None:
        self._gone = [p for p, m in zip(peers, maps, strict=True) if not m]
        summed = {field: 0 for field in self._fields}
        for m in maps:
            for field, value in m.items():
                if field in summed:
                    summed[field] += int(value)
        self.peer_count = len(peers) - len(self._gone)
        for backend_id in self._backend_ids:
            self.table.set_peer_load(backend_id, PeerLoad(*(summed[p + backend_id] for p in FIELD_PREFIXES)))

    def _apply_heartbeats(self, values: list[Any]) -> None:
        now = self.table.clock()
        for i, backend_id in enumerate(self._backend_ids):
            raw, ttl_ms = values[2 * i], values[2 * i + 1]
            if raw is None:
                continue
            try:
                address, reported = decode_heartbeat(raw)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("shared_heartbeat_unreadable", backend=backend_id, error=str(exc))
                continue
            age_s = max(0, self._hb_ttl_ms - ttl_ms) / 1000 if ttl_ms > 0 else 0.0
            entry = self.table.apply_heartbeat(backend_id, reported.seq, address, reported, at=now - age_s)
            if entry is not None:
                self._remote.add(backend_id)
                self._held.discard(backend_id)
                self._on_heartbeat(backend_id, address)

    def _resumed(self) -> None:
        if not self.up:
            log.info("shared_state_up", replica=self.replica_id, peers=self.peer_count,
                     after_s=None if self._down_since is None else round(self.table.clock() - self._down_since, 3))
        if self._down_since is not None:   # the writers of the heartbeats may still be backing off
            self._hold_until = self.table.clock() + RETRY_MAX_S + 2 * self._hb_ttl_ms / 1000
        self.up = True
        self._down_since = None

    def failed(self, exc: BaseException) -> None:
        """Fail open: own view only; backends last heard through Redis stay candidates as `hold` says."""
        now = self.table.clock()
        self.errors += 1
        if self._down_since is None:
            self._down_since = now
            self._held = {b for b in self._remote if (e := self.table.get(b)) and self.table.is_healthy(e, now)}
            self._peers_before = self.peer_count
            self._hold_expired = False
            self._checks.restart()
            log.warning("shared_state_down", replica=self.replica_id, error=repr(exc), failing_open=True,
                        held_backends=sorted(self._held))
        self.up = False
        self.peer_count = 0
        for backend_id in self._backend_ids:
            self.table.set_peer_load(backend_id, NO_PEER_LOAD)
        self.hold()

    def hold(self) -> None:
        """Backends last heard through Redis stay candidates: while Redis is away, for fail_open_hold_s
        and past it while they answer this replica's own checks, unless a check found them unreachable
        (then not until Redis is back), priced as `_price_held` says; after Redis is back, until their
        heartbeats arrive through it again."""
        now = self.table.clock()
        down = self._down_since
        if down is None:
            if now > self._hold_until:
                self._held.clear()
            kept = self._held
        else:
            lost = sorted(b for b in self._held if self._checks.unreachable(b))
            if lost:
                self._held.difference_update(lost)
                log.warning("shared_state_held_unreachable", backends=lost, checks=self._config.held_check_failures,
                            detail="no answer to this replica's own checks: no candidate here until Redis is back")
            within = now <= down + self._config.fail_open_hold_s
            kept = self._held if within else {b for b in self._held if self._checks.answered(b)}
            if not within and not self._hold_expired and self._held:
                self._hold_expired = True
                log.warning("shared_state_hold_expired", kept=sorted(kept), unverified=sorted(self._held - kept),
                            hold_s=self._config.fail_open_hold_s,
                            detail="Redis is still away: backends heard only through it stay candidates here "
                                   "while they answer this replica's own checks")
        for backend_id in kept:
            self.table.assume_alive(backend_id)
            if down is not None:
                self._price_held(backend_id)
        self.holding = len(kept)

    def _price_held(self, backend_id: str) -> None:
        """Redis away: the other replicas' load on a held backend is unseen and its report is as old as the
        outage, so take the peers' load as this replica's own there times the peers seen at the last
        refresh (Q_i = max(own + peers', reported) never falls below its last report)."""
        entry = self.table.get(backend_id)
        if entry is not None:
            peers = self._peers_before
            self.table.set_peer_load(backend_id, PeerLoad(*(peers * x for x in own_load(entry))))

    async def run(self, stop: asyncio.Event) -> None:
        """Refresh every `refresh_ms` until `stop`, then withdraw this replica's counts. While Redis is
        away, retry with backoff, keep holding the backends heard through it on every tick and check
        them directly (direct_checks.py)."""
        interval_s = self._config.refresh_ms / 1000
        bound_s = 2 * self._config.timeout_ms / 1000
        retry_s, next_try = RETRY_MIN_S, 0.0
        clock = self.table.clock
        while not stop.is_set():
            if clock() >= next_try:
                try:
                    await asyncio.wait_for(self.refresh(), bound_s)
                    retry_s, next_try = RETRY_MIN_S, 0.0
                    self.hold()
                except (RedisError, OSError, TimeoutError) as exc:
                    self.failed(exc)
                    next_try, retry_s = clock() + retry_s, min(RETRY_MAX_S, retry_s * 2)
            else:
                self.hold()
            if self._down_since is not None:
                self._checks.tick(self._held)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
        await self._checks.close()
        await self.withdraw()

    async def withdraw(self) -> None:
        """A replica that stops cleanly takes its counts out at once instead of letting them expire."""
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            pipe = self._redis.pipeline(transaction=False)
            pipe.delete(self.key(self.replica_id))
            pipe.srem(self.members_key, self.replica_id)
            await asyncio.wait_for(pipe.execute(), self._config.timeout_ms / 1000)


class SharedStateCollector(Collector):
    """/metrics: whether sharing works, how many peers this replica sees, their load per backend."""

    def __init__(self, shared: SharedState) -> None:
        self._shared = shared

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("heterogate_shared_state_up",
                               "1 while Redis refreshes succeed; 0: failing open on this replica's own view "
                               "(labelled with the replica that answered the scrape)", labels=["replica"])
        up.add_metric([self._shared.replica_id], 1.0 if self._shared.up else 0.0)
        peers = GaugeMetricFamily("heterogate_shared_state_peers", "Other replicas seen at the last refresh")
        peers.add_metric([], self._shared.peer_count)
        errors = CounterMetricFamily("heterogate_shared_state_errors", "Refreshes that failed (Redis away)")
        errors.add_metric([], self._shared.errors)
        held = GaugeMetricFamily("heterogate_shared_state_held_backends",
                                 "Backends last heard through Redis kept as candidates on this replica's own "
                                 "view (Redis away, or just back)")
        held.add_metric([], self._shared.holding)
        load = GaugeMetricFamily("heterogate_backend_peer_in_flight",
                                 "Requests in flight on the backend from other replicas", labels=["backend"])
        for e in self._shared.table.entries():
            load.add_metric([e.id], e.peer_in_flight)
        yield from (up, peers, errors, held, load)
