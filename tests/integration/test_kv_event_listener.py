"""The gateway's KV event listener on a real ZeroMQ socket on 127.0.0.1: the test publishes as an engine
would, batches good and bad, and the prefix index behind the listener follows the good ones; a message
that is no batch (or that msgpack cannot even decode) is counted and the next one is read; sequence
numbers say what was lost, repeated or restarted."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest
import zmq

from common.kv_events import AllBlocksCleared, BlockStored, encode_batch, encode_sequence
from gateway.config.cluster import KvEventsSpec
from gateway.control.kv_event_listener import listen
from gateway.routing.prefix_index import PrefixIndex
from testkit.harness import free_port

pytestmark = pytest.mark.timeout(60)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 32000) for _ in range(n)]


async def until(predicate: Callable[[], bool]) -> None:
    """Poll `predicate` (the index is a plain object: nothing to wait on) for up to 10 s."""
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


async def test_the_listener_follows_good_batches_and_outlives_bad_messages() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    index = PrefixIndex(block_tokens=64)
    index.add_backend("e", 100_000)
    task = asyncio.create_task(listen("e", KvEventsSpec(endpoint=endpoint), index))

    def send(seq: int, *events: object, payload: bytes | None = None) -> None:
        pub.send_multipart([b"", encode_sequence(seq), payload or encode_batch(1.0, events)])   # type: ignore[arg-type]

    def stats() -> dict[str, int]:
        return index.describe("e")["events"] or {}

    try:
        seq = 0
        while not stats().get("stored_blocks"):   # the subscription joins a moment after the connect
            seq += 1
            send(seq, BlockStored(list(range(seq * 10, seq * 10 + 4)), None, ids(64, seq), 16))
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        before = stats()["stored_blocks"]
        prompt = ids(256, 99)
        send(seq + 1, payload=b"\x92\x00\x91\x81\x91\x01\x01")   # msgpack that no Python dict can hold
        send(seq + 1, payload=b"not a batch")
        send(seq + 1, BlockStored([101, 102, 103, 104], None, prompt[:64], 16))
        send(seq + 1, BlockStored([101, 102, 103, 104], None, prompt[:64], 16))   # the same batch again: skipped
        send(seq + 2, BlockStored([91, 92, 93, 94], None, ids(64, 1234), 16))
        await until(lambda: stats()["stored_blocks"] == before + 8)
        assert stats()["refused_messages"] == 2 and "not msgpack" in (stats()["last_refused"] or "")
        send(seq + 5, BlockStored([105, 106, 107, 108], 104, prompt[64:128], 16))   # 2 batches lost
        await until(lambda: stats()["lost_batches"] == 2)
        assert stats()["unmatched_blocks"] == 4   # it continued a chain the gap made the index forget
        hashes = index.hashes("", prompt, 256)
        assert index.lookup(hashes, "", 256, True).cached == {"e": 64}
        send(0, BlockStored([201, 202, 203, 204], None, ids(64, 7), 16))   # numbered from 0: a new engine
        await until(lambda: stats()["cleared"] == 1)
        assert index.lookup(hashes, "", 256, True).cached == {}
        send(1, AllBlocksCleared())
        await until(lambda: stats()["cleared"] == 2)
        assert stats()["stored_blocks"] == before + 12 and stats()["refused_messages"] == 2
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close(linger=0)
