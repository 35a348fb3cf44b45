"""`oracle`: the clairvoyant baseline of the capability-weighted paper's Table 2, simulator-only.

The paper's Oracle has "perfect knowledge of future arrivals and output lengths, routing to minimize
mean per-request latency". Minimising the mean over a whole trace is an offline scheduling problem
(unrelated machines with release dates, NP-hard); what is run in practice, and here, is its greedy
per-arrival form: each arrival goes to the GPU on which *its own* completion time is earliest.

What "clairvoyant" means here, exactly:
- it knows every request's true output length (the live gateway only sees max_tokens) and each
  GPU's exact pending work: the engine's queue, its running batch, its KV reservations and the end
  of the step in flight. It reads the engines themselves, which is why it cannot be a gateway policy;
- it does not look at future arrivals, and it does not weigh the delay it causes to requests already
  on a GPU (under continuous batching a newcomer lengthens every later decode step) or to later ones.

Serial engines (FIFO, one request at a time): completion = max(now, backlog end) + 2·P·L/F + n_out ·
2·P/B. A later arrival never delays an earlier one, so this prediction is exact and the choice truly
minimises the request's latency given the earlier decisions.

Continuous batching: the GPU's `ContinuousBatcher` is replayed forward from its present state, with
the newcomer at the tail of the FIFO queue and no further arrivals: admission steps one by one
(prefill of the admitted prompts + one decode step of the old batch), decode-only stretches between
completions summed in closed form. Without further arrivals the replay equals what the batcher
would do; with them it is a lower bound, since later requests join the batch and lengthen its steps
(they cannot overtake the newcomer in the FIFO queue).

Cost: serial is O(1) per GPU. Continuous is O(running + waiting) per GPU replayed; GPUs are replayed
in order of a cheap lower bound and skipped once that bound exceeds the best completion found.
Limits: engines with a per-step prefill bound (the modality simulator's stealers) are not replayed.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common import perf_model
from common.catalog import GpuProfile, ModelProfile
from gateway.routing.policies.contracts import BackendSnapshot, CostTerms, Decision, RequestProfile
from loadtest.sim.engines import BatchEngine, Engine, SerialEngine

NAME = "oracle"
_INF = float("inf")


@dataclass(frozen=True, slots=True)
class Roofline:
    """One GPU's decode-step terms from `common.perf_model`, read once (the catalog computes them)."""

    weights_s: float          # weight bytes / B: the floor of every decode step
    kv_s_per_token: float     # KV bytes per token / B
    compute_s_per_seq: float  # 2·P / F
    kv_bytes_per_token: int

    @classmethod
    def of(cls, model: ModelProfile, gpu: GpuProfile) -> Roofline:
        bandwidth = gpu.bandwidth_bytes_s
        return cls(model.weight_bytes / bandwidth, model.kv_bytes_per_token / bandwidth,
                   perf_model.prefill_seconds_per_token(model, gpu), model.kv_bytes_per_token)

    def floor_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """A request's shortest possible stay: its prefill, then one weights pass per further token."""
        return prompt_tokens * self.compute_s_per_seq + (output_tokens - 1) * self.weights_s

    def decode_run_s(self, batch: int, context_tokens: int, steps: int) -> float:
        """Σ_{j<steps} perf_model.decode_step_seconds(batch, context_tokens + j·batch), in closed form."""
        return perf_model.roofline_run_seconds(self.weights_s, self.kv_s_per_token, self.compute_s_per_seq,
                                               batch, context_tokens, steps)


def batch_start_s(engine: BatchEngine, now: float) -> float:
    """The next step boundary: the batcher already holds the effects of the step in flight."""
    return engine.step_end_s if engine.stepping else now


def serial_finish_s(engine: SerialEngine, i: int, now: float) -> float:
    """Exact completion time of request i if appended to this serial GPU's FIFO queue now."""
    return engine.finish_s(max(engine.backlog_end_s, now), i)


def batch_finish_s(engine: BatchEngine, roof: Roofline, i: int, now: float, cutoff: float = _INF) -> float:
    """Completion time of request i if submitted to this continuous-batching GPU now, replaying its
    `ContinuousBatcher` (FIFO admission under the batch cap and whole KV reservations) with true
    output lengths and no further arrivals; inf if its reservation exceeds the whole cache.

    The replay stops as soon as a lower bound on the answer (time so far + i's prefill if still to
    come + one weights pass per token i has left) exceeds `cutoff`, and returns that bound instead:
    a GPU that cannot beat the best found so far is not replayed to the end.
    """
    batcher, lengths, kv = engine.batcher, engine.rec.lengths, roof.kv_bytes_per_token
    prompt, target = int(lengths.input_tokens[i]), int(lengths.output_tokens[i])
    mine = (prompt, kv * (prompt + int(lengths.max_output_tokens[i])), target, True)
    if mine[1] > batcher.kv_capacity_bytes:
        return _INF
    t, rest = batch_start_s(engine, now), roof.floor_s(prompt, target)
    if t + rest > cutoff:
        return t + rest
    # running: (last step index, context when done, KV reserved, is request i); steps count from 0
    running = [(s.target_tokens - s.generated - 1, s.prompt_tokens + s.target_tokens, s.kv_reserved, False)
               for s in batcher.running]
    heapq.heapify(running)
    waiting = [(s.prompt_tokens, kv * (s.prompt_tokens + s.max_tokens), s.target_tokens, False)
               for s in batcher.waiting]
    waiting.append(mine)
    batch, context = len(running), sum(s.prompt_tokens + s.generated for s in batcher.running)
    free, head, step, last_mine = batcher.kv_free_bytes, 0, 0, -1
    while True:
        admitted = []
        while head < len(waiting) and batch + len(admitted) < batcher.max_batch and waiting[head][1] <= free:
            admitted.append(waiting[head])
            free -= waiting[head][1]
            head += 1
        if admitted:      # one step: prefill of the newcomers + a decode step of the old batch
            prefill = sum(a[0] for a in admitted) * roof.compute_s_per_seq
            t += prefill + (roof.decode_run_s(batch, context, 1) if batch else 0.0)
            context += batch + sum(a[0] + 1 for a in admitted)
            batch += len(admitted)
            for p, need, out, flag in admitted:
                heapq.heappush(running, (step + out - 1, p + out, need, flag))
            if head == len(waiting) and last_mine < 0:      # request i was admitted in this step
                last_mine = step + target - 1
            step += 1
        else:             # decode only until the next completion (admission waits for freed KV)
            last = running[0][0]
            t += roof.decode_run_s(batch, context, last - step + 1)
            context += (last - step + 1) * batch
            step = last + 1
        while running and running[0][0] < step:
            _, done_context, need, flag = heapq.heappop(running)
            if flag:
                return t
            batch, context, free = batch - 1, context - done_context, free + need
        rest = (last_mine - step + 1) * roof.weights_s if last_mine >= 0 else rest
        if t + rest > cutoff:
            return t + rest


class Oracle:
    """Routes each arrival to the GPU where its own completion time is earliest (ties: first candidate).

    Decision costs carry the predicted latency (completion − now) per candidate; a continuous-batching
    candidate whose replay was cut short carries a lower bound above the chosen one's latency instead.
    """

    name = NAME

    def __init__(self, engines: Sequence[Engine]) -> None:
        if not engines:
            raise ValueError("the oracle reads the simulated engines: pass them")
        if not all(isinstance(e, SerialEngine | BatchEngine) for e in engines):
            raise TypeError("the oracle predicts serial and continuous-batching engines only")
        if any(isinstance(e, BatchEngine) and e.batcher.max_prefill_tokens is not None for e in engines):
            raise ValueError("the oracle replays batchers without a per-step prefill bound only")
        self.engines = {e.id: e for e in engines}
        self.lengths = engines[0].rec.lengths          # the run's one Recorder: true lengths of every request
        self.roofline = {e.id: Roofline.of(e.model, e.gpu) for e in engines}
        self.predicted: dict[int, float] = {}      # request index → predicted completion time

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        i = int(request.request_id)
        prompt, target = int(self.lengths.input_tokens[i]), int(self.lengths.output_tokens[i])
        engines = [self.engines[b.id] for b in candidates]
        # serial: the exact answer (O(1)); continuous: the floor that orders and prunes the replays
        finish = [serial_finish_s(e, i, now) if isinstance(e, SerialEngine)
                  else batch_start_s(e, now) + self.roofline[e.id].floor_s(prompt, target) for e in engines]
        best, best_k = _INF, 0
        for k in sorted(range(len(engines)), key=finish.__getitem__):
            engine = engines[k]
            if finish[k] > best:
                break
            if isinstance(engine, BatchEngine):
                finish[k] = batch_finish_s(engine, self.roofline[engine.id], i, now, cutoff=best)
            if finish[k] < best or (finish[k] == best and k < best_k):
                best, best_k = finish[k], k
        self.predicted[i] = best
        costs = tuple(CostTerms(b.id, 0.0, 0.0, float(f == _INF), f - now)
                      for b, f in zip(candidates, finish, strict=True))
        return Decision(candidates[best_k], self.name, costs)

    def realized_over_predicted(self, arrival_s: np.ndarray, finish_s: np.ndarray) -> float:
        """Mean realized latency / predicted latency over the routed requests: 1 where the prediction is
        exact (serial), above 1 by what later arrivals added (continuous batching)."""
        index = np.fromiter(self.predicted, dtype=np.int64, count=len(self.predicted))
        predicted = np.fromiter(self.predicted.values(), dtype=float, count=len(index))
        return float(np.mean((finish_s[index] - arrival_s[index]) / (predicted - arrival_s[index])))
