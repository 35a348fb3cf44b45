"""The rules of one GPU's loop (backends/scheduling.py), which the engine and the simulator share."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest

from backends import scheduling
from backends.scheduling import next_activity, ready_in, stealing_limits, take_batch
from loadtest.sim import vlm


@dataclass
class Job:
    images: int
    queued_s: float


def test_a_batch_is_ready_when_full_or_when_its_oldest_image_waited_out() -> None:
    assert ready_in([], 5.0, 32, 0.05) == float("inf")
    assert ready_in([Job(1, 1.0)], 1.02, 32, 0.05) == pytest.approx(0.03)
    assert ready_in([Job(1, 1.0)], 1.2, 32, 0.05) == 0.0
    assert ready_in([Job(20, 1.0), Job(12, 1.01)], 1.01, 32, 0.05) == 0.0


def test_a_batch_takes_whole_requests_up_to_the_image_cap_and_always_one() -> None:
    queue = deque([Job(20, 0.0), Job(12, 0.0), Job(1, 0.0)])
    assert [j.images for j in take_batch(queue, 32)] == [20, 12]
    assert [j.images for j in queue] == [1]
    big = deque([Job(40, 0.0), Job(1, 0.0)])
    assert [j.images for j in take_batch(big, 32)] == [40]   # a request larger than the cap runs alone
    assert take_batch(deque(), 32) == []


def test_vision_first_then_language_then_sleep() -> None:
    assert next_activity(0.0, True) == "encode"
    assert next_activity(0.01, True) == "language"
    assert next_activity(0.01, False) == "sleep"
    assert next_activity(float("inf"), False) == "sleep"


def test_a_stealing_gpu_halves_its_batch_and_bounds_its_prefill_per_step() -> None:
    assert stealing_limits(256, 0.1, 0.0001) == (128, 1000)
    assert stealing_limits(1, 0.1, 0.0001)[0] == 1


def test_the_simulator_runs_the_same_rules() -> None:
    assert vlm.ready_in is scheduling.ready_in
    assert vlm.take_batch is scheduling.take_batch
    assert vlm.next_activity is scheduling.next_activity
