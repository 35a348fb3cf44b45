"""Prefix reuse on slot KV: a prompt that starts as another did reuses its KV instead of computing it.

vLLM shares KV blocks between sequences (paged attention). The torch engine's slot cache
(backends/slot_kv.py) gives each sequence one contiguous slot, so it reuses a prefix as that layout
allows. A slot freed by a finished or cancelled sequence keeps its KV until another sequence writes
over it, and `SlotPrefixes` remembers what every slot's KV holds: for a free slot, the tokens of the
sequence that left it; for a slot in use, its sequence's prompt (decoding writes past it). A new
sequence takes the free slot whose KV holds the longest run of its leading blocks (`BLOCK_TOKENS`, 16
tokens a block, and never its last prompt token, which must be computed for the first token's logits);
with no match, an empty slot, else the one freed longest ago, so recent prefixes stay longest. Where a
slot in use holds a longer run than any free one, that run's KV is copied into the slot taken
(`Take.source`; `SlotKV.copy_prefix`), so sequences running at once share a system prompt:
a copy of the KV reads and writes 2 x layers x its bytes once, where computing it again runs the whole
model over those tokens. The copy is made in the step's order: a source admitted in the same step is
prefilled before the copy reads it.

What it does not do: hold one copy of a shared prefix (each slot holds its own, so a slot's KV is still
sized for a whole sequence), keep more prefixes than there are slots, or match part of a block.

Keys. A block's key is a BLAKE2b digest of the previous block's key, its token ids and, for an image's
placeholder tokens (whose ids are the same for every image), the image's key and their offsets in it.
An image's key is a BLAKE2b digest of the gateway's content digest of its file (64 bits), its
embedding's shape, dtype and grid, and the first and last 64 KiB of the embedding itself: two images
whose files collide on the 64-bit digest (2^32 tries to find) still differ in their embeddings. Two
prompts share a block exactly when everything up to its end is the same, and the keys of a prefix are
a prefix of the keys, so the longest match against a slot is found by bisection. A cryptographic hash,
not Python's: a collision would hand one request another's KV (vLLM keys its prefix cache with SHA-256
by default since v0.10.2 for that reason). Counters: prompt tokens admitted and, of them, reused
(vLLM's prefix_cache_queries / prefix_cache_hits, in the heartbeats).

Timing. A prompt whose prefix another request left in a free slot, or is running with, gets its first
token sooner, so a client could tell whether someone sent that prefix lately. A request's cache salt
(vLLM's `cache_salt`; the gateway sets one per tenant with `tenants.isolate_prefix_cache`) starts its
chain of keys: prompts of different salts share no block.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

from backends.executors import GenerateInput
from common.prefix_blocks import BLOCK_TOKENS

SAMPLE = 1 << 16   # bytes of an embedding's start and end in its image's key


def image_key(request: GenerateInput, k: int) -> bytes:
    """The key of the request's k-th image (see the module docstring)."""
    emb = request.embeddings[k]
    h = blake2b(digest_size=16)
    digest = request.images[k][0] if k < len(request.images) else 0
    grid = request.image_grids[k] if k < len(request.image_grids) else ()
    h.update(f"{digest}:{emb.tokens}x{emb.hidden}:{emb.dtype}:{grid}:{len(emb.data)}".encode())
    h.update(emb.data[:SAMPLE])
    h.update(emb.data[-SAMPLE:])
    return h.digest()


def block_keys(ids: Sequence[int], spans: Sequence[tuple[int, int]], digests: Sequence[bytes], tokens: int,
               known: Sequence[bytes] = (), salt: str = "") -> list[bytes]:
    """The chained keys of the full blocks among the first `tokens` of a prompt's token ids (then the
    tokens it generated), whose images sit at `spans` (start, length, in order and apart) with these
    keys (a span without one ends the keys at its start). `known`: the keys of a prefix of these
    tokens already worked out (the prompt's, when its slot is freed): kept, and hashing goes on after them.
    `salt`: the request's cache salt; the chain starts from its digest, so prompts of different salts
    share no block."""
    values = array("q", ids[:tokens])
    for k, (start, length) in enumerate(spans):
        if k >= len(digests):
            tokens = min(tokens, start)
            break
        for p in range(start, min(start + length, len(values))):
            values[p] = -1 - (p - start)   # the placeholder's offset in its image; the image's digest below
    out = list(known[:tokens // BLOCK_TOKENS])
    previous = out[-1] if out else blake2b(salt.encode(), digest_size=16).digest() if salt else b""
    for start in range(len(out) * BLOCK_TOKENS, tokens - tokens % BLOCK_TOKENS, BLOCK_TOKENS):
        end = start + BLOCK_TOKENS
        h = blake2b(previous, digest_size=16)
        h.update(values[start:end].tobytes())
        for (first, length), digest in zip(spans, digests, strict=False):
            if first < end and first + length > start:
                h.update(digest)
        previous = h.digest()
        out.append(previous)
    return out


def _shared(held: list[bytes], wanted: list[bytes], limit: int) -> int:
    """How many leading blocks `held` and `wanted` share (at most `limit`): chained keys, so the shared
    blocks are a prefix, found by bisection."""
    lo, hi = 0, min(limit, len(held), len(wanted))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if held[mid - 1] == wanted[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class Take:
    """A slot taken for a prompt: its KV holds the prompt's first `reused` tokens once those from
    `copy_from` on are copied from slot `source` (source -1: nothing to copy)."""

    slot: int
    reused: int
    source: int = -1
    copy_from: int = 0


class SlotPrefixes:
    """What every slot's KV holds, as block keys: the free slots least recently freed first, and the
    slots in use (their sequence's prompt)."""

    def __init__(self, slots: int) -> None:
        self._free: OrderedDict[int, list[bytes]] = OrderedDict((s, []) for s in range(slots))
        self._busy: dict[int, list[bytes]] = {}
        self.queries = 0   # prompt tokens admitted
        self.hits = 0      # of them, whose KV a slot already held (copied ones too)

    def __len__(self) -> int:
        return len(self._free)

    def take(self, blocks: list[bytes], prompt_tokens: int) -> Take:
        """A free slot for a prompt of `prompt_tokens` whose full blocks have these keys, and what of the
        prompt's KV it holds or is to copy. At least one slot must be free."""
        limit = (prompt_tokens - 1) // BLOCK_TOKENS
        best, shared, empty = -1, 0, -1
        for slot, held in self._free.items():
            if not held:
                if empty < 0:
                    empty = slot
                continue
            n = _shared(held, blocks, limit)
            if n > shared:
                best, shared = slot, n
        source, longest = -1, shared
        for slot, held in self._busy.items():
            if (n := _shared(held, blocks, limit)) > longest:
                source, longest = slot, n
        if source >= 0 or best < 0:   # the run is copied (or there is none): keep the free slot's prefix
            best = empty if empty >= 0 else next(iter(self._free))
            shared = _shared(self._free[best], blocks, limit)
        del self._free[best]
        self._busy[best] = blocks
        reused = max(shared, longest) * BLOCK_TOKENS
        self.queries += prompt_tokens
        self.hits += reused
        if longest > shared:   # the slot taken holds the first `shared` blocks already
            return Take(best, reused, source, shared * BLOCK_TOKENS)
        return Take(best, reused)

    def release(self, slot: int, blocks: list[bytes]) -> None:
        """`slot` is free again, its KV holding the tokens these block keys name (the most recent)."""
        self._busy.pop(slot, None)
        self._free[slot] = blocks
