"""Which vision backends may take language work right now (work stealing, modality paper §5.3).

A vision backend marked `steal` (decoder weights loaded) is a language candidate only while its
own vision backlog is empty and the language pool's backlog (requests waiting, not yet running, in
the language engines) is at least τ. Pure: snapshots and numbers in, snapshots out.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.policies.contracts import BackendSnapshot

DEFAULT_THRESHOLD = 16


def stealers(vision: Sequence[BackendSnapshot], language_backlog: int, threshold: int) -> list[BackendSnapshot]:
    if language_backlog < threshold:
        return []
    return [b for b in vision if b.steal and b.vision_backlog == 0 and b.kv_total_bytes > 0]
