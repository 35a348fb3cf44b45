"""Asking an engine's replay socket for the KV event batches this gateway missed.

vLLM's and SGLang's publisher keeps its last batches (vLLM: `buffer_steps`, 10,000) and, where started
with a `replay_endpoint`, sends them again on request (common/kv_events.py has the wire format). The
listener (gateway/control/kv_event_listener.py) asks when it joins a publisher that has published
before, and when sequence numbers jump (batches lost on the way, or dropped by a full queue).

A DEALER socket, new for each replay and closed after it: the engine's ROUTER sends one message per
batch and a REQ socket takes one reply only; a replay cut short by the timeout leaves no late answers
on a socket used again. The whole replay is bounded by one timeout: an engine without a replay socket
there (ZeroMQ connects in the background and waits) costs the listener that long, once per gap.
"""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from common.kv_events import KvEventError, decode_replay_reply, encode_sequence

YIELD_AFTER_S = 0.005   # a replay reads or applies batches for this long at most before it lets requests run


async def replay(endpoint: str, start: int, stop: int | None, timeout_s: float) -> (
    tuple[list[tuple[int, bytes]], bool]
):
    """The batches numbered `start` to `stop` - 1 (None: all from `start`) that the engine still holds, as
    (sequence number, payload) in order, each once, and whether the replay ended as it should (False:
    what came before the timeout or a message that is no replay's). Batches before `start` or from
    `stop` on are dropped (those from `stop` on arrive live)."""
    socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    # No limit on this end: with ZeroMQ's default of 1,000 queued messages here, the engine's ROUTER dropped
    # most of a longer replay, its end marker included. Its own send limit stays (vLLM keeps the default):
    # a replay faster than this end reads can still lose batches there, which count as lost.
    socket.setsockopt(zmq.RCVHWM, 0)
    if endpoint.startswith("tcp://["):
        socket.setsockopt(zmq.IPV6, 1)
    got: dict[int, bytes] = {}
    answered = True
    try:
        socket.connect(endpoint)
        async with asyncio.timeout(timeout_s):
            await socket.send_multipart((b"", encode_sequence(start)))
            since = time.perf_counter()
            while (reply := decode_replay_reply(await socket.recv_multipart())) is not None:
                seq, payload = reply
                if start <= seq and (stop is None or seq < stop):
                    got[seq] = payload
                if time.perf_counter() - since > YIELD_AFTER_S:   # messages queued already come without a wait
                    await asyncio.sleep(0)
                    since = time.perf_counter()
    except (TimeoutError, KvEventError, zmq.ZMQError):   # too slow, not a replay socket, not one to connect to
        answered = False
    finally:
        socket.close(linger=0)
    return sorted(got.items()), answered
