"""The pure rules of one GPU's loop, shared by the engine and the discrete-event simulator.

An engine's GPU (backends/gpu_scheduler.py, backends/vision_executor.py) and a simulated one
(loadtest/sim/vlm.py) decide the same way, from numbers, with no clock and no I/O here:

- **vision first** (work stealing P1, modality paper §5.3): an encode batch that is ready runs before
  the next language step; otherwise a language step runs if there is work; otherwise the GPU sleeps
  until the pending encode batch times out or new work arrives (`next_activity`);
- **aligned batches** (modality paper §5.2): images queue until `max_images` of them wait or the
  oldest has waited `timeout_s` (`ready_in`); a batch takes whole requests in arrival order up to
  `max_images` images, and always at least one request (`take_batch`);
- **a stealing GPU keeps its language steps short**: half the batch cap, and at most the prompt
  tokens it prefills within one episode bound per step (`stealing_limits`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Literal, Protocol, TypeVar

Activity = Literal["encode", "language", "sleep"]


class QueuedImages(Protocol):
    """One request's images waiting for the encoder."""

    @property
    def images(self) -> int: ...

    @property
    def queued_s(self) -> float: ...


Job = TypeVar("Job", bound=QueuedImages)


def next_activity(encode_ready_in_s: float, language_has_work: bool) -> Activity:
    """Vision first, then a language step, else sleep (for `encode_ready_in_s`, or until woken if inf)."""
    if encode_ready_in_s == 0.0:
        return "encode"
    return "language" if language_has_work else "sleep"


def ready_in(queue: Iterable[QueuedImages], now: float, max_images: int, timeout_s: float) -> float:
    """Seconds until the next aligned batch is ready (0: ready now); inf when nothing is queued."""
    images, oldest = 0, None
    for job in queue:
        if oldest is None:
            oldest = job.queued_s
        images += job.images
        if images >= max_images:
            return 0.0
    if oldest is None:
        return float("inf")
    return max(0.0, oldest + timeout_s - now)


def take_batch(queue: deque[Job], max_images: int) -> list[Job]:
    """Pop the next batch: whole requests in order while their images fit `max_images` (the first always)."""
    batch: list[Job] = []
    images = 0
    while queue and (not batch or images + queue[0].images <= max_images):
        job = queue.popleft()
        batch.append(job)
        images += job.images
    return batch


def stealing_limits(max_batch: int, episode_s: float, prefill_s_per_token: float) -> tuple[int, int]:
    """A stealing vision GPU's language batcher: (batch cap, prompt tokens prefilled per step)."""
    return max(1, max_batch // 2), int(episode_s / prefill_s_per_token)
