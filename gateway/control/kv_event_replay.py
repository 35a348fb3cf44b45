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

import zmq
import zmq.asyncio

from common.kv_events import KvEventError, decode_replay_reply, encode_sequence


async def replay(endpoint: str, start: int, stop: int, timeout_s: float) -> tuple[list[tuple[int, bytes]], bool]:
    """The batches numbered `start` to `stop` - 1 that the engine still holds, as (sequence number,
    payload) in order, and whether the replay ended as it should (False: what came before the timeout or
    a message that is no replay's).
    Batches before `start` or from `stop` on are dropped (those from `stop` on arrive live)."""
    socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if endpoint.startswith("tcp://["):
        socket.setsockopt(zmq.IPV6, 1)
    got: list[tuple[int, bytes]] = []
    try:
        socket.connect(endpoint)
        async with asyncio.timeout(timeout_s):
            await socket.send_multipart((b"", encode_sequence(start)))
            while (reply := decode_replay_reply(await socket.recv_multipart())) is not None:
                if start <= reply[0] < stop:
                    got.append(reply)
    except (TimeoutError, KvEventError, zmq.ZMQError):   # too slow, not a replay socket, not one to connect to
        return got, False
    finally:
        socket.close(linger=0)
    return got, True
