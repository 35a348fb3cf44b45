"""The vision engine's embedding cache: repeated images are not encoded again, bounded LRU, hits counted."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from backends.executors import EncodedImage
from backends.sim_encoder import SimulatedEncoder
from backends.vision_executor import VisionExecutor
from common.wire import engine_pb2
from tests.snapshots import catalog


class CountingEncoder:
    """The simulated encoder at no time scale, remembering which images it encoded."""

    def __init__(self) -> None:
        self._inner = SimulatedEncoder(catalog().model("llava-1.5-7b"), catalog().gpu("L40S"), time_scale=0.0)
        self.hidden = self._inner.hidden
        self.encoded: list[bytes] = []

    async def encode_batch(self, images: Sequence[engine_pb2.Image]) -> tuple[list[EncodedImage], float]:
        self.encoded += [img.data for img in images]
        return await self._inner.encode_batch(images)


def image(name: bytes) -> engine_pb2.Image:
    return engine_pb2.Image(data=name, width=336, height=336, tokens=576)


async def encode(vision: VisionExecutor, *names: bytes) -> list[engine_pb2.EncodeReply]:
    """Each name its own request, all in one aligned batch."""
    calls = [asyncio.ensure_future(vision.encode(engine_pb2.EncodeRequest(request_id=n.decode(), images=[image(n)])))
             for n in names]
    await asyncio.sleep(0)
    await vision.run_batch()
    return list(await asyncio.gather(*calls))


async def test_a_repeated_image_is_served_from_the_cache_and_counted() -> None:
    encoder = CountingEncoder()
    vision = VisionExecutor(encoder, lambda _to, _emb: asyncio.sleep(0), cache_images=2)
    first = await encode(vision, b"cat", b"dog", b"cat")   # the same image twice in a batch: encoded once
    assert encoder.encoded == [b"cat", b"dog"]
    assert [r.images_cached for r in first] == [0, 0, 1]   # the second "cat" rode on the first
    again = await encode(vision, b"cat")
    assert encoder.encoded == [b"cat", b"dog"]              # not encoded again
    assert again[0].images_cached == 1 and len(again[0].embeddings) == 1
    assert len(again[0].embeddings[0].data) == len(first[0].embeddings[0].data)   # a whole embedding
    assert (vision.embedding_cache_hits, vision.images_encoded) == (2, 2)


async def test_the_cache_keeps_the_most_recent_images_and_evicts_the_least_recent() -> None:
    encoder = CountingEncoder()
    vision = VisionExecutor(encoder, lambda _to, _emb: asyncio.sleep(0), cache_images=2)
    for name in (b"a", b"b", b"a", b"c"):   # "a" touched after "b": "b" is the one evicted by "c"
        await encode(vision, name)
    assert encoder.encoded == [b"a", b"b", b"c"]
    await encode(vision, b"a")
    await encode(vision, b"b")
    assert encoder.encoded == [b"a", b"b", b"c", b"b"]
    assert vision.embedding_cache_hits == 2


async def test_no_cache_encodes_every_image() -> None:
    encoder = CountingEncoder()
    vision = VisionExecutor(encoder, lambda _to, _emb: asyncio.sleep(0), cache_images=0)
    await encode(vision, b"a")
    await encode(vision, b"a")
    assert encoder.encoded == [b"a", b"a"] and (vision.embedding_cache_hits, vision.images_encoded) == (0, 2)


async def test_an_image_is_cached_only_under_its_requests_cache_salt() -> None:
    """Tenants kept apart (tenants.isolate_prefix_cache) share no embedding: the same image under another
    salt is encoded again, under the same salt it is a hit."""
    encoder = CountingEncoder()
    vision = VisionExecutor(encoder, lambda _to, _emb: asyncio.sleep(0), cache_images=4)
    cached = []
    for n, salt in enumerate(("tenant:a", "tenant:b", "tenant:a", "")):
        call = asyncio.ensure_future(vision.encode(engine_pb2.EncodeRequest(
            request_id=f"r{n}", images=[image(b"cat")], cache_salt=salt)))
        await asyncio.sleep(0)
        await vision.run_batch()
        cached.append((await call).images_cached)
    assert cached == [0, 0, 1, 0] and encoder.encoded == [b"cat"] * 3


async def test_a_request_of_cached_images_is_answered_without_waiting_for_a_batch() -> None:
    """Its images held, there is nothing to encode: it got its reply only when the next batch ran (after
    the batch window, 50 ms by default), as a miss does."""
    encoder = CountingEncoder()
    vision = VisionExecutor(encoder, lambda _to, _emb: asyncio.sleep(0), cache_images=4)
    await encode(vision, b"cat")
    call = asyncio.ensure_future(vision.encode(engine_pb2.EncodeRequest(request_id="again", images=[image(b"cat")])))
    reply = await asyncio.wait_for(call, 5)   # no run_batch: nothing queued for one
    assert reply.images_cached == 1 and len(reply.embeddings) == 1 and not vision.pending
    assert (vision.embedding_cache_hits, vision.backlog_tokens) == (1, 0)
    mixed = asyncio.ensure_future(vision.encode(engine_pb2.EncodeRequest(
        request_id="mixed", images=[image(b"cat"), image(b"dog")])))
    await asyncio.sleep(0)
    assert vision.pending and not mixed.done()   # one image to encode: it waits for its batch
    await vision.run_batch()
    assert (await mixed).images_cached == 1 and encoder.encoded == [b"cat", b"dog"]
