"""The gateway's subscription to a kind: openai engine's KV cache events (its `kv_events:` entry), so the
prefix index follows what the engine's cache holds rather than only what this gateway routed there.

One ZeroMQ SUB socket per backend, connected to the engine's PUB endpoint (ZeroMQ connects in the
background and reconnects by itself; a subscriber gets what is published from then on). Each message is
one batch (common/kv_events.py); its sequence number tells what was missed. Where the entry names the
engine's replay socket (gateway/control/kv_event_replay.py), the listener first asks it for every batch
the engine still holds (a gateway started after its engines knows at once what they cached), and a jump
forward (batches lost on the way, or a first live batch above what the replay brought) is filled in from
it before the batch is applied; what a replay does not bring (the engine's buffer no longer holds it, or
it did not answer within `replay_timeout_ms`), and every jump without one, counts as lost
(`PrefixIndex.engine_events_lost`: the engine's chain is forgotten). The same batch twice (its number
and bytes: a replay overlapping live messages) is skipped; another batch under a number already
applied is an engine that started again with an empty cache (applied as AllBlocksCleared, then what it
published before this one replayed), and so is a replay, asked from the last batch applied, that holds
another batch under that number. A message that is not a batch, or whose events cannot be applied, is counted
and logged (the first and every 100th), never fatal: the next one is read. An engine run with data
parallelism publishes each rank's events on its own port (vLLM: the endpoint's port + rank): one backend
entry follows one endpoint.
Every replica subscribes on its own (a PUB socket serves any number of subscribers).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Sequence

import structlog
import zmq
import zmq.asyncio

from common.kv_events import AllBlocksCleared, KvEvent, KvEventError, decode_batch, decode_sequence
from gateway.config.cluster import KvEventsSpec
from gateway.control.kv_event_replay import YIELD_AFTER_S, replay
from gateway.routing.prefix_index import PrefixIndex

log = structlog.get_logger("kv_events")
RECEIVE_HWM = 100_000   # batches queued in the socket before ZeroMQ drops them (then counted as lost)
LOG_EVERY = 100         # of the messages refused, the first and every this many are logged
REMEMBERED = 1024       # batches whose digests are kept, to tell the same batch again from a new engine's


async def listen(backend_id: str, spec: KvEventsSpec, index: PrefixIndex) -> None:
    """Subscribe to `spec`'s endpoint and apply every batch to `index` until cancelled."""
    socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
    socket.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
    if spec.endpoint.startswith("tcp://["):   # an IPv6 address: ZeroMQ connects over IPv4 only unless told
        socket.setsockopt(zmq.IPV6, 1)
    try:
        socket.connect(spec.endpoint)
    except zmq.ZMQError as e:   # an endpoint ZeroMQ cannot connect to at all (no reconnecting will help)
        socket.close(linger=0)
        index.engine_events_refused(backend_id, f"cannot connect to {spec.endpoint}: {e}")
        log.error("kv_events_endpoint_refused", backend=backend_id, endpoint=spec.endpoint, error=str(e))
        return
    log.info("kv_events_subscribed", backend=backend_id, endpoint=spec.endpoint, topic=spec.topic,
             replay=spec.replay_endpoint)
    follower = Follower(backend_id, spec, index)
    try:
        if spec.replay_endpoint is not None:   # what the engine holds now, before the first live batch
            await follower.fill(0, None)
        while True:
            frames = await socket.recv_multipart()
            try:
                if len(frames) != 3:
                    raise KvEventError(f"{len(frames)} frames, not 3 (topic, sequence number, batch)")
                seq = decode_sequence(frames[1])
            except KvEventError as e:
                follower.refuse(e)
                continue
            await follower.receive(seq, frames[2])
    finally:
        socket.close(linger=0)


class Follower:
    """One engine's batches, applied to the index in the engine's order: sequence numbers compared with
    the last one applied, gaps filled from the replay socket (module docstring). Batches are told apart
    by a digest of their bytes as well as by number, so the same batch twice (a replay overlapping live
    messages) is skipped while another batch under a number already applied is a new engine's."""

    def __init__(self, backend_id: str, spec: KvEventsSpec, index: PrefixIndex) -> None:
        self.backend_id, self.spec, self.index = backend_id, spec, index
        self.last: int | None = None
        self.applied: OrderedDict[int, int] = OrderedDict()   # recent batches' digests by sequence number
        self.refused = 0

    def refuse(self, e: Exception) -> None:
        """A message that is no batch, or whose events the index cannot apply: counted, logged (the first
        and every LOG_EVERY), never fatal."""
        self.refused += 1
        error = str(e) if isinstance(e, KvEventError) else f"{type(e).__name__}: {e}"
        self.index.engine_events_refused(self.backend_id, error)
        if self.refused % LOG_EVERY == 1:
            log.warning("kv_events_refused", backend=self.backend_id, error=error, refused=self.refused)

    async def receive(self, seq: int, payload: bytes) -> None:
        """A live message: a batch, or refused (and then no number of it is taken)."""
        digest = hash(payload)
        if self.applied.get(seq) == digest:   # the same batch again
            return
        try:
            events = decode_batch(payload).events
        except Exception as e:
            self.refuse(e)
            return
        last, replays = self.last, self.spec.replay_endpoint is not None
        if last is not None and seq <= last:   # numbered from the start again: a new engine, its cache empty
            self._restarted()
            if replays and seq:   # and this gateway joined it late
                await self.fill(0, seq)
        elif replays and seq > (0 if last is None else last + 1):
            # Asked from the last batch applied: the engine still holding it shows it is the same engine.
            if not await self.fill(0 if last is None else last, seq, check=last):
                self._restarted()
                await self.fill(0, seq)
        elif last is not None and seq > last + 1:
            self.index.engine_events_lost(self.backend_id, seq - last - 1)
        self._apply(seq, events, digest)

    async def fill(self, start: int, stop: int | None, check: int | None = None) -> bool:
        """The batches from `start` (to `stop` - 1; None: all the engine holds) asked for again and applied
        in order. `check`: a batch applied already, asked for too: where the engine holds another batch
        under its number, it is another engine and nothing is applied (False). Holes after what this
        gateway followed count as lost (on joining, what the engine no longer holds does not: it was never
        followed here)."""
        assert self.spec.replay_endpoint is not None
        got, answered = await replay(self.spec.replay_endpoint, start, stop, self.spec.replay_timeout_ms / 1000)
        if check is not None and got and got[0][0] == check:
            if hash(got[0][1]) != self.applied.get(check):
                return False
            got = got[1:]
        if not answered and stop is not None:   # on joining (stop None) nothing was missed: the engine may be down
            log.warning("kv_events_replay_failed", backend=self.backend_id, endpoint=self.spec.replay_endpoint,
                        start=start, stop=stop, replayed=len(got))
        expected = start if check is None else check + 1
        applied = 0
        since = time.perf_counter()
        for seq, payload in got:
            if self.last is not None and seq > expected:   # a hole after what this gateway followed
                self.index.engine_events_lost(self.backend_id, seq - expected)
            expected = seq + 1
            try:
                events = decode_batch(payload).events
            except Exception as e:
                self.refuse(e)
                continue
            applied += self._apply(seq, events, hash(payload))
            if time.perf_counter() - since > YIELD_AFTER_S:   # a long replay leaves the loop to requests
                await asyncio.sleep(0)
                since = time.perf_counter()
        if stop is not None and stop > expected and self.last is not None:
            self.index.engine_events_lost(self.backend_id, stop - expected)
        self.index.engine_events_replayed(self.backend_id, applied, answered or stop is None)
        return True

    def _restarted(self) -> None:
        self.index.engine_events(self.backend_id, [AllBlocksCleared()])
        self.last = None
        self.applied.clear()

    def _apply(self, seq: int, events: Sequence[KvEvent], digest: int) -> bool:
        """Batch `seq`'s events applied to the index (False: the index could not apply them)."""
        self.last = seq
        self.applied[seq] = digest
        if len(self.applied) > REMEMBERED:
            self.applied.popitem(last=False)
        try:
            self.index.engine_events(self.backend_id, events)
        except Exception as e:   # events no engine should send never stop the listener
            self.refuse(e)
            return False
        return True
