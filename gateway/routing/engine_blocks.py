"""An engine's KV events translated into the prefix index's blocks: which of the index's block hashes
the engine's cache now holds, and which it lost.

The index names a prompt's blocks by chained hashes of `block_tokens` token ids (64 by default;
`common.prefix_blocks`, hash((previous, ids of the block))); an engine names its own blocks of
`block_size` tokens (16 in vLLM) by its own hash. A `BlockStored` event carries the tokens of the blocks
it stores and the engine's hash of the block before them, so the index's chain can be carried along the
engine's: for every engine block this keeps the index's chain hash so far and the tokens since the
index's last full block. An engine block that fills an index block names that block (it is then held
by the engine); its removal (`BlockRemoved`) takes the index block out again. An engine block whose
parent was never seen here (stored before the gateway listened, or in a message lost on the way) cannot
be placed in the chain: its blocks are counted as unmatched and ignored, until the engine stores that
prefix afresh.

What this does not see: the blocks of prompts whose token ids the gateway does not have (text prompts
to an upstream are hashed from their text, which never matches the engine's token ids; an engine's
events then name nothing the index looks up), blocks under a LoRA adapter, on another medium than the
GPU (a CPU offloading tier), or keyed by more than their tokens (vLLM's `extra_keys`: a cache salt, an
image): those are counted as unmatched, and so are the blocks stored after them. The index names a
salted prompt's blocks from the salt's own chain, so salted prompts (every prompt with
`tenants.isolate_prefix_cache`) find no block through events.
An index block spans several engine blocks; only the removal of the one that filled it is seen as its
loss (vLLM frees a sequence's blocks tail first, so that one goes first as a rule).

Memory: one entry per engine block the engine holds (the events remove them as it evicts), the tokens
of one store shared by its blocks: about 0.3 kB a block of 16 tokens; at most
`max_blocks`, past which the oldest are forgotten (their children then count as unmatched). An engine
of 1-token pages (SGLang's default page size) would cost as much a cached token: give the gateway the
events of engines whose pages are 16 tokens or more.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, KvEvent


class _Placed(NamedTuple):
    chain: int                    # the index's chain hash after the last full index block up to here
    tokens: tuple[int, ...]       # the tokens of the store that placed it (shared by its blocks) ...
    start: int                    # ... of which tokens[start:end] are those since that index block
    end: int
    fills: tuple[int, ...]        # the index blocks this engine block completed (mostly none or one)


ROOT = _Placed(0, (), 0, 0, ())   # the prompt's start (no cache salt)


class EngineBlocks:
    """One backend's engine blocks as index blocks. `apply` takes one event and returns (index blocks
    the engine now holds, index blocks it no longer holds); `cleared` after an AllBlocksCleared."""

    def __init__(self, block_tokens: int, max_blocks: int = 1 << 20) -> None:
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._placed: OrderedDict[EngineHash, _Placed] = OrderedDict()
        self.stored_blocks = 0        # engine blocks stored and placed in the chain
        self.removed_blocks = 0       # engine blocks removed that were known here
        self.unmatched_blocks = 0     # engine blocks stored that could not be placed (parent unknown, LoRA, ...)
        self.cleared = 0              # AllBlocksCleared events

    def apply(self, event: KvEvent) -> tuple[list[int], list[int]]:
        if isinstance(event, BlockStored):
            return self._stored(event), []
        if isinstance(event, BlockRemoved):
            return [], self._removed(event)
        if isinstance(event, AllBlocksCleared):
            self._placed.clear()
            self.cleared += 1
        return [], []

    def _stored(self, e: BlockStored) -> list[int]:
        count, size = len(e.block_hashes), e.block_size
        if (e.lora_id is not None or e.keyed or (e.medium is not None and e.medium.upper() != "GPU")
                or len(e.token_ids) != count * size):
            self.unmatched_blocks += count
            return []
        at = ROOT if e.parent_block_hash is None else self._placed.get(e.parent_block_hash)
        if at is None:
            self.unmatched_blocks += count
            return []
        placed, width = self._placed, self.block_tokens
        # the parent's tail and the stored tokens, in one tuple the stored blocks share (a slice each cost
        # more time and memory); the index blocks they fill hashed as common.prefix_blocks._id_chain does
        tokens = at.tokens[at.start:at.end] + tuple(e.token_ids)
        chains: list[int] = []
        chain = at.chain
        for start in range(0, len(tokens) - width + 1, width):
            chain = hash((chain, tokens[start:start + width]))
            chains.append(chain)
        done, end = 0, at.end - at.start
        for engine_hash in e.block_hashes:
            end += size
            now = end // width   # index blocks complete up to the end of this engine block
            placed[engine_hash] = _Placed(chains[now - 1] if now else at.chain, tokens, now * width, end,
                                          tuple(chains[done:now]))
            done = now
        self.stored_blocks += count
        while len(placed) > self.max_blocks:
            placed.popitem(last=False)
        return chains

    def _removed(self, e: BlockRemoved) -> list[int]:
        if e.medium is not None and e.medium.upper() != "GPU":
            return []
        lost: list[int] = []
        for engine_hash in e.block_hashes:
            placed = self._placed.pop(engine_hash, None)
            if placed is not None:
                self.removed_blocks += 1
                lost += placed.fills
        return lost

    def forget(self) -> None:
        """What the engine holds is no longer known (events were lost): later stores that continue a
        prefix stored before are unmatched until the engine stores it afresh."""
        self._placed.clear()

    def describe(self) -> dict[str, Any]:
        return {"engine_blocks": len(self._placed), "stored_blocks": self.stored_blocks,
                "removed_blocks": self.removed_blocks, "unmatched_blocks": self.unmatched_blocks,
                "cleared": self.cleared}

