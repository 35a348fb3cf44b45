"""The gateway's subscription to a kind: openai engine's KV cache events (its `kv_events:` entry), so the
prefix index follows what the engine's cache holds rather than only what this gateway routed there.

One ZeroMQ SUB socket per backend, connected to the engine's PUB endpoint (ZeroMQ connects in the
background and reconnects by itself; a subscriber gets what is published from then on). Each message is
one batch (common/kv_events.py); its sequence number tells what was missed. A first batch numbered
above 0 (this gateway joined a publisher that published before) or a jump forward (batches lost on the
way) is filled in from the engine's replay socket where the entry names one
(gateway/control/kv_event_replay.py), before the batch is applied; what the replay does not bring (the
engine's buffer no longer holds it, or it did not answer in time), and every jump without one, counts as
lost (`PrefixIndex.engine_events_lost`: the engine's chain is forgotten). A number that goes back is an
engine that started again with an empty cache (applied as AllBlocksCleared), the same number again a
batch sent twice (skipped). A message that is not a batch, or whose events cannot be applied, is counted
and logged (the first and every 100th), never fatal: the next one is read. An engine run with data
parallelism publishes each rank's events on its own port (vLLM: the endpoint's port + rank): one backend
entry follows one endpoint.
Every replica subscribes on its own (a PUB socket serves any number of subscribers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog
import zmq
import zmq.asyncio

from common.kv_events import AllBlocksCleared, KvEvent, KvEventError, decode_batch, decode_sequence
from gateway.config.cluster import KvEventsSpec
from gateway.control.kv_event_replay import replay
from gateway.routing.prefix_index import PrefixIndex

log = structlog.get_logger("kv_events")
RECEIVE_HWM = 100_000   # batches queued in the socket before ZeroMQ drops them (then counted as lost)
LOG_EVERY = 100         # of the messages refused, the first and every this many are logged


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
    last: int | None = None
    refused = 0

    def refuse(e: Exception) -> None:
        nonlocal refused
        refused += 1
        error = str(e) if isinstance(e, KvEventError) else f"{type(e).__name__}: {e}"
        index.engine_events_refused(backend_id, error)
        if refused % LOG_EVERY == 1:
            log.warning("kv_events_refused", backend=backend_id, error=error, refused=refused)

    try:
        while True:
            frames = await socket.recv_multipart()
            try:
                if len(frames) != 3:
                    raise KvEventError(f"{len(frames)} frames, not 3 (topic, sequence number, batch)")
                seq, batch = decode_sequence(frames[1]), decode_batch(frames[2])
            except Exception as e:   # a message no engine should send never stops the listener
                refuse(e)
                continue
            if last is not None and seq == last:   # the same batch again
                continue
            if last is not None and seq < last:   # numbered from the start again: a new engine, cache empty
                index.engine_events(backend_id, [AllBlocksCleared()])
            elif spec.replay_endpoint is not None and seq > (0 if last is None else last + 1):
                await _fill(backend_id, spec, index, 0 if last is None else last + 1, seq, refuse)
            elif last is not None and seq > last + 1:
                index.engine_events_lost(backend_id, seq - last - 1)
            last = seq
            _apply(backend_id, index, batch.events, refuse)
    finally:
        socket.close(linger=0)


async def _fill(backend_id: str, spec: KvEventsSpec, index: PrefixIndex, start: int, stop: int,
                refuse: Callable[[Exception], None]) -> None:
    """The batches `start` to `stop` - 1 did not arrive (from 0: this gateway joined late): asked for
    again on the replay socket and applied in order; those the engine no longer holds, or that the
    replay did not bring in time, count as lost (on joining, those it no longer holds do not: this
    gateway never followed them)."""
    assert spec.replay_endpoint is not None
    got, answered = await replay(spec.replay_endpoint, start, stop, spec.replay_timeout_ms / 1000)
    if not answered:
        log.warning("kv_events_replay_failed", backend=backend_id, endpoint=spec.replay_endpoint, start=start,
                    stop=stop, replayed=len(got))
    expected, followed = start, start > 0   # followed: a batch before the next one was applied here
    for seq, payload in got:
        try:
            batch = decode_batch(payload)
        except Exception as e:
            refuse(e)
            continue
        if seq > expected and followed:   # a hole after what this gateway followed: its chain is broken
            index.engine_events_lost(backend_id, seq - expected)
        expected, followed = seq + 1, True
        _apply(backend_id, index, batch.events, refuse)
    if stop > expected and followed:
        index.engine_events_lost(backend_id, stop - expected)
    index.engine_events_replayed(backend_id, len(got), answered)


def _apply(backend_id: str, index: PrefixIndex, events: Sequence[KvEvent], refuse: Callable[[Exception], None]) -> (
    None
):
    try:
        index.engine_events(backend_id, events)
    except Exception as e:   # events the index cannot apply are counted, never fatal
        refuse(e)
