"""The simulator's prefix-cache model: engines that cache shared prefixes, and the gateway's index routing."""

from __future__ import annotations

import pytest

from loadtest.sim.simulator import RunSpec, run
from loadtest.sim.workloads import lengths

GPUS = ("H100", "A100-80GB", "L40S", "L40S")


def spec(prefix_cache: str, load: float = 1.5, seed: int = 1, mode: str = "continuous") -> RunSpec:
    return RunSpec(gpus=GPUS, policy="marginal_delay", model="llava-1.5-7b", mode=mode, workload="shared_prefix",
                   load=load, n_requests=600, seed=seed, prefix_cache=prefix_cache)


def test_a_tenants_requests_share_their_system_prompts_blocks_and_nothing_else() -> None:
    ls = lengths("shared_prefix", 400, seed=3)
    assert ls.prefix_group is not None and ls.prefix_tokens is not None
    group = ls.prefix_group.tolist()
    a, b = next((i, j) for i in range(400) for j in range(i + 1, 400) if group[i] == group[j] >= 0)
    other = next(k for k in range(400) if group[k] not in (-1, group[a]))
    alone = next(k for k in range(400) if group[k] == -1)
    shared = int(ls.prefix_tokens[a]) // 16
    ba, bb = ls.blocks(a, 16), ls.blocks(b, 16)
    assert len(ba) == int(ls.input_tokens[a]) // 16
    assert ba[:shared] == bb[:shared] and ba[shared] != bb[shared]
    assert not set(ba) & set(ls.blocks(other, 16))
    assert not set(ls.blocks(alone, 16)) & (set(ba) | set(ls.blocks(other, 16)))


def test_engines_report_hits_and_the_gateways_index_raises_them_and_cuts_first_token_times() -> None:
    engines, index = run(spec("engines")), run(spec("index"))
    assert "prefix_hit_rate" not in run(spec("off"))
    assert engines["prefix_hit_rate"] > 0.3   # the engines' own caches catch repeats by chance
    assert index["prefix_hit_rate"] > engines["prefix_hit_rate"] + 0.05
    assert index["ttft_p95_s"] < engines["ttft_p95_s"]
    assert index["completed"] == engines["completed"] == 600


def test_the_prefix_cache_needs_continuous_batching() -> None:
    with pytest.raises(ValueError, match="continuous"):
        run(spec("index", mode="serial"))
    with pytest.raises(ValueError, match="one of"):
        run(spec("everywhere"))
