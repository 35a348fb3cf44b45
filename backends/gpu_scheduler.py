"""One loop per GPU (simulated or real): what runs next when a GPU holds a vision encoder, a decoder, or both.

The rules are `backends.scheduling`'s, which the discrete-event simulator runs too. Vision first
(work stealing P1, modality paper §5.3): whenever an encode batch is ready it runs before the next
language step, so a vision burst waits at most one language step. Language steps on
a stealing GPU are kept short by its batcher (half batch, bounded prefill per step), which bounds
that wait. While an encode batch is still filling (aligned batching), language steps go on.
A `both` (monolithic) GPU runs the same loop without the bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from backends.executors import LanguageExecutor
from backends.scheduling import next_activity
from backends.vision_executor import VisionExecutor


class GpuScheduler:
    def __init__(self, language: LanguageExecutor | None, vision: VisionExecutor | None, *, stealing: bool) -> None:
        self.language, self.vision = language, vision
        self.stealing = stealing
        self._wake = asyncio.Event()
        self.steal_episodes = 0
        self.tokens_stolen = 0
        self._in_episode = False

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            wait_s = self.vision.ready_in(time.monotonic()) if self.vision else float("inf")
            activity = next_activity(wait_s, self.language is not None and self.language.has_work)
            if activity == "encode":
                assert self.vision is not None
                self._in_episode = False
                await self.vision.run_batch()
            elif activity == "language":
                assert self.language is not None
                tokens = await self.language.run_step()
                if self.stealing:
                    self._count_steal(tokens)
            else:
                self._in_episode = False
                timeout = None if wait_s == float("inf") else wait_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)

    def _count_steal(self, tokens: int) -> None:
        if not self._in_episode:
            self._in_episode = True
            self.steal_episodes += 1
        self.tokens_stolen += tokens
