"""Which vision encoder got which image: the vision pool's half of cache-aware routing.

A vision engine keeps the embeddings of the images it encoded last, keyed by their content hash
(`backends.vision_executor`), and does not encode them again. The gateway remembers, per encoder,
the content digests (`ImageInput.digest`) of the images it sent there, in an LRU of at most
`images_per_encoder` (`gateway.routing.prefix_cache.images_per_encoder`, the engines' default
`--embedding-cache-images`), and predicts a hit where an image's digest is still in an encoder's
LRU. `encode_cost` prices a predicted hit as no encode on that encoder, so a repeated image goes back
to the encoder that holds it unless its queue costs more than encoding the image elsewhere.

Cost: O(images of the request + encoders holding them) a lookup, O(images) a record. Memory: at most
`images_per_encoder` digests an encoder (about 100 bytes each, the LRU and the holders map).
Limits: a prediction, not the engine's own list: an engine configured with a smaller cache, or
restarted, misses where the index predicts a hit (the engine reports its hits, `embedding_cache_hits`
in /admin/backends, but the index does not learn from them yet); only this gateway's requests are
seen; an encoder removed from the fleet keeps its entries until its LRU would evict them.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.prefix_blocks import BlockLru

ImageRef = tuple[int, int]   # (content digest, image tokens)


class EncoderIndex:
    def __init__(self, images_per_encoder: int = 256) -> None:
        self.images_per_encoder = images_per_encoder
        self._lru: dict[str, BlockLru] = {}
        self._holders: dict[int, set[str]] = {}   # digest -> encoders whose LRU holds it

    def cached(self, images: Sequence[ImageRef]) -> dict[str, int]:
        """Per encoder, the image tokens of these images it is predicted to hold (only encoders with a hit)."""
        out: dict[str, int] = {}
        holders = self._holders
        for digest, tokens in images:
            for encoder in holders.get(digest, ()):
                out[encoder] = out.get(encoder, 0) + tokens
        return out

    def record(self, images: Sequence[ImageRef], encoder: str) -> None:
        """These images were sent to `encoder` to encode: it holds them next."""
        lru = self._lru.get(encoder)
        if lru is None:
            lru = self._lru[encoder] = BlockLru(self.images_per_encoder)
        added, evicted = lru.touch([digest for digest, _ in images])
        holders = self._holders
        for digest in added:
            holders.setdefault(digest, set()).add(encoder)
        for digest in evicted:
            held = holders[digest]
            held.discard(encoder)
            if not held:
                del holders[digest]

    def held(self, encoder: str) -> int:
        """Images the index counts as cached on `encoder`."""
        lru = self._lru.get(encoder)
        return len(lru) if lru is not None else 0
