"""The scaler's decisions with a fake clock: a pool grows under sustained demand and not on a blip, the
sooner the more the demand exceeds its capacity (the up delay counts pressure-seconds), by as many
engines as the demand needs in one step (sized for where its growth takes it within lookahead_s; within
max_step, max and the inventory), counts the engines starting as capacity, and shrinks once the load
averaged over the down delay fits on the engines left, by as many engines as it fits without (within
max_step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from common.errors import ConfigError
from gateway.config.autoscaling import AutoscalingConfig, Pool
from gateway.config.cluster import load_cluster
from gateway.control.autoscaler import PoolDemand, Scaler, pool_demand, pressure
from gateway.daemon import autoscaling_warnings
from gateway.routing.policies.first_token import predicted_ttft_s
from gateway.routing.state_table import Reported, StateTable
from testkit.harness import write_config
from tests.snapshots import catalog


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def config(**pools: Any) -> AutoscalingConfig:
    return AutoscalingConfig.model_validate({"mode": "export", "up_delay_s": 10, "down_delay_s": 60,
                                             "pools": pools or {"vision": {"min": 1, "max": 4}}})


def vision(engines: int, tokens_per_engine: int, **kw: Any) -> dict[Pool, PoolDemand]:
    return {"vision": PoolDemand(engines, engines, backlog_tokens=tokens_per_engine * engines, **kw)}


def run(scaler: Scaler, clock: FakeClock, seconds: float, demand: Any, step: float = 1.0) -> list[int]:
    """Ticks every `step` seconds for `seconds`; the desired count after each."""
    out = []
    for _ in range(int(seconds / step)):
        clock.now += step
        out.append(scaler.decide(demand() if callable(demand) else demand)["vision"].desired)
    return out


def follow(scaler: Scaler, clock: FakeClock, seconds: float, tokens_per_engine: int, engines: int = 1,
           **kw: Any) -> int:
    """Ticks every second for `seconds`, the pool's engines following the desired count (all serving)."""
    for _ in range(int(seconds)):
        clock.now += 1
        engines = scaler.decide(vision(engines, tokens_per_engine, **kw))["vision"].desired
    return engines


def test_grows_under_sustained_demand_after_the_delay_not_on_a_blip() -> None:
    clock = FakeClock()
    scaler = Scaler(config(), clock)
    assert scaler.decide(vision(1, 0))["vision"].desired == 1
    # a blip of 9 s just above the mark (4096 image tokens per engine by default) changes nothing
    assert run(scaler, clock, 9, vision(1, 4200)) == [1] * 9
    assert run(scaler, clock, 5, vision(1, 100)) == [1] * 5
    # sustained: after 10 s the engines that bring 4200 tokens under the mark (2); the same demand on
    # them asks for nothing more
    desired = run(scaler, clock, 25, vision(1, 4200))
    assert desired[:10] == [1] * 10 and desired[10:] == [2] * 15   # the 11th tick: 10 s after the first high one
    # as long as the pressure on the engines it has stays at 1 or more, it keeps growing, a step per delay
    grown, engines, sizes = Scaler(config(), clock), 1, []
    for _ in range(4):
        engines = follow(grown, clock, 11, 5000, engines)
        sizes.append(engines)
    assert sizes == [2, 3, 4, 4]   # max 4


def test_the_up_delay_shrinks_with_the_pressure_a_surge_at_once_a_spike_not_at_all() -> None:
    """The spell's pressure on the capacity, integrated, must reach up_delay_s (10 s): five times the
    capacity steps at the third tick (2 s of it), a spike of three times for two seconds does nothing."""
    clock = FakeClock()
    surge, spike = burst(1, 1, 5 * 4096), burst(1, 1, 3 * 4096)
    assert run(Scaler(config(vision={"min": 1, "max": 8}), clock), clock, 3, surge) == [1, 1, 5]
    scaler = Scaler(config(), clock)
    assert run(scaler, clock, 3, spike) + run(scaler, clock, 20, burst(1, 1, 1000)) == [1] * 23
    # a spike that does not pass leaves no pressure-seconds behind: the next spell starts from nothing
    assert run(scaler, clock, 4, spike) == [1, 1, 1, 1] and run(scaler, clock, 1, spike) == [4]
    # with no engine serving nor starting, any demand is a surge: one tick to confirm it
    empty = Scaler(config(vision={"min": 0, "max": 4}), clock)
    assert run(empty, clock, 2, burst(0, 0, 100)) == [0, 1]


def burst(engines: int, serving: int, tokens: int, **kw: Any) -> dict[Pool, PoolDemand]:
    return {"vision": PoolDemand(engines, serving, backlog_tokens=tokens, **kw)}


def test_a_burst_gets_several_engines_in_one_step_within_max_step_max_and_the_inventory() -> None:
    clock = FakeClock()
    wide = {"min": 1, "max": 10, "max_step": 8}
    scaler = Scaler(config(vision=wide), clock)
    surge = burst(1, 1, 5 * 4096 + 100)    # five engines' worth waiting: six bring it under the mark
    assert run(scaler, clock, 2, surge) == [1] * 2     # five times the capacity: the third tick
    clock.now += 1
    decision = scaler.decide(surge)["vision"]
    assert decision.desired == 6 and "need 5.02" in decision.reason
    for bound, desired in [({"max_step": 2}, 3), ({"max": 4}, 4)]:
        bounded = Scaler(config(vision={**wide, **bound}), clock)
        assert run(bounded, clock, 11, surge)[-1] == desired
    capped = Scaler(config(vision={**wide, "max": 4}), clock)
    run(capped, clock, 2, surge)
    clock.now += 1
    assert "; 6 wanted, capped at 4 (max)" in capped.decide(surge)["vision"].reason
    assert Scaler(config(), clock).decide(surge)["vision"].desired == 1            # the spell's first tick
    inventory = Scaler(config(vision=wide), clock)
    assert run(inventory, clock, 11, burst(1, 1, 5 * 4096 + 100, addable=2, removable=0))[-1] == 3


def test_a_step_is_sized_for_the_need_lookahead_s_on_at_its_growth_over_the_up_delay() -> None:
    clock = FakeClock()
    wide = config(vision={"min": 1, "max": 10, "max_step": 8})
    # 0.1 engine more a second: pressure-seconds 1.1 + 1.2 + ... reach 10 at the ninth tick, need 1.8
    rising = [burst(1, 1, 4096 + 410 * k) for k in range(9)]
    scaler, measured = Scaler(wide, clock), Scaler(wide.model_copy(update={"lookahead_s": 0.0}), clock)
    for demand in rising:
        clock.now += 1
        ahead, now = scaler.decide(demand)["vision"], measured.decide(demand)["vision"]
    assert now.desired == 2                  # what 1.8 engines' worth needs
    assert ahead.desired == 5 and "4.80 in 30s" in ahead.reason   # 1.8 + 0.1/s x 30 s


def test_engines_starting_count_as_capacity_no_second_step_unless_demand_outgrows_them() -> None:
    clock = FakeClock()
    scaler = Scaler(config(vision={"min": 1, "max": 10, "max_step": 8}), clock)
    assert run(scaler, clock, 11, burst(1, 1, 5 * 4096 + 100))[-1] == 6
    # five engines starting, one serving: the same demand, and more of it below six, adds nothing
    assert run(scaler, clock, 60, burst(6, 1, 5 * 4096 + 100, arriving=5)) == [6] * 60
    assert run(scaler, clock, 30, burst(6, 1, 5 * 4096 + 3000, arriving=5)) == [6] * 30
    # the burst grows beyond them: after the up delay (shortened by its pressure, 7.1 on 6), the difference
    growing = run(scaler, clock, 11, burst(6, 1, 7 * 4096 + 500, arriving=5))
    assert growing[:9] == [6] * 9 and growing[9] == 8
    # a removal draining does not hold a step up back either
    other = Scaler(config(), clock)
    assert run(other, clock, 11, burst(1, 1, 8000, leaving=1))[-1] == 2


def test_a_step_nothing_applies_is_asked_for_once() -> None:
    """Export mode: the engines do not follow the desired count; the scaler keeps asking for the same
    step without deciding it again."""
    clock = FakeClock()
    scaler = Scaler(config(), clock)
    decisions = [scaler.decide(vision(1, 8000))["vision"] for clock.now in range(1, 40)]
    assert [d.desired for d in decisions][-1] == 2 and sum(bool(d.reason) for d in decisions) == 1


def test_never_above_max_or_the_inventory() -> None:
    clock = FakeClock()
    scaler = Scaler(config(), clock)
    assert follow(scaler, clock, 200, 8000) == 4   # max
    inventory = Scaler(config(), clock)
    assert max(run(inventory, clock, 100, vision(2, 8000, addable=1, removable=1))) == 3


def test_shrinks_after_the_down_delay_to_min_and_only_what_it_may_remove() -> None:
    clock = FakeClock()
    scaler = Scaler(config(), clock)
    scaler.decide(vision(3, 0))
    desired = run(scaler, clock, 130, vision(3, 0))
    assert desired[58] == 3 and desired[59] == 1 == desired[-1]   # no demand: to min in one step
    # as many engines as the load fits without, within max_step: 0.6 engines' worth on 2 left is 0.3
    for max_step, left in [(4, 2), (2, 4)]:
        wide = Scaler(config(vision={"min": 1, "max": 6, "max_step": max_step}), clock)
        wide.decide(vision(6, 410))
        assert run(wide, clock, 60, vision(6, 400))[-1] == left
    # none while a step settles (an added engine starting, a removed one draining)
    for settling in (burst(3, 2, 0, arriving=1), burst(3, 3, 0, leaving=1)):
        assert run(Scaler(config(), clock), clock, 200, settling) == [3] * 200
    # what decides is the load on the engines left: 0.29 on one engine fewer may go, 0.59 stays
    held = Scaler(config(), clock)
    held.decide(vision(2, 600))
    assert run(held, clock, 60, vision(2, 600))[-1] == 1
    kept = Scaler(config(), clock)
    kept.decide(vision(2, 1200))
    assert run(kept, clock, 120, vision(2, 1200))[-1] == 2
    # ... and never more than the high mark now, whatever the low mark
    loose = Scaler(config(vision={"min": 1, "max": 4, "low_mark": 0.9}), clock)
    loose.decide(vision(2, 2400))   # 1.17 engines' worth: does not fit on one
    assert run(loose, clock, 120, vision(2, 2400))[-1] == 2
    # in manage mode only the engines the scaler added may go
    own = Scaler(config(), clock)
    assert run(own, clock, 300, vision(3, 0, removable=1))[-1] == 2


def test_a_big_pool_sheds_an_engine_its_load_fits_without_and_a_spike_counts_for_its_share() -> None:
    clock = FakeClock()
    # the same pressure on every engine (0.25): two engines keep both (0.5 on one), six go to five (0.3 on five)
    for engines, left in [(2, 2), (6, 5)]:
        scaler = Scaler(config(vision={"min": 1, "max": 6}), clock)
        scaler.decide(vision(engines, 1024))
        assert run(scaler, clock, 60, vision(engines, 1024))[-1] == left
    # a calm minute with one tick of backlog (1.5 engines' worth, under the two engines' capacity) still
    # averages low: the engine goes at the end of the window, unless the need at that instant does not fit
    def calm(spike_at: int) -> int:
        scaler = Scaler(config(), clock)
        scaler.decide(vision(2, 100))
        ticks = iter([burst(2, 2, 6000 if k == spike_at else 200) for k in range(60)])
        return run(scaler, clock, 60, lambda: next(ticks))[-1]
    assert calm(30) == 1
    assert calm(59) == 2


def test_below_min_goes_to_min_at_once_and_a_refused_step_settles() -> None:
    clock = FakeClock()
    scaler = Scaler(config(**{"vision": {"min": 2, "max": 4}}), clock)
    assert scaler.decide(vision(1, 0))["vision"].desired == 2
    scaler.settle("vision", 1)
    assert scaler.decide(vision(1, 0, addable=0))["vision"].desired == 1   # no GPU left: what it has


def test_language_pressure_is_its_largest_signal() -> None:
    cfg = config(language={"min": 1, "max": 3, "prefill_tokens_per_engine": 1000, "queue_per_engine": 4,
                           "ttft_slo_s": 2.0})
    scaling = cfg.scaled()["language"]
    assert pressure(scaling, PoolDemand(2, 2, backlog_tokens=1000, queued=2)) == pytest.approx(0.5)
    assert pressure(scaling, PoolDemand(2, 2, backlog_tokens=1000, queued=16)) == pytest.approx(2.0)
    assert pressure(scaling, PoolDemand(2, 2, predicted_ttft_s=3.0)) == pytest.approx(1.5)
    assert pressure(scaling, PoolDemand(0, 0, queued=1)) == float("inf")
    assert pressure(scaling, PoolDemand(0, 0)) == 0.0
    clock = FakeClock()
    scaler = Scaler(cfg, clock)
    slow: dict[Pool, PoolDemand] = {"language": PoolDemand(1, 1, predicted_ttft_s=2.5)}
    assert [scaler.decide(slow)["language"].desired for clock.now in range(12)][-1] == 2


def test_pool_demand_reads_the_table_as_the_live_loop_and_the_simulator_do() -> None:
    """Members not draining (starting ones included), healthy ones among them, the pool's backlogs; the
    language pool's requests held plus those waiting at admission, and the best healthy engine's predicted
    first token; what only the caller knows passes through."""
    cfg = config(language={"min": 1, "max": 4, "ttft_prompt_tokens": 100}, vision={"min": 1, "max": 3})
    pools = cfg.scaled()
    table = StateTable(catalog().model("llava-1.5-7b"), 1.0, 3, clock=lambda: 10.0)
    for backend_id, role, gpu in [("v0", "vision", "L4"), ("v1", "vision", "L4"), ("l0", "language", "H100"),
                                  ("l1", "both", "A100-80GB"), ("l2", "language", "H100"),
                                  ("l3", "language", "H100")]:
        table.register(backend_id, role, catalog().gpu(gpu), address=None, managed=True)
    for seq, (backend_id, waiting, running, backlog) in enumerate(
            [("v0", 0, 0, 3000), ("v1", 0, 0, 500), ("l0", 2, 5, 0), ("l1", 1, 1, 0), ("l2", 9, 9, 0)], 1):
        table.apply_heartbeat(backend_id, seq, "", Reported(seq=seq, waiting=waiting, running=running,
                                                          vision_backlog=backlog))
    table.set_lifecycle("l3", "starting")    # launched, not ready: a member, not serving
    table.drain("l2")                        # draining: not a member any more
    table.acquire("l0", 400, 100)            # a prompt sent, first token not seen: prefill backlog
    vision = pool_demand(table, "vision", pools["vision"], arriving=1, leaving=2, addable=2, removable=1)
    assert vision == PoolDemand(2, 2, arriving=1, leaving=2, backlog_tokens=3500, addable=2, removable=1)
    language = pool_demand(table, "language", pools["language"], waiting=4)
    # the prompt on l0, and the image tokens waiting at the encoders: prefill on its way to this pool
    assert (language.engines, language.serving, language.backlog_tokens, language.queued) == \
        (3, 2, 400 + 3500, 7 + 2 + 4)
    l0, l1 = (table.snapshot(table.get(i)) for i in ("l0", "l1"))  # type: ignore[arg-type]
    ttfts = [predicted_ttft_s(b, 100, 100 + 128) for b in (l0, l1)]   # ttft_max_tokens 128 by default
    assert language.predicted_ttft_s == pytest.approx(min(ttfts))
    assert language.addable is None and language.removable is None
    table.drain("v1")    # no longer in the vision pool, but what it still encodes comes to the language pool
    assert pool_demand(table, "vision", pools["vision"]).backlog_tokens == 3000
    assert pool_demand(table, "language", pools["language"]).backlog_tokens == 400 + 3500


def test_an_image_burst_at_the_encoders_grows_the_language_pool_before_its_prompts_arrive() -> None:
    """E+PD: a burst of images queued at the vision engines is prefill the language pool will have to do
    once they are encoded; its engines take a start-up to come, so the pool steps while the burst is
    still at the encoders, not when the embeddings reach it."""
    cfg = config(language={"min": 1, "max": 8, "prefill_tokens_per_engine": 16384}, vision={"min": 1, "max": 8})
    table = StateTable(catalog().model("llava-1.5-7b"), 1.0, 3, clock=lambda: 10.0)
    table.register("v0", "vision", catalog().gpu("L4"), address=None, managed=True)
    table.register("l0", "language", catalog().gpu("A100-80GB"), address=None, managed=True)
    table.apply_heartbeat("v0", 1, "", Reported(seq=1, vision_backlog=4 * 16384))
    table.apply_heartbeat("l0", 1, "", Reported(seq=1))
    clock = FakeClock()
    scaler = Scaler(cfg, clock)
    pools = cfg.scaled()
    for clock.now in range(1, 12):
        decisions = scaler.decide({pool: pool_demand(table, pool, scaling) for pool, scaling in pools.items()})
    assert decisions["language"].desired >= 4


def test_config_is_checked() -> None:
    with pytest.raises(ValidationError, match="min"):
        config(vision={"min": 3, "max": 2})
    with pytest.raises(ValidationError, match="at least one pool"):
        AutoscalingConfig.model_validate({"mode": "manage"})
    with pytest.raises(ValidationError, match="extra"):
        config(vision={"max": 2, "mark": 1})
    assert AutoscalingConfig().mode == "off"


def test_manage_mode_is_checked_against_the_backends_file(tmp_path: Path) -> None:
    def load(vision: dict[str, Any], backends: list[dict[str, Any]]) -> None:
        load_cluster(write_config(tmp_path, {
            "model": "llava-1.5-7b", "backends": backends,
            "gateway": {"autoscaling": {"mode": "manage", "pools": {"vision": vision}}}}))

    language = {"id": "h100-0", "gpu": "H100", "launch": {}}
    encoder = {"id": "l4-0", "role": "vision", "gpu": "L4", "launch": {}}
    load({"max": 2, "gpus": ["L4"]}, [language, encoder])
    with pytest.raises(ConfigError, match=r"gateway.autoscaling.pools.vision.gpus.*NO-SUCH-GPU"):
        load({"max": 2, "gpus": ["NO-SUCH-GPU"]}, [language, encoder])
    with pytest.raises(ConfigError, match=r"pools.vision.template.*role vision"):
        load({"max": 2}, [language, {**encoder, "launch": None, "address": "127.0.0.1:9"}])
    with pytest.raises(ConfigError, match=r"template 'h100-0'"):
        load({"max": 2, "template": "h100-0"}, [language, encoder])


def test_pools_a_scaler_cannot_bring_to_max_are_warned_about(tmp_path: Path) -> None:
    """Valid, but likely a slip: start-up and check-config say so (gateway/daemon.py)."""
    def warnings(vision: dict[str, Any], encoders: int) -> list[str]:
        backends = [{"id": "h100-0", "gpu": "H100", "launch": {}},
                    *({"id": f"l4-{k}", "role": "vision", "gpu": "L4", "launch": {}} for k in range(encoders))]
        return autoscaling_warnings(load_cluster(write_config(tmp_path, {
            "model": "llava-1.5-7b", "backends": backends,
            "gateway": {"autoscaling": {"mode": "manage", "pools": {"vision": vision}}}})))

    assert warnings({"max": 3, "gpus": ["L4", "L4"]}, 1) == []
    assert warnings({"max": 3, "gpus": []}, 1) == [
        "gateway.autoscaling.pools.vision: max is 3, but 1 engine(s) now and 0 GPU(s) in its `gpus:` inventory "
        "make at most 1"]
    assert "above max 1" in warnings({"max": 1, "gpus": ["L4"]}, 2)[0]
