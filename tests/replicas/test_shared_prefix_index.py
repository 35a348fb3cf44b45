"""Replicas share their prefix index and their encoders' index through the real Redis: a conversation's
next turn, routed by another replica, is predicted cached where the first replica sent its first turn,
and a repeated image where the first replica had it encoded."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from common.prefix_blocks import block_hashes, content_digest, session_key
from gateway.config.sections import RedisConfig
from gateway.replicas.shared_state import SharedState, connect
from gateway.routing.encoder_index import EncoderIndex
from gateway.routing.prefix_index import PrefixIndex
from tests.replicas.redis_helpers import SYSTEM_REDIS, redis_prefix, table

pytestmark = pytest.mark.timeout(30)
GPUS = {"h100-0": "H100", "l40s-0": "L40S"}
PROMPT = "".join(f"system prompt block {k:043d}\n" for k in range(40))   # 40 blocks of 64 bytes: 640 tokens


@asynccontextmanager
async def replica(prefix: str, name: str, encoders: EncoderIndex | None = None,
                  **config: object) -> AsyncIterator[tuple[SharedState, PrefixIndex]]:
    index = PrefixIndex()
    for backend_id in GPUS:
        index.add_backend(backend_id, 100_000)
    cfg = RedisConfig(url=SYSTEM_REDIS, key_prefix=prefix, **config)  # type: ignore[arg-type]
    client = connect(cfg, SYSTEM_REDIS)
    try:
        yield SharedState(table(GPUS), client, cfg, name, prefixes=index, encoders=encoders), index
    finally:
        await client.aclose()


def route(index: PrefixIndex, prompt: str, backend_id: str, session: str = "") -> None:
    tokens = len(prompt.encode()) // 4
    index.record(index.lookup(index.hashes(prompt, (), tokens), session, tokens), backend_id, 100_000)


def predicted(index: PrefixIndex, prompt: str, session: str = "") -> dict[str, int]:
    tokens = len(prompt.encode()) // 4
    return dict(index.lookup(index.hashes(prompt, (), tokens), session, tokens).cached)


async def test_what_one_replica_routed_is_predicted_cached_by_the_others() -> None:
    with redis_prefix("prefix") as prefix:
        async with replica(prefix, "a") as (ra, a), replica(prefix, "b") as (rb, b), \
                replica(prefix, "c") as (rc, c):
            route(a, PROMPT, "l40s-0")
            assert predicted(b, PROMPT + "next turn") == {}   # not shared before a refresh
            for shared in (ra, rb, rc):
                await shared.refresh()
            turn_two = PROMPT + "and the next turn of the conversation"
            assert predicted(b, turn_two) == predicted(c, turn_two) == predicted(a, turn_two) == {"l40s-0": 640}
            # b routes the second turn elsewhere; after the next refresh a and c know both
            route(b, turn_two, "h100-0")
            for shared in (rb, ra, rc):   # b publishes, then the others read
                await shared.refresh()
            assert set(predicted(a, turn_two + " and a third")) == {"l40s-0", "h100-0"}
            # each replica applied the others' records, never its own again
            assert (ra.prefix_entries_applied, rb.prefix_entries_applied, rc.prefix_entries_applied) == (1, 1, 2)
            # every replica's predicted counters count what all routed, as the engines' counters do
            seen = [(x.describe("h100-0")["predicted_query_tokens"], x.describe("h100-0")["predicted_hit_tokens"])
                    for x in (a, b, c)]
            assert seen[0] == seen[1] == seen[2] and seen[0][0] > 0 and seen[0][1] == 0, seen


async def test_a_named_session_sticks_across_replicas() -> None:
    with redis_prefix("prefix-session") as prefix:
        async with replica(prefix, "a") as (ra, a), replica(prefix, "b") as (rb, b):
            route(a, "x" * 256, "h100-0", session="conversation-7")
            await ra.refresh()
            await rb.refresh()
            assert predicted(b, "a rewritten history " * 30, session="conversation-7") == {"h100-0": 64}
            assert predicted(b, "a rewritten history " * 30, session="conversation-8") == {}


async def test_a_replica_that_joins_later_reads_what_was_routed_before_it() -> None:
    with redis_prefix("prefix-late") as prefix:
        async with replica(prefix, "a") as (ra, a):
            route(a, PROMPT, "h100-0")
            await ra.refresh()
        async with replica(prefix, "late", prefix_batch_max=1) as (rl, late):
            await rl.refresh()   # one entry a refresh at most: the stream is read in order, none skipped
            assert predicted(late, PROMPT + "more") == {"h100-0": 640}


async def test_which_encoder_got_an_image_is_shared_too() -> None:
    cat, dog = (content_digest(b"cat picture"), 576), (content_digest(b"dog picture"), 576)
    ea, eb = EncoderIndex(), EncoderIndex()
    with redis_prefix("prefix-encoders") as prefix:
        async with replica(prefix, "a", ea) as (ra, a), replica(prefix, "b", eb) as (rb, _):
            ea.record([cat], "vision-1")
            route(a, PROMPT, "h100-0")    # prefix and encoder records share the stream
            await ra.refresh()
            await rb.refresh()
            assert eb.cached([cat, dog]) == {"vision-1": 576}
            assert rb.prefix_entries_applied == 2 and eb.held("vision-1") == 1


def test_shared_hashes_are_the_same_in_every_process() -> None:
    """Text blocks and session keys hashed with `stable` agree across processes with different hash seeds;
    the per-process ones do not (which is why replicas that share switch to the stable ones)."""
    code = ("from common.prefix_blocks import block_hashes, session_key; import sys; stable = sys.argv[1] == 's'; "
            f"print(repr((block_hashes({PROMPT!r}, block_tokens=64, stable=stable), "
            "session_key('conversation-7', stable=stable))))")

    def other_process(mode: str, seed: str) -> str:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        return subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True,
                              env=env, timeout=20).stdout.strip()

    here = repr((block_hashes(PROMPT, block_tokens=64, stable=True), session_key("conversation-7", stable=True)))
    assert other_process("s", "1") == other_process("s", "2") == here
    assert other_process("u", "1") != other_process("u", "2")
