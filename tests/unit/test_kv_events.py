"""Engines' KV cache events: vLLM's wire format decoded (batches packed here by hand in the array form
vLLM's msgspec structs take, not by this project's encoder), the events carried into the prefix
index's block names, and the index following what the engine stores, evicts and clears."""

from __future__ import annotations

import random
from pathlib import Path

import msgpack
import pytest

from common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventError,
    decode_batch,
    decode_sequence,
    encode_batch,
    encode_sequence,
)
from common.prefix_blocks import block_hashes
from gateway.demo_kv_cache import DemoKvCache
from gateway.routing.engine_blocks import EngineBlocks
from gateway.routing.prefix_index import PrefixIndex


def tokens(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 32000) for _ in range(n)]


def vllm_batch(*events: list[object]) -> bytes:
    """A batch as vLLM's ZmqEventPublisher sends it: KVEventBatch(ts, events, data_parallel_rank), array-like."""
    return msgpack.packb([1764400000.5, list(events), None], use_bin_type=True)


def engine_stored(ids: list[int], first: int, parent: object, size: int = 16, **extra: object) -> list[object]:
    """A BlockStored of the blocks of `ids`, the engine's hashes first, first + 1, ... (its own names)."""
    count = len(ids) // size
    return ["BlockStored", list(range(first, first + count)), parent, ids[:count * size], size,
            extra.get("lora_id"), extra.get("medium", "GPU"), extra.get("lora_name")]


def test_a_vllm_batch_decodes_and_extra_fields_or_kinds_are_skipped() -> None:
    ids = tokens(32)
    payload = vllm_batch(["BlockStored", [b"\x01" * 32, b"\x02" * 32], None, ids, 16, None, "GPU", None, None, 5],
                         ["BlockRemoved", [7, 8], "GPU"], ["SomethingNewer", 1], ["AllBlocksCleared"])
    batch = decode_batch(payload)
    assert batch.ts == 1764400000.5 and batch.skipped == 1
    stored, removed, cleared = batch.events
    assert stored == BlockStored([b"\x01" * 32, b"\x02" * 32], None, ids, 16, None, "GPU")
    assert removed == BlockRemoved([7, 8], "GPU")
    assert cleared == AllBlocksCleared()
    # an older vLLM: no medium, no lora fields
    old = decode_batch(vllm_batch(["BlockStored", [1], 5, ids[:16], 16], ["BlockRemoved", [1]]))
    assert old.events == [BlockStored([1], 5, ids[:16], 16), BlockRemoved([1])]
    # blocks keyed by more than their tokens (vLLM's extra_keys: a cache salt, an image; an adapter's name)
    salted = ["BlockStored", [1, 2], None, ids, 16, None, "GPU", None, [["tenant-a"], None]]
    adapter = ["BlockStored", [1, 2], None, ids, 16, None, "GPU", "my-lora", None]
    assert [e.keyed for e in decode_batch(vllm_batch(salted, adapter)).events] == [True, True]


def test_the_map_form_of_later_vllm_versions_decodes_the_same() -> None:
    """Structs no longer array-like: the batch and each event a map, the event's kind under "type"."""
    ids = tokens(32)
    payload = msgpack.packb({"ts": 3.5, "events": [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": ids,
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": None},
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
        {"type": "AllBlocksCleared"}], "data_parallel_rank": 0}, use_bin_type=True)
    batch = decode_batch(payload)
    assert batch.ts == 3.5
    assert batch.events == [BlockStored([1, 2], None, ids, 16, None, "GPU"), BlockRemoved([2], "GPU"),
                            AllBlocksCleared()]


@pytest.mark.parametrize("payload, message", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb({"ts": 1}), "a batch is an array"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, ["a"], 16]]]), "token_ids"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [1], 0]]]), "block_size"),
    (msgpack.packb([1.0, [["BlockStored", [1.5], None, [1], 16]]]), "block hash"),
    (msgpack.packb([1.0, [["BlockRemoved"]]]), "BlockRemoved has block_hashes"),
    (msgpack.packb([1.0, [[]]]), "led by its kind"),
    (msgpack.packb(["now", []]), "ts"),
    (b"\x92\x00\x91\x81\x91\x01\x01", "not msgpack"),   # a map keyed by an array
    (msgpack.packb({"ts": 1.0, "events": [{"block_hashes": [1]}]}), "its kind under"),
])
def test_what_is_not_a_batch_is_refused_with_a_reason(payload: bytes, message: str) -> None:
    with pytest.raises(KvEventError, match=message):
        decode_batch(payload)


def test_encode_and_sequence_numbers_round_trip() -> None:
    events = [BlockStored([1, 2], None, tokens(32), 16, None, "GPU"), BlockRemoved([3], "GPU"), AllBlocksCleared()]
    assert decode_batch(encode_batch(2.0, events)).events == events
    assert decode_sequence(encode_sequence(2**40 + 3)) == 2**40 + 3
    with pytest.raises(KvEventError):
        decode_sequence(b"\x00\x01")


def test_engine_blocks_name_the_index_blocks_a_prompt_of_token_ids_has() -> None:
    """Engine blocks of 16 tokens, stored in two events (the second continuing the first by its parent),
    give exactly the index's 64-token block hashes of the prompt."""
    ids = tokens(200)
    blocks = EngineBlocks(64)
    first, _ = blocks.apply(BlockStored(list(range(100, 105)), None, ids[:80], 16))     # 5 engine blocks
    second, _ = blocks.apply(BlockStored(list(range(105, 112)), 104, ids[80:192], 16))  # 7 more, after block 104
    assert first + second == block_hashes(token_ids=ids, block_tokens=64) == block_hashes(token_ids=ids[:192],
                                                                                           block_tokens=64)
    assert len(first) == 1 and len(second) == 2
    # the engine evicts the blocks that filled index blocks 2 and 3 (engine blocks 107 and 111): both lost
    _, lost = blocks.apply(BlockRemoved([111, 107, 110]))
    assert lost == second[::-1]
    assert blocks.describe()["removed_blocks"] == 3


def test_engine_blocks_larger_than_the_index_blocks_fill_and_lose_several() -> None:
    ids = tokens(512, seed=5)
    blocks = EngineBlocks(64)
    stored, _ = blocks.apply(BlockStored([1, 2, 3, 4], None, ids, 128))
    assert stored == block_hashes(token_ids=ids, block_tokens=64)
    _, lost = blocks.apply(BlockRemoved([2]))
    assert lost == stored[2:4]


def test_blocks_that_cannot_be_placed_are_unmatched_not_guessed() -> None:
    ids = tokens(64)
    blocks = EngineBlocks(64)
    assert blocks.apply(BlockStored([1, 2, 3, 4], 999, ids, 16)) == ([], [])        # parent never seen
    assert blocks.apply(BlockStored([1, 2, 3, 4], None, ids, 16, lora_id=3)) == ([], [])   # under an adapter
    assert blocks.apply(BlockStored([1, 2, 3, 4], None, ids, 16, medium="CPU")) == ([], [])  # offloaded copy
    assert blocks.apply(BlockStored([1, 2, 3, 4], None, ids[:60], 16)) == ([], [])  # tokens do not fill them
    assert blocks.apply(BlockStored([1, 2, 3, 4], None, ids, 16, keyed=True)) == ([], [])   # salted, say
    assert blocks.describe()["unmatched_blocks"] == 20
    stored, _ = blocks.apply(BlockStored([1, 2, 3, 4], None, ids, 16))
    assert stored == block_hashes(token_ids=ids, block_tokens=64)


def test_the_index_follows_what_the_engine_stores_evicts_and_clears() -> None:
    index = PrefixIndex(block_tokens=64)
    index.add_backend("a", 50_000)
    index.add_backend("b", 50_000)
    ids = tokens(600)
    hashes = index.hashes("", ids, len(ids))
    assert index.lookup(hashes, "", len(ids)).cached == {}
    # another client's request on b (never routed by this gateway) is stored there: b holds the prefix
    index.engine_events("b", [BlockStored(list(range(1, 38)), None, ids[:592], 16)])
    assert index.lookup(hashes, "", len(ids)).cached == {"b": 576}
    assert index.describe("b")["source"] == "events" and index.describe("a")["source"] == "estimate"
    assert index.describe("b")["events"]["stored_blocks"] == 37
    # b evicts the engine block that filled the index's 5th block: the hit stops before it
    index.engine_events("b", [BlockRemoved([20])])
    assert index.lookup(hashes, "", len(ids)).cached == {"b": 256}
    index.engine_events("b", [AllBlocksCleared()])
    assert index.lookup(hashes, "", len(ids)).cached == {}
    described = index.describe("b")
    assert described["blocks"] == 0 and described["events"]["cleared"] == 1


@pytest.mark.parametrize("events, named, kept", [(False, True, False), (True, True, True), (True, False, False)])
def test_events_take_over_from_the_counters_only_for_prompts_they_can_name(events: bool, named: bool,
                                                                            kept: bool) -> None:
    """An engine whose counters report fewer hits than predicted shrinks keep_i, unless its events say
    which blocks it holds: prompts of token ids (named). Prompts hashed from text get no BlockRemoved,
    so for them the counters go on correcting keep_i."""
    index = PrefixIndex(block_tokens=64)
    index.add_backend("a", 50_000)
    if events:
        index.engine_events("a", [BlockStored([1, 2, 3, 4], None, tokens(64, seed=9), 16)])
    ids = tokens(1000, seed=2)
    hashes = index.hashes("", ids, 1000) if named else index.hashes(" ".join(map(str, ids)), (), 1000)
    index.record(index.lookup(hashes, "", 1000, named), "a", 50_000)
    index.observe("a", 1, 0)
    for k in range(1, 40):
        index.record(index.lookup(hashes, "", 1000, named), "a", 50_000)
        index.observe("a", 1 + 1000 * k, 0)   # the engine finds nothing cached
    described = index.describe("a")
    assert (described["keep"] == 1.0) is kept
    assert described["source"] == ("events" if kept else "engine")


def test_lost_batches_forget_the_chain_until_the_engine_stores_afresh() -> None:
    index = PrefixIndex(block_tokens=64)
    index.add_backend("a", 50_000)
    ids = tokens(256, seed=3)
    index.engine_events("a", [BlockStored([1, 2, 3, 4], None, ids[:64], 16)])
    index.engine_events_lost("a", 2)
    index.engine_events("a", [BlockStored([5, 6, 7, 8], 4, ids[64:128], 16)])   # continues a forgotten block
    described = index.describe("a")
    assert described["events"]["lost_batches"] == 2 and described["events"]["unmatched_blocks"] == 4
    assert index.lookup(index.hashes("", ids, 256), "", 256).cached == {"a": 64}   # the first block still held


def test_the_demo_caches_token_prompts_as_vllm_and_its_events_rebuild_its_cache() -> None:
    """The demo upstream's cache (no socket: its events collected) and an index fed those events agree
    on what a prompt finds cached."""
    published: list[list[object]] = []

    class Collect:
        def publish(self, events: list[object]) -> None:
            published.append(list(events))

    cache = DemoKvCache(64, Collect())   # type: ignore[arg-type]
    index = PrefixIndex(block_tokens=16)
    index.add_backend("e", 64 * 16)
    prompts = [tokens(300, seed=s) for s in range(4)]
    for p in prompts + prompts[:1]:
        cache.admit(p)
    for events in published:
        index.engine_events("e", events)   # type: ignore[arg-type]
    # 64 blocks hold 72 of the 90 admitted: p0's last 8 went, then (p0 again) p1's
    found = [index.lookup(index.hashes("", p, 300), "", 300).cached.get("e", 0) for p in prompts]
    assert found == [288, 160, 288, 288]
    assert [cache.admit(p) for p in (prompts[2], prompts[3], prompts[0])] == [288, 288, 288]
    cache.reset()
    index.engine_events("e", published[-1])   # type: ignore[arg-type]
    assert index.lookup(index.hashes("", prompts[0], 300), "", 300).cached == {}


@pytest.mark.parametrize("change, message", [
    ({"kv_events": {"endpoint": "tcp://127.0.0.1:70000"}}, "the port is 1-65535"),
    ({"kv_events": {"endpoint": "http://127.0.0.1:5557"}}, "String should match pattern"),
    ({"kind": "engine", "address": "127.0.0.1:7000"}, "apply to kind: openai backends only"),
    ({"routing_off": True}, "prefix_cache.enabled: false turns off"),
    ({"kv_events": {"endpoint": "tcp://*:5557"}}, "the gateway connects to the engine: name its host"),
    ({"twice": True}, "backends up and up2 name one kv_events endpoint"),
    ({"kv_events": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5557"}},
     "is the events' endpoint"),
    ({"kv_events": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://*:5558"}}, "name its host"),
    ({"kv_events": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558",
                    "replay_timeout_ms": 0}}, "greater than 0"),
    ({"kv_events": {"endpoint": "tcp://127.0.0.1:5557", "replay_timeout_ms": 500}}, "name it \\(replay_endpoint\\)"),
    ({"shared_replay": True}, "backends up and up2 name one kv_events endpoint tcp://127.0.0.1:5558"),
])
def test_a_kv_events_entry_that_cannot_work_is_refused(change: dict[str, object], message: str) -> None:
    from pydantic import ValidationError

    from gateway.config.cluster import ClusterFile

    backend: dict[str, object] = {"id": "up", "kind": "openai", "gpu": "H100", "address": "http://127.0.0.1:8001",
                                  "kv_events": {"endpoint": "tcp://127.0.0.1:5557"}}
    gateway: dict[str, object] = {}
    if change.pop("routing_off", False):
        gateway = {"routing": {"prefix_cache": {"enabled": False}}}
    backends = [backend, {**backend, "id": "up2"}] if change.pop("twice", False) else [backend]
    if change.pop("shared_replay", False):   # two engines' events, one replay socket named for both
        backend["kv_events"] = {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}
        backends = [backend, {**backend, "id": "up2", "address": "http://127.0.0.1:8002",
                              "kv_events": {"endpoint": "tcp://127.0.0.1:5559", "replay_endpoint": "tcp://127.0.0.1:5558"}}]
    backend.update(change)
    with pytest.raises(ValidationError, match=message):
        ClusterFile.model_validate({"model": "llava-1.5-7b", "gateway": gateway, "backends": backends})


def test_a_tokenizer_folder_without_a_tokenizer_is_refused_naming_the_setting(tmp_path: Path) -> None:
    from common.errors import ConfigError
    from gateway.config.cluster import load_cluster

    (tmp_path / "empty").mkdir()
    path = tmp_path / "backends.yaml"
    path.write_text("model: llava-1.5-7b\ntokenizer: empty\nbackends:\n"
                    "  - {id: up, kind: openai, gpu: H100, address: 'http://127.0.0.1:8001'}\n")
    with pytest.raises(ConfigError, match=r"tokenizer: .*empty holds no tokenizer \(tokenizer_config.json\)"):
        load_cluster(path)
