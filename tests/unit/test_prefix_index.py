"""Prefix blocks and the gateway's prefix index: hashing, chaining, eviction, bounds, sessions, engine reports."""

from __future__ import annotations

import tracemalloc

import pytest

from common.prefix_blocks import (
    BLOCK_TOKENS,
    BlockLru,
    EnginePrefixCache,
    block_hashes,
    cached_tokens,
    content_digest,
    prompt_blocks,
    salted_digest,
)
from gateway.config.cluster import PrefixCacheConfig
from gateway.requests.images import ImageInput
from gateway.routing.backend_entry import Reported
from gateway.routing.prefix_index import MIN_REPORTED_TOKENS, MIN_REUSE, PrefixIndex
from gateway.routing.state_table import StateTable
from tests.snapshots import catalog

BLOCK = "x" * 64   # one block of text: 64 bytes, about 16 tokens


def text(*blocks: str) -> str:
    return "".join(b * 64 if len(b) == 1 else b for b in blocks)


def test_only_full_blocks_are_hashed_and_the_same_prompt_hashes_the_same() -> None:
    assert block_hashes("a" * 63) == []
    assert len(block_hashes("a" * 64)) == 1
    assert len(block_hashes("a" * 200)) == 3
    assert block_hashes(text("a", "b", "c")) == block_hashes(text("a", "b", "c") + "tail")
    assert len(block_hashes("é" * 32)) == 1   # UTF-8 bytes, not characters
    assert len(block_hashes(text("a", "b", "c", "d"), max_blocks=2)) == 2


def test_a_different_earlier_block_changes_every_later_hash() -> None:
    base = block_hashes(text("a", "b", "c", "d"))
    changed_first = block_hashes(text("z", "b", "c", "d"))
    changed_third = block_hashes(text("a", "b", "z", "d"))
    assert all(x != y for x, y in zip(base, changed_first, strict=True))
    assert base[:2] == changed_third[:2]
    assert base[2] != changed_third[2] and base[3] != changed_third[3]   # "d" follows another block


def test_token_ids_hash_in_blocks_of_block_tokens_ids() -> None:
    ids = list(range(50))
    hashes = block_hashes("ignored when ids are given", ids)
    assert len(hashes) == 50 // BLOCK_TOKENS
    assert hashes == block_hashes("", ids[:48])
    other = block_hashes("", [99, *ids[1:]])
    assert all(x != y for x, y in zip(hashes, other, strict=True))


def test_cached_tokens_never_cover_the_whole_prompt() -> None:
    assert cached_tokens(64, 100) == 64
    assert cached_tokens(64, 64) == 63
    assert cached_tokens(0, 10) == 0
    assert cached_tokens(16, 0) == 0


def test_lru_touches_a_prefix_head_last_and_evicts_least_recent_first() -> None:
    lru = BlockLru(4)
    added, evicted = lru.touch([1, 2, 3])
    assert (sorted(added), evicted) == ([1, 2, 3], [])
    assert list(lru.blocks()) == [3, 2, 1]   # the first block is the most recent
    added, evicted = lru.touch([7, 8])
    assert (sorted(added), evicted) == ([7, 8], [3])
    assert lru.resize(2) == [2, 1]
    assert len(lru) == 2 and 7 in lru and 8 in lru
    assert lru.touch([5, 6, 7]) == ([6, 5], [8, 7])   # more than the room: the prompt's tail goes too
    assert list(lru.blocks()) == [6, 5]


def test_lookup_counts_the_longest_routed_prefix_per_backend() -> None:
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("a", 10_000)
    index.add_backend("b", 10_000)
    prompt = text("s", "y", "s", "t", "e", "m")
    blocks = index.hashes(prompt, (), 200)
    assert len(blocks) == 6
    first = index.lookup(blocks, "", 200)
    assert first.cached == {}
    index.record(first, "a", 10_000)
    again = index.lookup(blocks, "", 200)
    assert again.cached == {"a": 6 * 16}
    # another conversation of the same tenant: the first 4 blocks are the same
    other = index.hashes(text("s", "y", "s", "t", "q", "q", "q"), (), 300)
    query = index.lookup(other, "", 300)
    assert query.cached == {"a": 4 * 16}
    index.record(query, "b", 10_000)
    query = index.lookup(other, "", 300)
    assert query.cached == {"a": 4 * 16, "b": 7 * 16}
    # a prompt no longer than what is cached keeps its last token to compute
    assert index.lookup(blocks, "", 96).cached == {"a": 95, "b": 64}


def test_a_removed_backend_is_forgotten_and_one_added_again_starts_empty() -> None:
    """A backend removed from the fleet takes its blocks with it (no hit predicted there, its memory
    freed); re-added under the same id it holds nothing, as its new engine's cache; its bit is reused."""
    index = PrefixIndex(BLOCK_TOKENS)
    for backend in ("a", "b"):
        index.add_backend(backend, 10_000)
    blocks = index.hashes(text("s", "y", "s", "t", "e", "m"), (), 200)
    index.record(index.lookup(blocks, "", 200), "a", 10_000)
    index.record(index.lookup(blocks, "", 200), "b", 10_000)
    only_a = index.hashes(text("o", "n", "l", "y"), (), 200)
    index.record(index.lookup(only_a, "", 200), "a", 10_000)
    assert index.held_blocks() == 10
    index.remove_backend("a")
    assert "a" not in index
    assert index.lookup(blocks, "", 200).cached == {"b": 96}
    assert index.held_blocks() == 6     # what only "a" held is gone
    index.add_backend("c", 10_000)      # takes a's bit
    index.add_backend("a", 10_000)
    assert index.lookup(blocks, "", 200).cached == {"b": 96}
    index.record(index.lookup(only_a, "", 200), "c", 10_000)
    assert index.lookup(only_a, "", 200).cached == {"c": 64}
    index.remove_backend("missing")     # nothing to do


def test_eviction_follows_each_backends_capacity_in_blocks() -> None:
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("small", 4 * 16)
    old = index.hashes(text("a", "b", "c"), (), 100)
    index.record(index.lookup(old, "", 100), "small", 4 * 16)
    new = index.hashes(text("n", "e", "w"), (), 100)
    index.record(index.lookup(new, "", 100), "small", 4 * 16)
    # 6 blocks routed into room for 4: the old prompt's tail went first, then its middle
    assert index.lookup(new, "", 100).cached == {"small": 48}
    assert index.lookup(old, "", 100).cached == {"small": 16}
    assert index.held_blocks() == 4
    # a smaller reported capacity shrinks the LRU on the next record
    index.record(index.lookup(new, "", 100), "small", 2 * 16)
    assert index.held_blocks() == 2
    assert index.lookup(old, "", 100).cached == {}


def test_memory_is_bounded_by_capacity_and_by_the_per_backend_cap() -> None:
    index = PrefixIndex(BLOCK_TOKENS, max_blocks_per_backend=100)
    index.add_backend("a", 1_000_000)
    index.add_backend("b", 20 * 16)
    for k in range(50):
        blocks = index.hashes("".join(f"{k:08d}-{j:054d}" for j in range(10)), (), 200)
        query = index.lookup(blocks, "", 200)
        index.record(query, "a", 1_000_000)
        index.record(query, "b", 20 * 16)
    assert index.describe("a")["blocks"] == 100   # the cap, not the 62,500 blocks of its KV
    assert index.describe("b")["blocks"] == 20
    assert index.held_blocks() == 100   # b's 20 are among a's most recent 100


def test_bytes_per_held_block_are_as_documented() -> None:
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("a", 1 << 30)
    prompts = [index.hashes("".join(f"{k:06d}{j:058d}" for j in range(100)), (), 2000) for k in range(100)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for blocks in prompts:
        index.record(index.lookup(blocks, "", 2000), "a", 1 << 30)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    per_block = grown / index.held_blocks()
    assert index.held_blocks() == 10_000
    assert per_block < 250, per_block   # the module docstring says about 100 bytes a block


def test_a_session_sticks_where_its_last_request_went() -> None:
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("a", 10_000)
    index.add_backend("b", 10_000)
    first = index.lookup(index.hashes(text("h", "i"), (), 40), "conv-1", 40)
    index.record(first, "b", 10_000)
    # the next turn's text does not match (a rewritten history), the session does
    later = index.lookup(index.hashes(text("r", "e", "w", "r", "i", "t", "e"), (), 150), "conv-1", 150)
    assert later.cached == {"b": 40}
    assert index.lookup(later.blocks, "conv-2", 150).cached == {}


def test_rewritten_turns_of_a_session_do_not_turn_the_index_off() -> None:
    """A session predicts its last prompt's length cached even when the text changed, which the engine
    (caching by content) does not find. Compared with its counters, such turns read as "predicted hits,
    none found" and set keep_i to 0: no prediction there, sessions included, for good. Only the blocks'
    prediction is compared with the engine's counters."""
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("b", 1_000_000)
    index.observe("b", 0, 0)
    queries = 0
    for turn in range(6):   # each turn a new text of ~5,000 tokens under one session
        words = "".join(f"{turn:02d}-{j:061d}" for j in range(300))
        query = index.lookup(index.hashes(words, (), 5_000), "conv-1", 5_000)
        assert query.cached == ({"b": 4_999} if turn else {})
        index.record(query, "b", 1_000_000)
        queries += 5_000
        index.observe("b", queries, 0)   # the engine finds nothing of a new text
    described = index.describe("b")
    assert described["reported_query_tokens"] == 6 * 5_000 >= MIN_REPORTED_TOKENS
    assert described["predicted_hit_tokens"] == 0 and described["keep"] == 1.0


def test_counters_first_read_at_zero_count_the_first_request() -> None:
    """The gateway reads an engine's counters before it records a request there: an engine's first
    reading of none yet is where its counts start, so the first request's tokens are in the reported
    figures, as they are in the predicted ones."""
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("a", 100_000)
    blocks = index.hashes(text(*"abcdefghij"), (), 200)
    index.observe("a", 0, 0)
    index.record(index.lookup(blocks, "", 200), "a", 100_000)   # a miss: 200 tokens computed
    index.observe("a", 200, 0)
    index.record(index.lookup(blocks, "", 200), "a", 100_000)   # a hit: its 10 blocks
    index.observe("a", 400, 192)
    described = index.describe("a")
    assert (described["reported_query_tokens"], described["reported_hit_tokens"]) == (400, 192)
    assert (described["predicted_query_tokens"], described["predicted_hit_tokens"]) == (400, 160)
    index.observe("a", 0, 0)   # restarted, and read before its first request: its cache is empty
    assert index.lookup(blocks, "", 200).cached == {}
    index.record(index.lookup(blocks, "", 200), "a", 100_000)
    index.observe("a", 200, 0)   # that first request counts
    assert index.describe("a")["reported_query_tokens"] == 600


def test_engine_reports_shrink_what_the_index_counts_as_cached_oldest_first() -> None:
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("a", 100 * 16)   # room for 100 blocks: the ten prompts below
    prompts = [index.hashes("".join(f"{k:03d}-{j:060d}" for j in range(10)), (), 200) for k in range(10)]
    for blocks in prompts:   # prompts[0] the least recent
        index.record(index.lookup(blocks, "", 200), "a", 100 * 16)
    assert index.describe("a")["source"] == "estimate"
    index.observe("a", 1000, 0)   # first reading: a baseline
    queries, hits = 1000, 0
    for _ in range(40):   # the index predicts 160 of 200 tokens cached; the engine finds 40
        index.record(index.lookup(prompts[9], "", 200), "a", 100 * 16)
        queries, hits = queries + 200, hits + 40
        index.observe("a", queries, hits)
    described = index.describe("a")
    assert described["source"] == "engine"
    assert described["reported_query_tokens"] == 40 * 200 >= MIN_REPORTED_TOKENS
    assert 0.1 < described["keep"] < 0.6
    assert described["capacity_blocks"] == int(100 * described["keep"]) >= 10
    assert index.lookup(prompts[0], "", 200).cached == {}         # forgotten first
    assert index.lookup(prompts[9], "", 200).cached == {"a": 160}   # the most recent stays
    index.observe("a", 10, 0)   # the engine restarted: a new baseline, keep unchanged, its cache empty
    assert index.describe("a")["keep"] == described["keep"]
    assert index.lookup(prompts[9], "", 200).cached == {}
    assert index.describe("a")["blocks"] == 0 and index.held_blocks() == 0
    index.record(index.lookup(prompts[9], "", 200), "a", 100 * 16)   # and it fills again
    assert index.lookup(prompts[9], "", 200).cached == {"a": 160}


def test_an_engine_that_reports_no_hit_gets_no_prediction() -> None:
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("b", 100_000)
    blocks = index.hashes(text(*"abcdefghij"), (), 200)
    queries = 0
    for _ in range(40):   # the index predicts 192 of 200 tokens cached each time; the engine finds none
        index.record(index.lookup(blocks, "", 200), "b", 100_000)
        queries += 200
        index.observe("b", queries, 0)
    assert index.describe("b")["keep"] == 0.0
    assert index.lookup(blocks, "", 200).cached == {}


def test_a_cold_cache_missing_prompts_nobody_predicted_leaves_keep_alone() -> None:
    """A cold engine misses every new prompt; that says nothing about whether it caches. Taken as "caches
    nothing", it set keep_i to 0 at every start with cold engines, and the index then predicted nothing
    on that backend until its LRU had regrown reading by reading."""
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("b", 100_000)
    queries = 0
    for k in range(40):   # distinct prompts: the index predicts no hit, the engine finds none
        index.record(index.lookup(index.hashes(text(str(k), *"abcdefghij"), (), 200), "", 200), "b", 100_000)
        queries += 200
        index.observe("b", queries, 0)
    described = index.describe("b")
    assert described["reported_query_tokens"] == 39 * 200 >= MIN_REPORTED_TOKENS   # the first reading a baseline
    assert described["keep"] == 1.0
    blocks = index.hashes(text("0", *"abcdefghij"), (), 200)
    assert index.lookup(blocks, "", 200).cached == {"b": 176}   # its 11 blocks


def test_engine_cache_pins_running_blocks_and_evicts_the_free_ones_lru() -> None:
    cache = EnginePrefixCache()
    a = block_hashes(text("a", "b", "c"))
    assert cache.admit(a, 60) == 0
    cache.fit(0)   # no free KV: pinned blocks stay
    assert cache.match(a, 60) == 48
    cache.release(a, free_blocks=2)   # two blocks of room: the tail block goes first
    assert cache.match(a, 60) == 32
    b = block_hashes(text("a", "x"))
    assert cache.admit(b, 40) == 16   # shares block "a"
    assert (cache.queries, cache.hits) == (100, 16)
    cache.fit(0)
    assert cache.match(a, 60) == 16   # "a" is pinned by b, "b" was evicted
    cache.release(b, free_blocks=10)
    assert cache.match(b, 40) == 32 and not cache.pinned


def test_a_lease_counts_only_the_uncached_prompt_as_prefill() -> None:
    table = StateTable(catalog().model("llava-1.5-7b"), heartbeat_interval_s=0.2, clock=lambda: 100.0)
    table.register("b", "language", catalog().gpu("L40S"), address="http://x", managed=False, external=True)
    table.apply_heartbeat("b", 1, "http://x", Reported(kv_free_bytes=1 << 30, kv_total_bytes=1 << 30))
    lease = table.acquire("b", 3000, 100, cached_tokens=2800)
    snap = table.candidates(("language",))[0]
    assert (snap.prefill_backlog_tokens, snap.kv_reserved_tokens, lease.prompt_tokens) == (200, 3100, 200)
    table.release(lease)
    snap = table.candidates(("language",))[0]
    assert (snap.prefill_backlog_tokens, snap.kv_reserved_tokens) == (0, 0)


def test_the_default_index_counts_hits_in_blocks_of_64_tokens() -> None:
    """The gateway's index walks blocks of 64 tokens (256 bytes of text), four engine blocks each: a
    quarter of the hashing, lookups and LRU touches, and a hit under-counted by at most 63 tokens."""
    index = PrefixIndex()
    assert index.block_tokens == 64 == PrefixCacheConfig().block_tokens
    index.add_backend("a", 10_000)
    prompt = "".join(f"{j:063d}-" for j in range(20))    # 1,280 bytes, 320 tokens
    blocks = index.hashes(prompt, (), 320)
    assert len(blocks) == 5 and blocks == block_hashes(prompt, block_tokens=64)
    index.record(index.lookup(blocks, "", 320), "a", 10_000)
    longer = prompt + "x" * 250    # 62 tokens more, not a whole block
    query = index.lookup(index.hashes(longer, (), 382), "", 382)
    assert query.cached == {"a": 320}


def test_a_hit_counts_the_whole_blocks_of_the_engines_kv_it_fills() -> None:
    """An engine whose KV blocks are not the index's (128 tokens, or 48) caches only whole blocks of
    its own: once it says its block size, a hit is what fills them; before, the index's count stands."""
    table = StateTable(catalog().model("llava-1.5-7b"), heartbeat_interval_s=0.2, clock=lambda: 100.0)
    index = PrefixIndex()
    for b in ("big", "odd", "quiet"):
        table.register(b, "language", catalog().gpu("L40S"), address="http://x", managed=False, external=True)
        index.add_backend(b, 100_000)
    prompt = "".join(f"{j:063d}-" for j in range(20))    # 320 tokens, five index blocks
    blocks = index.hashes(prompt, (), 320)
    for b in ("big", "odd", "quiet"):
        index.record(index.lookup(blocks, "", 320), b, 100_000)
    for b, size in (("big", 128), ("odd", 48), ("quiet", 0)):
        table.apply_heartbeat(b, 1, "http://x", Reported(kv_block_tokens=size))
        entry = table.get(b)
        assert entry is not None
        index.read(entry)
    query = index.lookup(index.hashes(prompt + "y" * 400, (), 420), "", 420)
    assert query.cached == {"big": 256, "odd": 288, "quiet": 320}
    assert index.describe("big")["engine_block_tokens"] == 128
    assert index.describe("quiet")["engine_block_tokens"] is None
    # the prompt itself again: at most all but its last token, in whole engine blocks
    assert index.lookup(blocks, "", 320).cached == {"big": 256, "odd": 288, "quiet": 319}


def test_an_image_before_the_text_is_named_by_its_content_so_a_repeated_image_with_the_same_text_is_a_hit() -> None:
    index = PrefixIndex()   # 64-token blocks
    index.add_backend("a", 100_000)
    index.add_backend("b", 100_000)
    cat, dog = content_digest(b"cat picture bytes"), content_digest(b"dog picture bytes")
    assert cat == content_digest(b"cat picture bytes") != dog
    question = "".join(f"{j:063d}-" for j in range(16))    # 1,024 bytes: 256 tokens of text
    prompt_tokens = 576 + 256
    with_cat = index.hashes(question, (), prompt_tokens, [(cat, 576, 0)])
    assert len(with_cat) == 576 // 64 + 256 // 64
    assert with_cat[:9] == index.hashes("", (), 576, [(cat, 576, 0)])   # the image's blocks head the chain
    index.record(index.lookup(with_cat, "", prompt_tokens), "a", 100_000)
    # the same image and text: all of it but the last token is predicted cached on "a"
    assert index.lookup(index.hashes(question, (), prompt_tokens, [(cat, 576, 0)]), "", prompt_tokens).cached == {
        "a": prompt_tokens - 1}
    # the same image, another question: the image's tokens only
    other = index.hashes("x" * 1024, (), prompt_tokens, [(cat, 576, 0)])
    assert index.lookup(other, "", prompt_tokens).cached == {"a": 576}
    # another image with the same text: nothing (the text follows a different image)
    assert index.lookup(index.hashes(question, (), prompt_tokens, [(dog, 576, 0)]), "", prompt_tokens).cached == {}
    # and text alone does not match the text that followed an image
    assert index.lookup(index.hashes(question, (), 256), "", 256).cached == {}


def test_token_ids_with_image_placeholders_differ_by_the_images_content() -> None:
    """Exact prompts carry the same placeholder ids for every image: the digests keep them apart."""
    ids = [7] * 576 + list(range(100))
    one = PrefixIndex().hashes("", ids, len(ids), [(content_digest(b"one"), 576, 0)])
    two = PrefixIndex().hashes("", ids, len(ids), [(content_digest(b"two"), 576, 0)])
    assert len(one) == len(ids) // 64 and not set(one) & set(two)


def test_in_token_ids_a_system_prompt_ahead_of_different_images_is_a_shared_prefix() -> None:
    """Exact prompts: each image at its span's start, its placeholder ids named by its content."""
    system, question = list(range(1000, 1200)), list(range(2000, 2100))
    ids = system + [7] * 576 + question                 # the image's placeholder run at 200..775
    tokens = len(ids)
    cat = PrefixIndex().hashes("", ids, tokens, [(content_digest(b"cat"), 576, 200)])
    dog = PrefixIndex().hashes("", ids, tokens, [(content_digest(b"dog"), 576, 200)])
    alone = PrefixIndex().hashes("", system, 200)
    assert len(cat) == len(dog) == 3 + 9 + 1            # 3 full blocks of the system prompt, the image, the question
    assert cat[:3] == dog[:3] == alone                   # the system prompt's full blocks are shared
    assert not set(cat[3:]) & set(dog[3:])               # from the image on, they differ
    later = PrefixIndex().hashes("", [*system, *question[:40], *[7] * 576, *question[40:]], tokens,
                                 [(content_digest(b"cat"), 576, 240)])
    assert later[:3] == cat[:3] and later[3] != cat[3]   # the image further on: the block before it differs


def test_an_image_input_carries_its_content_digest() -> None:
    a, b = ImageInput(b"png-a", 32, 32, "PNG", 576), ImageInput(b"png-b", 32, 32, "PNG", 576)
    assert a.digest == content_digest(b"png-a") == ImageInput(b"png-a", 64, 64, "PNG", 10).digest != b.digest
    salted = ImageInput(b"png-a", 32, 32, "PNG", 576, "tenant:x")
    assert salted.digest == salted_digest(a.digest, "tenant:x") not in (a.digest, b.digest)


def test_evicted_blocks_asked_for_again_make_a_full_backend_costly_to_fill() -> None:
    """ρ_i: of the blocks a backend evicted, the share a later prompt brought back (routed anywhere); a
    backend is listed in the queries' `reuse` only while its cache is full."""
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("a", 4 * 16)
    index.add_backend("b", 100 * 16)
    first, second = index.hashes(text("a", "b", "c"), (), 100), index.hashes(text("d", "e", "f"), (), 100)
    index.record(index.lookup(first, "", 100), "a", 4 * 16)
    assert index.lookup(second, "", 100).reuse == {}   # not full: a prompt there evicts nothing
    index.record(index.lookup(second, "", 100), "a", 4 * 16)   # evicts the first prompt's last two blocks
    assert index.evicted_reuse("a") == 0.0
    assert index.lookup(first, "", 100).reuse == {}    # full, but nothing evicted was asked for again
    index.record(index.lookup(first, "", 100), "b", 100 * 16)   # both come back, on another backend
    aged = 2 ** (-len(first) / 4)   # every evicted block was wanted (1.0), aged by the 6 blocks b took in
    assert index.evicted_reuse("a") == pytest.approx(aged)
    assert index.lookup(second, "", 100).reuse == {"a": pytest.approx(aged)}
    assert index.describe("a")["evicted_reuse"] == pytest.approx(aged)
    assert index.evicted_reuse("b") == 0.0   # b has evicted nothing


def blocks_of(tag: str, n: int) -> str:
    """`n` blocks of text of their own."""
    return "".join(f"{tag}-{j}".ljust(64, "-") for j in range(n))


def test_the_reuse_of_a_backend_that_evicts_nothing_ages_as_the_cluster_takes_in_new_blocks() -> None:
    """A backend priced out by its ρ_i takes no prompt, so it evicts nothing and its ρ_i would never move:
    it halves for every K_i blocks placed elsewhere, leaves the queries' `reuse` below MIN_REUSE, and is
    measured afresh once it evicts again."""
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("a", 40 * 16)
    index.add_backend("b", 10_000 * 16)
    prompts = [index.hashes(blocks_of(f"p{k}", 12), (), 200) for k in range(8)]
    for blocks in prompts:   # a full and turning over: 8 prompts of 12 blocks through 40 blocks
        index.record(index.lookup(blocks, "", 200), "a", 40 * 16)
    for blocks in prompts[:4]:   # the evicted ones come back, elsewhere
        index.record(index.lookup(blocks, "", 200), "b", 10_000 * 16)
    measured = index.evicted_reuse("a")   # aged already by the 48 blocks brought back on b
    assert measured > 0.1
    for k in range(200):   # the cluster moves on: new prompts, none of them on a
        index.record(index.lookup(index.hashes(blocks_of(f"new{k}", 12), (), 200), "", 200), "b", 10_000 * 16)
        if k == 1:   # 24 blocks more taken in elsewhere: 24 / 40 of a half-life
            assert index.evicted_reuse("a") == pytest.approx(measured * 2 ** (-24 / 40))
    assert index.evicted_reuse("a") < MIN_REUSE
    assert "a" not in index.lookup(prompts[0], "", 200).reuse
    index.record(index.lookup(prompts[7], "", 200), "a", 40 * 16)   # held: evicts nothing, ρ_a still aged
    assert index.evicted_reuse("a") < MIN_REUSE
    index.record(index.lookup(index.hashes(blocks_of("fresh", 12), (), 200), "", 200), "a", 40 * 16)
    assert index.evicted_reuse("a") > 0.1   # it evicted again: its own ratio, not aged


def test_distinct_prompts_evict_blocks_nobody_asks_for_again() -> None:
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("a", 8 * 16)
    for k in range(40):
        blocks = index.hashes("".join(f"{k:04d}-{j:059d}" for j in range(3)), (), 60)
        query = index.lookup(blocks, "", 60)
        assert query.reuse == {}
        index.record(query, "a", 8 * 16)
    assert index.describe("a")["blocks"] == 8
    assert index.evicted_reuse("a") == 0.0


def test_text_before_an_image_is_a_prefix_of_its_own() -> None:
    """A system prompt ahead of different images: its full blocks are shared, as an engine shares them;
    the part of it that fills no block goes with the image's first block, and so do the words that
    follow the image."""
    index = PrefixIndex()   # 64-token blocks: 256 bytes of text a block
    index.add_backend("a", 100_000)
    cat, dog = content_digest(b"cat picture bytes"), content_digest(b"dog picture bytes")
    system = "".join(f"{j:063d}-" for j in range(10)) + "tail"   # 644 bytes: 2 full blocks and 132 bytes
    question = "".join(f"{j:063d}-" for j in range(8))          # 512 bytes: 2 blocks
    prompt, place, tokens = system + question, len(system.encode()), 161 + 576 + 128

    def hashes(image: int, at: int = place, text: str = prompt) -> list[int]:
        return index.hashes(text, (), tokens, [(image, 576, at)])

    with_cat = hashes(cat)
    assert len(with_cat) == tokens // 64 and with_cat[:2] == block_hashes(system, block_tokens=64)
    index.record(index.lookup(with_cat, "", tokens), "a", 100_000)
    assert index.lookup(hashes(cat), "", tokens).cached == {"a": 13 * 64}   # the same image and text: every block
    assert index.lookup(hashes(dog), "", tokens).cached == {"a": 2 * 64}       # the system prompt's full blocks
    # the same image with another partial tail before it: the image's first block differs, and all after it
    other_tail = system[:-4] + "TAIL" + question
    assert index.lookup(hashes(cat, text=other_tail), "", tokens).cached == {"a": 2 * 64}
    # images before the text (no places given): no text prefix is shared with the placed ones
    assert index.lookup(hashes(cat, at=0), "", tokens).cached == {}
    # image blocks come at the image's place whatever the blocks before: the stable hashes of replicas too
    stable = prompt_blocks(prompt, (), tokens, [(cat, 576, place)], block_tokens=64, stable=True)
    assert len(stable) == len(with_cat) and stable[:2] == block_hashes(system, block_tokens=64, stable=True)


def test_an_images_place_is_the_rendered_prompt_before_it() -> None:
    from gateway.requests.openai_types import ChatCompletionRequest, image_places, render_chat

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "Be brief. Ünïcode counts in bytes."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, image, {"type": "text", "text": "and"},
                                     image]},
        {"role": "assistant", "content": "Two cats."},
        {"role": "user", "content": [image, {"type": "text", "text": "And this?"}]}]})
    prompt, _ = render_chat(req.messages)
    data = prompt.encode()
    first, second, third = image_places(req.messages)
    assert data[:first].decode().endswith("Be brief. Ünïcode counts in bytes.\nuser: Compare ")
    assert data[first:second] == b"and"
    assert data[:third].decode().endswith("assistant: Two cats.\nuser: ") and data[third:] == b"And this?"


def test_a_peers_requests_count_in_the_prediction_as_they_do_in_the_engines_counters() -> None:
    """Replicas: an engine's counters cover every replica's requests, so the prediction they are compared
    with (keep_i) must too. Counting only its own, the replica that got every other turn of a
    conversation (each a hit) predicted more hits than the engine found and shrank its index while the
    engine's KV was far from full; its peer, with the first turns (misses), kept its whole index."""
    index = PrefixIndex(BLOCK_TOKENS)
    index.add_backend("a", 100_000)
    index.observe("a", 0, 0)
    turns = [index.hashes(text(*"abcdefghij"[:n]), (), 16 * n + 8) for n in (4, 6, 8, 10)]
    queries = hits = 0
    for n, blocks in enumerate(turns):
        prompt = len(blocks) * 16 + 8
        held = 0 if n == 0 else len(turns[n - 1]) * 16   # the engine finds the previous turn's blocks
        if n % 2 == 0:   # a peer routed it
            index.peer_routed("a", blocks, None, prompt)
        else:
            index.record(index.lookup(blocks, "", prompt), "a", 100_000)
        queries, hits = queries + prompt, hits + held
    described = index.describe("a")
    assert (described["predicted_query_tokens"], described["predicted_hit_tokens"]) == (queries, hits)
