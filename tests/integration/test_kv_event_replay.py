"""The KV event listener's replays on real ZeroMQ sockets on 127.0.0.1: batches this gateway missed,
joining late or lost on the way, are asked for again on the engine's replay socket and applied in
order before the batch that showed them missing; what a replay cannot bring counts as lost.

The engine's side is the demo upstream's publisher (vLLM's PUB and replay ROUTER sockets), or, where a
test must lose a batch on the way, a PUB socket and a replay socket of the test's own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import zmq
import zmq.asyncio

from common.kv_events import REPLAY_END, BlockStored, encode_batch, encode_sequence
from gateway.config.cluster import KvEventsSpec
from gateway.control.kv_event_listener import listen
from gateway.demo_kv_cache import DemoKvCache, EventPublisher
from gateway.routing.prefix_index import PrefixIndex
from testkit.harness import free_port
from tests.integration.test_kv_event_listener import ids, until

pytestmark = pytest.mark.timeout(60)


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@asynccontextmanager
async def following(pub: str, replay: str | None = None, timeout_ms: int | None = None) -> AsyncIterator[PrefixIndex]:
    """A listener feeding a fresh index (backend "e") from `pub` (and `replay`), cancelled on leaving."""
    spec = KvEventsSpec(endpoint=pub, replay_endpoint=replay,
                        **({"replay_timeout_ms": timeout_ms} if timeout_ms is not None else {}))
    index = PrefixIndex(block_tokens=64)
    index.add_backend("e", 1_000_000)
    task = asyncio.create_task(listen("e", spec, index))
    try:
        yield index
        assert not task.done()   # whatever it was sent, the listener goes on
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def events(index: PrefixIndex) -> dict[str, Any]:
    return index.describe("e")["events"] or {}


def cached(index: PrefixIndex, prompt: list[int]) -> dict[str, int]:
    return index.lookup(index.hashes("", prompt, len(prompt)), "", len(prompt), True).cached


async def test_a_gateway_that_joins_late_learns_what_the_engine_stored_before() -> None:
    """Prompts the engine cached before the gateway subscribed: the first batch it receives is
    numbered above 0, the replay brings every earlier one, and the index holds their prompts."""
    pub, replay = endpoint(), endpoint()
    publisher = EventPublisher(pub, replay_endpoint=replay)
    cache = DemoKvCache(10_000, publisher)
    before = [ids(256, seed) for seed in range(6)]
    for prompt in before:
        cache.admit(prompt)
    try:
        async with following(pub, replay) as index:
            await until(lambda: events(index).get("replayed_batches") == 6)
            for prompt in before:
                assert cached(index, prompt) == {"e": 255}
            assert events(index)["lost_batches"] == 0 and events(index)["failed_replays"] == 0
    finally:
        publisher.close()


async def test_without_a_replay_socket_a_late_joiner_knows_only_what_came_live() -> None:
    """The same engine and prompts, no replay_endpoint on the entry: the index never hears of them."""
    pub = endpoint()
    publisher = EventPublisher(pub)
    cache = DemoKvCache(10_000, publisher)
    before = [ids(256, seed) for seed in range(6)]
    for prompt in before:
        cache.admit(prompt)
    try:
        async with following(pub) as index:
            seed = 100
            while not events(index).get("stored_blocks"):   # live batches until the subscription has joined
                cache.admit(ids(64, seed))
                seed += 1
                await asyncio.sleep(0.05)
            assert all(cached(index, prompt) == {} for prompt in before)
    finally:
        publisher.close()


async def test_a_gateway_that_joins_an_idle_engine_learns_its_whole_buffer_at_once() -> None:
    """An engine that publishes nothing more after the gateway subscribes: the listener's first replay
    brings all its 3,000 batches (past ZeroMQ's default queue of 1,000 messages), every prompt is found,
    the replay ended as it should, and nothing counts as lost."""
    pub, replay = endpoint(), endpoint()
    publisher = EventPublisher(pub, replay_endpoint=replay)
    cache = DemoKvCache(100_000, publisher)
    prompts = [ids(128, seed) for seed in range(3000)]   # 8 engine blocks each: one batch a prompt
    for prompt in prompts:
        cache.admit(prompt)
    try:
        async with following(pub, replay) as index:
            await until(lambda: events(index).get("replayed_batches") == 3000)
            assert all(cached(index, prompt) == {"e": 127} for prompt in prompts[::100])
            assert events(index)["failed_replays"] == 0 and events(index)["lost_batches"] == 0
    finally:
        publisher.close()


class Engine:
    """A PUB socket and a replay ROUTER socket whose buffer the test controls: `publish` sends a batch
    and keeps it, `lose` keeps it without sending (lost on the way)."""

    def __init__(self, buffer_from: int = 0, answer: bool = True, shuffled: bool = False) -> None:
        context = zmq.asyncio.Context.instance()
        self.pub_endpoint, self.replay_endpoint = endpoint(), endpoint()
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(self.pub_endpoint)
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if answer:
            self.router.bind(self.replay_endpoint)
        self.kept: list[tuple[int, bytes]] = []
        self.buffer_from = buffer_from   # the oldest batch still buffered
        self.requests: list[int] = []
        self.shuffled = shuffled   # replies out of order, one of them twice (not as vLLM sends them)
        self.server = asyncio.create_task(self._serve())

    def restart(self, first_block: int) -> None:
        """A new engine on the same sockets: nothing buffered, numbered from 0 again, its block names
        from `first_block` on."""
        self.kept = []
        self.names = first_block

    names = 0

    def batch(self, seq: int, prompt: list[int], parent: int | None) -> bytes:
        first = self.names + 1000 * seq
        payload = encode_batch(1.0, [BlockStored(list(range(first, first + len(prompt) // 16)), parent, prompt, 16)])
        self.kept.append((seq, payload))
        return payload

    async def publish(self, seq: int, prompt: list[int], parent: int | None = None) -> None:
        await self.pub.send_multipart((b"", encode_sequence(seq), self.batch(seq, prompt, parent)))

    def lose(self, seq: int, prompt: list[int], parent: int | None = None) -> None:
        self.batch(seq, prompt, parent)

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            replies = [(seq, payload) for seq, payload in self.kept
                       if seq >= max(self.buffer_from, int.from_bytes(start, "big"))]
            if self.shuffled and replies:
                replies = replies[::-1] + replies[:1]
            for seq, payload in replies:
                await self.router.send_multipart((client, b"", encode_sequence(seq), payload))
            await self.router.send_multipart((client, b"", REPLAY_END, b""))

    async def close(self) -> None:
        self.server.cancel()
        await asyncio.gather(self.server, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def joined(engine: Engine, index: PrefixIndex) -> int:
    """Live batches from 0 until the listener has one; returns the next sequence number."""
    seq = 0
    while not events(index).get("stored_blocks"):
        await engine.publish(seq, ids(64, 500 + seq))
        seq += 1
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    return seq


@asynccontextmanager
async def engine_followed(timeout_ms: int | None = None, shuffled: bool = False) -> (
    AsyncIterator[tuple[Engine, PrefixIndex, int]]
):
    """An engine of the test's, a listener following it, and the next sequence number once it has joined."""
    engine = Engine(shuffled=shuffled)
    try:
        async with following(engine.pub_endpoint, engine.replay_endpoint, timeout_ms) as index:
            yield engine, index, await joined(engine, index)
    finally:
        await engine.close()


@pytest.mark.parametrize("shuffled", [False, True], ids=["in-order", "out-of-order-and-twice"])
async def test_batches_lost_on_the_way_are_replayed_in_order_before_the_next(shuffled: bool) -> None:
    """Two batches lost between two sent: the replay brings them (in order, or out of order with one of
    them twice: applied once each, in order); the second continues the first's chain, so the index holds
    the whole prompt, and nothing counts as lost."""
    async with engine_followed(shuffled=shuffled) as (engine, index, seq):
        replayed = events(index)["replayed_batches"]   # the first live ones the subscription missed, if any
        prompt = ids(512, 7)
        engine.lose(seq, prompt[:256])
        engine.lose(seq + 1, prompt[256:384], parent=1000 * seq + 15)
        await engine.publish(seq + 2, prompt[384:], parent=1000 * (seq + 1) + 7)
        await until(lambda: events(index)["replayed_batches"] == replayed + 2)
        assert cached(index, prompt) == {"e": 511}
        assert engine.requests[-1] == seq - 1   # from the last batch applied, which shows the same engine
        assert events(index)["lost_batches"] == 0 and events(index)["unmatched_blocks"] == 0


async def test_what_the_replay_cannot_bring_counts_as_lost() -> None:
    """The engine's buffer no longer holds the first lost batch: it counts as lost, the one it holds is
    applied; then a replay socket that never answers: after replay_timeout_ms, every batch missing is
    lost, and the listener goes on with the next."""
    async with engine_followed(timeout_ms=300) as (engine, index, seq):
        replayed = events(index)["replayed_batches"]
        engine.lose(seq, ids(256, 8))
        kept = ids(256, 9)
        engine.lose(seq + 1, kept)
        engine.buffer_from = seq + 1
        await engine.publish(seq + 2, ids(64, 10))
        await until(lambda: events(index)["replayed_batches"] == replayed + 1)
        assert events(index)["lost_batches"] == 1 and cached(index, kept) == {"e": 255}
        engine.router.close(linger=0)   # no replay socket any more
        engine.lose(seq + 3, ids(256, 11))
        await engine.publish(seq + 4, ids(64, 12))
        await until(lambda: events(index)["lost_batches"] == 2)
        assert events(index)["failed_replays"] == 1
        last = ids(256, 13)
        await engine.publish(seq + 5, last)
        await until(lambda: cached(index, last) == {"e": 255})


@pytest.mark.parametrize("missed", [2, 12])
async def test_an_engine_restarted_behind_missed_batches_is_cleared_and_replayed_from_its_start(missed: int) -> None:
    """The engine restarts (numbered from 0 again, its cache empty) and the gateway misses its first
    `missed` batches: the next one's number is below the last applied (2, under 5 or more), or above it
    and the replay asked from the last applied holds another batch under that number (12). Either way the old engine's
    blocks are dropped, the new engine's missed batches replayed, and nothing counts as lost."""
    async with engine_followed() as (engine, index, seq):
        old, last = ids(256, 40), max(seq, 5)   # the old engine's last applied batch: 5 or more
        for k in range(seq, last + 1):
            await engine.publish(k, old if k == last else ids(64, 600 + k))
        await until(lambda: cached(index, old) == {"e": 255})
        engine.restart(first_block=1_000_000)
        new = [ids(256, 50 + k) for k in range(missed)]
        for k, prompt in enumerate(new):
            engine.lose(k, prompt)
        await engine.publish(missed, ids(64, 70))
        await until(lambda: events(index)["cleared"] == 1 and all(cached(index, p) == {"e": 255} for p in new))
        assert cached(index, old) == {} and events(index)["lost_batches"] == 0
