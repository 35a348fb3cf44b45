"""KV cache events on the wire, as vLLM and SGLang publish them: what an engine's prefix cache stored,
evicted or cleared, so that a router can know what each engine holds instead of guessing.

vLLM (`vllm serve ... --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'`) and SGLang (`--kv-events-config`, the same format) publish on a ZeroMQ
PUB socket one message per batch of events, three frames:

    topic (bytes, "" by default) | sequence number (8 bytes, big-endian, +1 a batch) | batch (msgpack)

and the batch is msgspec's encoding of `KVEventBatch`: in the array form of the versions that declare
their structs `array_like` (and SGLang's), `[ts, [event, ...], data_parallel_rank]`, each event an array
whose first item names its kind:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
     extra_keys, ...]
    ["BlockRemoved", block_hashes, medium, ...]
    ["AllBlocksCleared", ...]

and in the map form of later vLLM versions, `{"ts": ..., "events": [...], ...}` with each event a map
of the same fields named, its kind under "type". Both are read.

`block_hashes` are the engine's own names for its blocks (ints, or bytes from a sha256 hash function),
first to last along the prompt; `parent_block_hash` the block before the first (None: the prompt's
start); `token_ids` the stored blocks' tokens, `block_size` of them a block. `medium` says where the
blocks are ("GPU", "CPU" for an offloading tier; None in versions before it). `extra_keys` (per block)
and `lora_name` say a block is keyed by more than its tokens (a cache salt, an image, an adapter):
`BlockStored.keyed`. Items past those named here are ignored: later versions append some. This module
decodes a batch (`decode_batch`) and encodes one (`encode_batch`, for the packaged demo upstream, which
publishes events as vLLM does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

EngineHash = int | bytes   # an engine's name for one of its blocks


class KvEventError(ValueError):
    """A message that is not a KV event batch in vLLM's format."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: Sequence[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    keyed: bool = False   # some block is keyed by more than its tokens (vLLM's extra_keys, lora_name)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: Sequence[EngineHash]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[KvEvent]
    skipped: int   # events of kinds this module does not know (a newer engine's)


def _hash(value: Any) -> EngineHash:
    if isinstance(value, (int, bytes)) and not isinstance(value, bool):
        return value
    raise KvEventError(f"a block hash is an int or bytes, not {type(value).__name__}")


def _hashes(value: Any) -> list[EngineHash]:
    if not isinstance(value, list):
        raise KvEventError("block_hashes is not a list")
    return [_hash(v) for v in value]


FIELDS = {   # each kind's fields in the array form's order (the map form names them)
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _fields(item: Any) -> tuple[str, dict[str, Any]]:
    """An event's kind and its fields by name, from either form."""
    if isinstance(item, dict) and isinstance(item.get("type"), str):
        return item["type"], item
    if isinstance(item, list) and item and isinstance(item[0], str):
        return item[0], dict(zip(FIELDS.get(item[0], ()), item[1:], strict=False))
    raise KvEventError("an event is an array led by its kind's name, or a map with its kind under \"type\"")


def _keyed(extra_keys: Any) -> bool:
    """Whether some block is keyed by more than its tokens (a cache salt, an image, an adapter's name)."""
    return isinstance(extra_keys, list) and any(k not in (None, [], ()) for k in extra_keys)


def _event(item: Any) -> KvEvent | None:
    """One event of a batch; None for a kind not known here."""
    kind, f = _fields(item)
    if kind == "BlockStored":
        if not {"block_hashes", "parent_block_hash", "token_ids", "block_size"} <= f.keys():
            raise KvEventError("BlockStored has block_hashes, parent_block_hash, token_ids and block_size")
        tokens, size, parent = f["token_ids"], f["block_size"], f["parent_block_hash"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise KvEventError("BlockStored token_ids is not a list of ints")
        if not isinstance(size, int) or size < 1:
            raise KvEventError("BlockStored block_size is not a positive int")
        lora, medium = f.get("lora_id"), f.get("medium")
        return BlockStored(_hashes(f["block_hashes"]), None if parent is None else _hash(parent), tokens, size,
                           lora if isinstance(lora, int) else None, medium if isinstance(medium, str) else None,
                           f.get("lora_name") is not None or _keyed(f.get("extra_keys")))
    if kind == "BlockRemoved":
        if "block_hashes" not in f:
            raise KvEventError("BlockRemoved has block_hashes")
        medium = f.get("medium")
        return BlockRemoved(_hashes(f["block_hashes"]), medium if isinstance(medium, str) else None)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in a message's last frame; KvEventError when it is not one."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:   # TypeError: a map keyed by an array
        raise KvEventError(f"not msgpack: {e}") from None
    if isinstance(batch, dict):   # the map form
        batch = [batch.get("ts"), batch.get("events")]
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise KvEventError("a batch is an array [ts, [events], ...] or a map {ts, events, ...}")
    ts = batch[0]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise KvEventError("a batch's ts is not a number")
    events: list[KvEvent] = []
    skipped = 0
    for item in batch[1]:
        event = _event(item)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return EventBatch(float(ts), events, skipped)


def decode_sequence(frame: bytes) -> int:
    """A message's sequence number (its middle frame)."""
    if len(frame) != 8:
        raise KvEventError(f"a sequence number is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big")


def _array(event: KvEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                event.block_size, event.lora_id, event.medium, None, None]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: Sequence[KvEvent], data_parallel_rank: int | None = None) -> bytes:
    """A batch as an engine publishes it (the message's last frame)."""
    payload: bytes = msgpack.packb([ts, [_array(e) for e in events], data_parallel_rank], use_bin_type=True)
    return payload


def encode_sequence(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


# The replay socket (vLLM's and SGLang's `replay_endpoint`, a ROUTER): a client asks with one frame, the
# first sequence number it wants (8 bytes, big-endian); the publisher answers with one message per batch
# still in its buffer from there, (sequence number, batch) after the empty delimiter frame (later vLLM
# versions put the topic first), then (REPLAY_END, b"").
REPLAY_END = (-1).to_bytes(8, "big", signed=True)


def decode_replay_reply(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """One message of a replay as a DEALER receives it (the delimiter first): its (sequence number,
    batch payload), None for the end marker."""
    if len(frames) not in (3, 4) or frames[0]:
        raise KvEventError(f"a replay message is ['', (topic,) sequence number, batch], not {len(frames)} frames")
    seq, payload = frames[-2], frames[-1]
    if seq == REPLAY_END:
        return None
    return decode_sequence(seq), payload
