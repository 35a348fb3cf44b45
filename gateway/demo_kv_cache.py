"""The demo upstream's prefix cache and its KV events (`gateway demo-upstream --kv-events-endpoint ...`):
what a vLLM engine with automatic prefix caching and `--kv-events-config` tells the world, without a GPU.

Prompts given as token ids are cached in blocks of 16 tokens (vLLM's default), each named by a chained
hash, least recently used first out past `blocks` blocks; a prompt's leading blocks found cached are its
`cached_tokens` (never the whole prompt: the last token is computed), and its new blocks are stored.
Every store, eviction and reset (`POST /reset_prefix_cache`, as vLLM's) is published as vLLM publishes
it: a ZeroMQ PUB socket bound to the endpoint, one batch a request (common/kv_events.py), and the
cache's counters are vLLM's `prefix_cache_queries` / `prefix_cache_hits` in /metrics. What it leaves
out: text prompts (it has no tokenizer: they are neither cached nor published) and blocks pinned by
running requests. `--kv-replay-endpoint` binds the replay socket vLLM's `replay_endpoint` does, which
sends the last 10,000 batches again to a subscriber that missed them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

import zmq

from common.kv_events import (
    REPLAY_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    encode_batch,
    encode_sequence,
)
from common.prefix_blocks import block_hashes

BLOCK_SIZE = 16
REPLAY_BUFFER = 10_000   # batches kept for the replay socket (vLLM's buffer_steps default)


class EventPublisher:
    """A ZeroMQ PUB socket bound to `endpoint`, sending batches as vLLM's ZmqEventPublisher does; with
    `replay_endpoint`, a ROUTER socket bound there sends the last `buffer` batches again on request, as
    vLLM's replay socket does (common/kv_events.py), served by a thread of its own."""

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None,
                 buffer: int = REPLAY_BUFFER) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket: zmq.Socket[bytes] = context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._topic = topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._lock = threading.Lock()   # the buffer, between publish (the server's loop) and the replay thread
        self._running = True
        self._replay: threading.Thread | None = None
        if replay_endpoint is not None:
            router: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 0)   # a replay of its whole buffer is not cut at 1,000 messages
            try:
                router.bind(replay_endpoint)
            except zmq.ZMQError:
                router.close(linger=0)
                self._socket.close(linger=0)
                raise
            self._replay = threading.Thread(target=self._serve_replays, args=(router,), name="kv-replay", daemon=True)
            self._replay.start()

    def publish(self, events: Sequence[KvEvent]) -> None:
        payload = encode_batch(time.time(), events)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        self._socket.send_multipart((self._topic, encode_sequence(seq), payload), flags=zmq.NOBLOCK)

    def _serve_replays(self, router: zmq.Socket[bytes]) -> None:
        """Answer replay requests until closed: every buffered batch from the sequence number asked, then
        the end marker. A request that is not one frame of 8 bytes gets the end marker alone."""
        try:
            while self._running:
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                client, start = frames[0], frames[-1]
                with self._lock:
                    batches = list(self._buffer)
                if len(frames) == 3 and not frames[1] and len(start) == 8:
                    first = int.from_bytes(start, "big")
                    for seq, payload in batches:
                        if seq >= first:
                            router.send_multipart((client, b"", encode_sequence(seq), payload))
                router.send_multipart((client, b"", REPLAY_END, b""))
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._running = False
        if self._replay is not None:
            self._replay.join()
        self._socket.close(linger=0)


class DemoKvCache:
    def __init__(self, blocks: int, publisher: EventPublisher | None) -> None:
        self.capacity = blocks
        self._publisher = publisher
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0   # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0      # of them, found cached

    def admit(self, token_ids: Sequence[int]) -> int:
        """A prompt of token ids is served: its cached tokens; its blocks stored, the least recent evicted."""
        hashes = block_hashes(token_ids=token_ids, block_tokens=BLOCK_SIZE)
        blocks = self._blocks
        matched = 0
        for h in hashes:
            if h not in blocks:
                break
            matched += 1
        cached = min(matched * BLOCK_SIZE, max(0, len(token_ids) - 1))
        self.queries += len(token_ids)
        self.hits += cached
        events: list[KvEvent] = []
        if new := hashes[matched:]:
            events.append(BlockStored(new, hashes[matched - 1] if matched else None,
                                      list(token_ids[matched * BLOCK_SIZE:len(hashes) * BLOCK_SIZE]), BLOCK_SIZE,
                                      None, "GPU"))
        for h in reversed(hashes):   # the prompt's first blocks the most recent: they go last, as vLLM frees them
            blocks[h] = None
            blocks.move_to_end(h)
        evicted = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        if evicted:
            events.append(BlockRemoved(evicted, "GPU"))
        if events and self._publisher is not None:
            self._publisher.publish(events)
        return cached

    def reset(self) -> None:
        """Every block dropped (vLLM's POST /reset_prefix_cache)."""
        self._blocks.clear()
        if self._publisher is not None:
            self._publisher.publish([AllBlocksCleared()])
