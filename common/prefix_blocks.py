"""Prefix-cache blocks: chained block hashes of a prompt, an LRU of them, and an engine's block cache.

An engine with automatic prefix caching (vLLM, SGLang) keeps a prompt's KV in fixed blocks of tokens,
each named by a hash of its tokens and of the hash of the block before it, so a block is reused only
when everything before it is the same too. The gateway's prefix index and the simulated engines name
blocks the same way:

- from token ids where the prompt has them: `block_tokens` ids a block (16, vLLM's default);
- else from the rendered prompt text: `block_tokens · BYTES_PER_TOKEN` UTF-8 bytes a block (64), the
  gateway's estimate of 4 bytes a token. An approximation: a tokenizer's block boundaries fall
  elsewhere, but two prompts share a prefix of blocks exactly when they share that many leading bytes,
  and a block of 64 bytes stands for about 16 tokens.

Only full blocks are hashed (an engine caches full blocks only), and a hit never covers the whole
prompt: the last token is always computed (`cached_tokens`).

Hashes are Python's `hash((previous, block))`: about 0.15 µs a block, and deterministic for token ids
but seeded per process for text (bytes hashing is randomised), so such hashes are compared only within
one process. `stable=True` hashes a text block as the integer its bytes spell (`int.from_bytes`; int
and tuple hashing are not randomised): the same hashes in every process of the same CPython, which is
what replicas that share their index need (gateway.replicas.shared_state), at about twice the cost.
Not collision-resistant against crafted input: a collision makes a router predict a hit that is not
there (a routing error, never a wrong answer; a real engine keys its own cache with its own hash).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from itertools import chain, islice

BLOCK_TOKENS = 16      # tokens a KV block holds (vLLM's default block size)
BYTES_PER_TOKEN = 4    # the gateway's token estimate for text (gateway.requests.tokens)
KEPT_SLICES = 2048     # blocks of a prompt whose slice objects are made once and kept, per block size


def content_digest(data: bytes) -> int:
    """An image's content hash: the first 8 bytes of its BLAKE2b, as an int. The same in every process
    (gateway, engines, replicas), unlike `hash`, and collision-resistant: two images share a digest only
    when their bytes are the same. About 1 ms a megabyte."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _image_chain(previous: int, digest: int, tokens: int, block_tokens: int, lead: object, out: list[int]) -> int:
    """Append an image's blocks to `out`, chained from `previous`; returns the last. `lead`: the text
    before it that filled no block of its own (None: none), which shares the image's first block in
    the engine's cache, so it names that block too."""
    for k in range(max(1, tokens // block_tokens)):
        previous = hash((previous, digest, k) if k or lead is None else (previous, lead, digest, k))
        out.append(previous)
    return previous


def block_hashes(text: str = "", token_ids: Sequence[int] = (), *, block_tokens: int = BLOCK_TOKENS,
                 max_blocks: int | None = None, stable: bool = False, salt: int = 0) -> list[int]:
    """The chained hashes of the prompt's full blocks, first block first: from `token_ids` when given,
    else from `text`. At most `max_blocks` (None: all). `stable`: text hashes the same in every process.
    `salt` (`salt_seed`): the chain starts from it, so prompts of different salts share no block."""
    out: list[int] = []
    previous = salt
    if token_ids:
        count = len(token_ids) // block_tokens
        if max_blocks is not None:
            count = min(count, max_blocks)
        _id_chain(tuple(token_ids[:count * block_tokens]), count, block_tokens, previous, out)
        return out
    data = text.encode()
    size = block_tokens * BYTES_PER_TOKEN
    count = len(data) // size
    if max_blocks is not None:
        count = min(count, max_blocks)
    _text_chain(data, count, size, previous, stable, out)
    return out


def _id_chain(ids: tuple[int, ...], count: int, block_tokens: int, previous: int, out: list[int]) -> int:
    """Append the hashes of the first `count` blocks of `ids` to `out`, chained from `previous`; returns
    the last (`previous` when none)."""
    for block in _block_slices(block_tokens, count):
        previous = hash((previous, ids[block]))
        out.append(previous)
    return previous


def _text_chain(data: bytes, count: int, size: int, previous: int, stable: bool, out: list[int]) -> int:
    """Append the hashes of `data`'s first `count` blocks of `size` bytes to `out`, chained from
    `previous`; returns the last (`previous` when none)."""
    if stable:
        from_bytes = int.from_bytes
        for block in _block_slices(size, count):
            previous = hash((previous, from_bytes(data[block], "little")))
            out.append(previous)
        return previous
    for block in _block_slices(size, count):
        previous = hash((previous, data[block]))
        out.append(previous)
    return previous


def _block_slices(size: int, count: int) -> Iterator[slice]:
    """The slices of a sequence's first `count` blocks of `size` items (none for a count below 1). Those
    of the first KEPT_SLICES blocks are made once per size and kept (0.26 MB a size): indexing with a
    kept slice spares each block the slice's construction (bytecode that cost a sixth of hashing a
    256-byte block); the rest, for prompts longer than that, are made as they come."""
    kept = _kept_slices(size)
    if count <= KEPT_SLICES:
        return islice(kept, max(0, count))
    return chain(kept, (slice(start, start + size) for start in range(KEPT_SLICES * size, count * size, size)))


@lru_cache(maxsize=8)
def _kept_slices(size: int) -> tuple[slice, ...]:
    return tuple([slice(start, start + size) for start in range(0, KEPT_SLICES * size, size)])


def prompt_blocks(text: str, token_ids: Sequence[int], prompt_tokens: int, images: Sequence[tuple[int, int, int]] = (),
                  *, block_tokens: int = BLOCK_TOKENS, stable: bool = False, salt: int = 0) -> list[int]:
    """A prompt's chained block hashes, at most the blocks its `prompt_tokens` (text and image tokens)
    fill. `images`: (content digest, image tokens, place) in order, the place being the bytes of `text`
    before the image (where the chat puts it), or with `token_ids` the start of the image's run of
    placeholder ids in them. Each image's blocks come at its place, after the full blocks of the text
    before it, as an engine lays out a prompt (the text's last partial block shares the image's first
    block and names it too; the image's placeholder ids are not hashed, its digest stands for them): a
    system prompt shared ahead of different images is a shared prefix. `salt`: as `block_hashes`."""
    limit = prompt_tokens // block_tokens
    if limit < 1:   # it fills no block: nothing to hash
        return []
    if not images:
        return block_hashes(text, token_ids, block_tokens=block_tokens, max_blocks=limit, stable=stable, salt=salt)
    if token_ids:
        return _placed_id_chain(tuple(token_ids), images, block_tokens, limit, salt)
    data = text.encode()
    size = block_tokens * BYTES_PER_TOKEN
    out: list[int] = []
    previous, start = salt, 0
    for digest, tokens, place in images:
        place = min(max(place, start), len(data))
        full = (place - start) // size
        previous = _text_chain(data[start:], full, size, previous, stable, out)
        start += full * size
        lead = data[start:place]   # under a block: part of the image's first block
        key = None if not lead else int.from_bytes(lead, "little") if stable else lead
        previous = _image_chain(previous, digest, tokens, block_tokens, key, out)
        start = place
        if len(out) >= limit:
            return out[:limit]
    _text_chain(data[start:], min(limit - len(out), (len(data) - start) // size), size, previous, stable, out)
    return out


def _placed_id_chain(ids: tuple[int, ...], images: Sequence[tuple[int, int, int]], block_tokens: int,
                     limit: int, salt: int) -> list[int]:
    """`prompt_blocks` from token ids: the ids before each image in full blocks, the image named by its
    digest (with the ids of a partial block before it), the ids after its placeholder run, at most
    `limit` blocks."""
    out: list[int] = []
    previous, start = salt, 0
    for digest, tokens, place in images:
        place = min(max(place, start), len(ids))
        full = (place - start) // block_tokens
        previous = _id_chain(ids[start:], full, block_tokens, previous, out)
        start += full * block_tokens
        previous = _image_chain(previous, digest, tokens, block_tokens, ids[start:place] or None, out)
        start = place + tokens
        if len(out) >= limit:
            return out[:limit]
    _id_chain(ids[start:], min(limit - len(out), max(0, len(ids) - start) // block_tokens), block_tokens, previous,
              out)
    return out


def salted_digest(digest: int, salt: str) -> int:
    """An image's content digest under a cache salt ("" none: the digest itself): the gateway's indexes
    and the vision engines' embedding caches key an image so, and share nothing across salts."""
    return content_digest(salt.encode() + b"\0" + digest.to_bytes(8, "big")) if salt else digest


def salt_seed(salt: str) -> int:
    """Where a prompt's chain of blocks starts for a cache salt (vLLM's `cache_salt`): 0 for none, else
    a content digest of it (the same in every process). Requests of different salts share no block."""
    return content_digest(salt.encode()) if salt else 0


def cached_tokens(hit_tokens: int, prompt_tokens: int) -> int:
    """Prompt tokens a hit of `hit_tokens` (leading blocks × block size) saves: never the last token
    (it is computed to produce the first output token)."""
    return max(0, min(hit_tokens, prompt_tokens - 1))


def session_key(session: str, *, stable: bool = False) -> int:
    """The key a named session takes among block hashes (its own namespace); `stable`: the same in
    every process (a content digest of its name)."""
    if stable:
        return hash((-1, content_digest(session.encode())))
    return hash(("session", session))


class BlockLru:
    """Block hashes (each with an int value, 0 for a plain block) in least-recently-used order, at most
    `capacity` of them. O(1) per block touched; about 100 bytes a block."""

    __slots__ = ("_order", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._order: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: object) -> bool:
        return block in self._order

    def get(self, block: int) -> int | None:
        """The block's value, None when absent (does not touch it)."""
        return self._order.get(block)

    def touch(self, blocks: Sequence[int], value: int = 0) -> tuple[list[int], list[int]]:
        """Make `blocks` the most recent, later blocks first so that a prefix's first blocks go last
        (as vLLM frees a sequence's blocks tail first); set each one's value (a value of 0 leaves a held
        block's value as it was: plain blocks are 0). Returns (the blocks that
        were not held before, the blocks evicted to stay within capacity), in that order of effect."""
        order, move = self._order, self._order.move_to_end
        added: list[int] = []
        for block in reversed(blocks):
            if block in order:
                move(block)
            else:
                order[block] = value
                added.append(block)
        if value:   # a session's key (its prompt's length): set here, so the loop tests nothing more for a block
            for block in blocks:
                order[block] = value
        return added, self._evict(self.capacity) if len(order) > self.capacity else []

    def discard(self, block: int) -> bool:
        return self._order.pop(block, None) is not None

    def resize(self, capacity: int) -> list[int]:
        """Set the capacity; returns the blocks evicted to meet it, least recent first."""
        self.capacity = max(0, capacity)
        return self._evict(self.capacity)

    def _evict(self, capacity: int) -> list[int]:
        """The least recent blocks beyond `capacity` out, least recent first (listed, then deleted: half
        what popping them one by one cost)."""
        order = self._order
        evicted = list(islice(order, max(0, len(order) - capacity)))
        for block in evicted:
            del order[block]
        return evicted

    def blocks(self) -> Iterable[int]:
        """Least recent first."""
        return iter(self._order)


class EnginePrefixCache:
    """An engine's automatic prefix cache, block by block, as vLLM keeps it.

    A running sequence pins its prompt's blocks (reference counts): they are never evicted. A block
    no sequence holds stays cached in the free part of the KV cache, least recently used out first;
    the engine says how many blocks are free (`fit`), and blocks are evicted down to that. A new
    sequence's hit is the longest run of its leading blocks that are pinned or cached, its blocks
    pinned at once (a sequence admitted later in the same step hits them, as vLLM v1 caches a block
    when it is allocated full). The counters are vLLM's `prefix_cache_queries` / `prefix_cache_hits`,
    in tokens, counted at admission.
    """

    def __init__(self, block_tokens: int = BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self.pinned: dict[int, int] = {}
        self.free = BlockLru(0)
        self.queries = 0
        self.hits = 0

    def match(self, blocks: Sequence[int], prompt_tokens: int) -> int:
        """Prompt tokens of this prompt already cached: its longest run of leading blocks that are
        pinned or cached, in whole blocks short of the prompt's last token (vLLM v1 looks up at most
        the prompt less one token, in whole blocks)."""
        hit = 0
        pinned, free = self.pinned, self.free
        for block in blocks:
            if block not in pinned and block not in free:
                break
            hit += 1
        tokens = cached_tokens(hit * self.block_tokens, prompt_tokens)
        return tokens - tokens % self.block_tokens

    def admit(self, blocks: Sequence[int], prompt_tokens: int) -> int:
        """A sequence starts: count its query and hit, pin its blocks; returns its cached tokens."""
        tokens = self.match(blocks, prompt_tokens)
        self.queries += prompt_tokens
        self.hits += tokens
        pinned, free = self.pinned, self.free
        for block in blocks:
            if block not in pinned:
                free.discard(block)
            pinned[block] = pinned.get(block, 0) + 1
        return tokens

    def release(self, blocks: Sequence[int], free_blocks: int) -> None:
        """A sequence let go of its blocks, leaving `free_blocks` free: those nobody else holds become
        cached and evictable, the least recent beyond the free room evicted."""
        self.free.resize(free_blocks)
        pinned = self.pinned
        released = []
        for block in blocks:
            count = pinned[block] - 1
            if count:
                pinned[block] = count
            else:
                del pinned[block]
                released.append(block)
        if released:
            self.free.touch(released)

    def fit(self, free_blocks: int) -> None:
        """The KV cache has `free_blocks` blocks not held by running sequences: evict down to that."""
        self.free.resize(free_blocks)
