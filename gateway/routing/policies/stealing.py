"""Which vision backends may take language work right now (work stealing, modality paper §5.3).

A vision backend marked `steal` (decoder weights loaded) is a language candidate only while its
own vision backlog is empty, the language pool's backlog (requests waiting, not yet running, in
the language engines) is at least τ, and it holds fewer than `max_batch` language requests: the
paper's bounded assistance (P3; its 4090s steal at most 16 sequences, what their small KV cache
holds). Without that bound a router that ranks by prefill speed keeps feeding a fast-but-small
stealer, and its requests then queue behind a cache that fits few of them.
Pure: snapshots and numbers in, snapshots out.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.policies.contracts import BackendSnapshot

DEFAULT_THRESHOLD = 16
DEFAULT_MAX_BATCH = 16


def stealers(
    vision: Sequence[BackendSnapshot], language_backlog: int, threshold: int, max_batch: int = DEFAULT_MAX_BATCH
) -> list[BackendSnapshot]:
    if language_backlog < threshold:
        return []
    return [b for b in vision
            if b.steal and b.vision_backlog == 0 and b.kv_total_bytes > 0 and b.queue_depth < max_batch]
