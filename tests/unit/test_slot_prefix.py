"""The torch engine's prefix reuse bookkeeping: block keys of a prompt, and which free slot a prompt takes.

A wrong key hands a request KV computed for another prompt (wrong answers, and another tenant's data in
them); a wrong choice of slot throws away a reusable prefix or overwrites the most recent one first.
"""

from __future__ import annotations

from backends.slot_prefix import SlotPrefixes, Take, block_keys

IDS = list(range(100, 164))   # 64 tokens: four blocks


def test_keys_are_chained_full_blocks_and_a_prefix_keeps_its_keys() -> None:
    keys = block_keys(IDS, [], [], 64)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert block_keys(IDS, [], [], 40) == keys[:2]             # partial blocks are not keyed
    assert block_keys([*IDS, 1, 2, 3], [], [], 67) == keys     # a longer prompt: the same leading keys
    changed = [*IDS[:20], 7, *IDS[21:]]
    other = block_keys(changed, [], [], 64)
    assert other[0] == keys[0] and not set(other[1:]) & set(keys)   # a token differs: that block and all after


def test_an_image_is_keyed_by_its_content_not_its_placeholder_ids() -> None:
    ids = IDS[:16] + [9] * 32 + IDS[48:]          # one image's 32 placeholder tokens at 16..47
    cat, dog = block_keys(ids, [(16, 32)], [b"cat"], 64), block_keys(ids, [(16, 32)], [b"dog"], 64)
    assert cat[0] == dog[0]                       # the text before the image is shared
    assert not set(cat[1:]) & set(dog[1:])        # the image's blocks and those after it are not
    assert block_keys(ids, [(16, 32)], [b"cat"], 64) == cat
    assert block_keys(ids, [(16, 32)], [], 64) == cat[:1]   # no digest: keyed only up to the image
    assert block_keys(ids, [], [], 64)[1:] != cat[1:]


def test_a_prompt_takes_the_free_slot_holding_its_longest_prefix() -> None:
    slots = SlotPrefixes(3)
    keys = block_keys(IDS, [], [], 64)
    assert slots.take(keys, 64) == Take(0, 0)     # nothing cached: an empty slot
    assert slots.take(keys[:1] + [b"y"] * 3, 64) == Take(1, 16, source=0, copy_from=0)   # slot 0's first block
    slots.release(0, keys[:2])                    # slot 0 holds two blocks, slot 1 one of them
    slots.release(1, keys[:1])
    assert slots.take(keys, 64) == Take(0, 32)    # the longest match: no copy
    assert (slots.queries, slots.hits) == (192, 48)
    assert slots.take(keys[:1] + [b"x"] * 3, 64) == Take(1, 16)   # one block in common with slot 1
    assert len(slots) == 1 and slots.take([], 10) == Take(2, 0)


def test_a_prompt_copies_a_longer_prefix_from_a_slot_in_use() -> None:
    """Sequences running at once share a prefix: the run is copied into a free slot, never the last prompt
    token's block; a free slot's own shorter prefix is kept for another prompt (an empty slot taken first)."""
    slots = SlotPrefixes(3)
    keys = block_keys(IDS, [], [], 64)
    assert slots.take(keys, 64) == Take(0, 0)
    slots.release(0, keys[:1])
    assert slots.take(keys, 64) == Take(0, 16)    # slot 0 back in use, its prompt all four blocks
    assert slots.take(keys, 64) == Take(1, 48, source=0, copy_from=0)
    slots.release(1, keys)
    assert slots.take(block_keys(IDS[:40], [], [], 40), 40) == Take(1, 32)   # a free slot's match: no copy
    assert (slots.queries, slots.hits) == (232, 96)


def test_a_copy_skips_the_blocks_the_slot_taken_holds() -> None:
    slots = SlotPrefixes(2)
    keys = block_keys(IDS, [], [], 64)
    assert slots.take(keys, 64) == Take(0, 0)
    assert slots.take(keys[:1] + [b"x"] * 3, 64) == Take(1, 16, source=0, copy_from=0)
    slots.release(1, keys[:1])                    # no empty slot left: slot 1 (its first block) is taken
    assert slots.take(keys, 64) == Take(1, 48, source=0, copy_from=16)


def test_with_no_match_an_empty_slot_then_the_one_freed_longest_ago() -> None:
    slots = SlotPrefixes(2)
    a, b = block_keys(IDS, [], [], 32), block_keys(IDS[::-1], [], [], 32)
    assert [slots.take(a, 32).slot, slots.take(b, 32).slot] == [0, 1]
    slots.release(1, b)
    slots.release(0, a)                           # freed last: the most recent prefix
    other = block_keys([5] * 32, [], [], 32)
    assert slots.take(other, 32) == Take(1, 0)    # b's slot, freed longest ago, is written over
    assert slots.take(a, 32) == Take(0, 16)       # a's prefix was kept


def test_a_cache_salt_starts_a_chain_of_its_own() -> None:
    plain, a, b = (block_keys(IDS, [], [], 64, salt=salt) for salt in ("", "tenant:a", "tenant:b"))
    assert plain == block_keys(IDS, [], [], 64)
    assert not set(a) & set(b) and not set(a) & set(plain)
    assert block_keys([*IDS, *range(300, 340)], [], [], 100, a, "tenant:a")[:4] == a   # resumed under its salt


def test_keys_go_on_from_those_already_worked_out() -> None:
    ids = [*IDS, *range(300, 340)]                # a prompt of 64 tokens, then 40 generated
    prompt = block_keys(IDS, [], [], 64)
    assert block_keys(ids, [], [], 100, prompt) == block_keys(ids, [], [], 100)
    assert block_keys(ids, [], [], 40, prompt) == prompt[:2]   # fewer tokens than the known keys cover
