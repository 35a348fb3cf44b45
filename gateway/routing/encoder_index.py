"""Which vision encoder got which image: the vision pool's half of cache-aware routing.

A vision engine keeps the embeddings of the images it encoded last, keyed by their content hash
(`backends.vision_executor`), and does not encode them again. The gateway remembers, per encoder,
the content digests (`ImageInput.digest`) of the images it sent there, in an LRU of at most
`images_per_encoder` (`gateway.routing.prefix_cache.images_per_encoder`, the engines' default
`--embedding-cache-images`), or of the size the engine reports for its cache where that is smaller
(`embedding_cache_images` in its heartbeats; 0: it keeps none, and no hit is predicted there), and
predicts a hit where an image's digest is still in an encoder's LRU. `encode_cost` prices a
predicted hit as no encode on that encoder, so a repeated image goes back
to the encoder that holds it unless its queue costs more than encoding the image elsewhere.

Cost: O(images of the request + encoders holding them) a lookup, O(images) a record. Memory: at most
`images_per_encoder` digests an encoder (about 100 bytes each, the LRU and the holders map).
Replicas (`share`, with `--redis-url`): each replica publishes which encoder it sent which images
to and applies the others' (gateway.replicas.shared_state, the prefix stream, every refresh).

A restarted engine has an empty cache: the index keeps the process id each encoder reported when it
was sent images (`record`, `observe`), and forgets an encoder's images once it reports another one
(checked for the encoders predicted to hold a request's images, before the prediction is used, and at
each record, which also applies the cache size the engine reports).

Limits: a prediction, not the engine's own list: the LRU's order is the order images were sent in,
and an engine that evicts otherwise, or an engine that does not report its cache size and keeps fewer
than `images_per_encoder`, misses where the index predicts a hit (its hits are reported,
`embedding_cache_hits` in /admin/backends, but not compared with the prediction); a restart or a new
size is seen once the engine has reported it (a heartbeat); replicas learn each other's images a
refresh late; an encoder removed from the fleet keeps its entries until its LRU would evict them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from common.prefix_blocks import BlockLru

ImageRef = tuple[int, int]   # (content digest, image tokens)
Sent = tuple[str, list[int]]  # (encoder, content digests)


class EncoderIndex:
    def __init__(self, images_per_encoder: int = 256) -> None:
        self.images_per_encoder = images_per_encoder
        self._lru: dict[str, BlockLru] = {}
        self._holders: dict[int, set[str]] = {}   # digest -> encoders whose LRU holds it
        self._sent: deque[Sent] | None = None      # this process's records not yet shared (`share`)
        self._pids: dict[str, int] = {}            # encoder -> the engine process its entries were sent to
        self._sizes: dict[str, int] = {}           # encoder -> its LRU's size, its engine's cache being smaller

    def share(self, max_pending: int) -> None:
        """Replicas share which encoder got which image: from now on each record is kept for the next
        publication (at most `max_pending`, the oldest dropped first)."""
        self._sent = deque(maxlen=max_pending)

    def take_sent(self) -> list[Sent]:
        """The records since the last call (for the other replicas)."""
        sent = self._sent
        if not sent:
            return []
        out = list(sent)
        sent.clear()
        return out

    def cached(self, images: Sequence[ImageRef]) -> dict[str, int]:
        """Per encoder, the image tokens of these images it is predicted to hold (only encoders with a hit)."""
        out: dict[str, int] = {}
        holders = self._holders
        for digest, tokens in images:
            for encoder in holders.get(digest, ()):
                out[encoder] = out.get(encoder, 0) + tokens
        return out

    def observe(self, encoder: str, pid: int, cache_images: int | None = None) -> bool:
        """`encoder`'s engine reports process `pid` (0: unknown) and a cache of at most `cache_images`
        embeddings (None: not said). Another process than the one its images went to: it restarted with
        an empty cache, and its entries are forgotten. A cache smaller than `images_per_encoder`: its
        LRU keeps that many, its least recent entries forgotten. True when any entry was forgotten."""
        forgot = False
        if cache_images is not None:
            size = min(cache_images, self.images_per_encoder)
            if self._sizes.get(encoder, self.images_per_encoder) != size:
                self._sizes[encoder] = size
                lru = self._lru.get(encoder)
                forgot = lru is not None and self._forget(encoder, lru.resize(size))
        if not pid:
            return forgot
        known = self._pids.get(encoder)
        self._pids[encoder] = pid
        if known is None or known == pid:
            return forgot
        lru = self._lru.pop(encoder, None)
        return self._forget(encoder, lru.resize(0) if lru is not None else []) or forgot

    def _forget(self, encoder: str, digests: Sequence[int]) -> bool:
        """`encoder` no longer holds `digests`. True when there were any."""
        holders = self._holders
        for digest in digests:
            held = holders[digest]
            held.discard(encoder)
            if not held:
                del holders[digest]
        return bool(digests)

    def record(self, images: Sequence[ImageRef], encoder: str, pid: int = 0, cache_images: int | None = None) -> None:
        """These images were sent to `encoder` to encode (its engine process `pid`, 0: unknown, and the
        size it reports for its cache, None: not said): it holds them next."""
        self.observe(encoder, pid, cache_images)
        digests = [digest for digest, _ in images]
        self.peer_sent(encoder, digests)
        if self._sent is not None:
            self._sent.append((encoder, digests))

    def peer_sent(self, encoder: str, digests: Sequence[int]) -> None:
        """`encoder` got these images (from this replica, or another one)."""
        lru = self._lru.get(encoder)
        if lru is None:
            lru = self._lru[encoder] = BlockLru(self._sizes.get(encoder, self.images_per_encoder))
        added, evicted = lru.touch(digests)
        holders = self._holders
        for digest in added:
            holders.setdefault(digest, set()).add(encoder)
        self._forget(encoder, evicted)

    def held(self, encoder: str) -> int:
        """Images the index counts as cached on `encoder`."""
        lru = self._lru.get(encoder)
        return len(lru) if lru is not None else 0
