"""Inter-token slack: how much more prefill stall the requests in flight on one backend can take
before their mean inter-token time passes a target.

Chunked prefill runs a prompt's chunks inside the steps that decode everyone else, so a prompt of L
tokens on a backend that prefills at p̂ s/token lengthens the decode of every request there by about
L · p̂ seconds in all. A request j that generates M_j tokens meets an inter-token target T while the
stall it takes stays within (M_j − 1) · (T − s0), s0 the backend's decode step without stalls. Per backend:

    stall clock   C    = Σ (κ · L_k · p̂ + c) over the prompts dispatched there (as at each dispatch)
    deadline      D_j  = C just after j's own prompt + (M_j − 1) · (T − s0)     fixed at j's dispatch
    slack         D_j − C: the stall j can still take; below 0 its target is already lost

s0, κ and c are the backend's calibrated decode model (`common.calibration`: the step without
stalls, and what a prompt's prefill really stalls the others, fitted on completed requests); before
any fit s0 = ŝ, κ = 1, c = 0. The clock's uncalibrated twin (Σ L_k · p̂) and the dispatch count are
what that fit reads over each request's decode (`mark`, `stalls_since`).

Every prompt dispatched after j is prefilled after j's own (FIFO chunked prefill), so it stalls j
while j decodes, and j's slack shrinks by what the clock advances. `slacks()` gives the smallest
slacks of at least 0 (the requests closest to missing that can still make it), smallest first: a
prompt of L tokens would break those below its stall κ · L · p̂ + c. The deadlines are kept sorted: a look-up is a
bisection, an insert or a removal a bisection and a short memmove. Pure: numbers in, numbers out.
Limits: M_j is the request's max_tokens (a request that stops earlier has less slack than counted);
only this router's requests are seen; the whole stall is counted even where a victim finishes
during it.
"""

from __future__ import annotations

import bisect

EXPOSED = 3              # slacks a snapshot carries: enough to count up to three victims of one prompt
DEFAULT_TARGET_S = 0.1   # `routing.itl_target_ms`' default


class InterTokenSlack:
    __slots__ = ("_deadlines", "clock_s", "dispatches", "predicted_s", "target_s")

    def __init__(self, target_s: float) -> None:
        self.target_s = target_s
        self.clock_s = 0.0
        self.predicted_s = 0.0   # Σ L·p̂ over every prompt dispatched here, never restarted (`stalls_since`)
        self.dispatches = 0
        self._deadlines: list[float] = []

    def add(self, prompt_tokens: int, max_tokens: int, prefill_s_per_token: float, decode_step_s: float,
            stall_factor: float = 1.0, stall_per_prompt_s: float = 0.0) -> float | None:
        """A request dispatched here: its prompt advances the clock by its stall, κ · L · p̂ + c
        (`common.calibration`; 1 and 0 uncalibrated); returns its deadline (None: it has no
        inter-token time, a single token). `decode_step_s`: the step without stalls."""
        predicted = prompt_tokens * prefill_s_per_token
        self.predicted_s += predicted
        self.dispatches += 1
        self.clock_s += stall_factor * predicted + stall_per_prompt_s
        if max_tokens < 2:
            return None
        deadline = self.clock_s + (max_tokens - 1) * (self.target_s - decode_step_s)
        bisect.insort(self._deadlines, deadline)
        return deadline

    def remove(self, deadline: float | None) -> None:
        """A request left (its deadline as `add` returned it)."""
        if deadline is None:
            return
        d = self._deadlines
        k = bisect.bisect_left(d, deadline)
        if k < len(d) and d[k] == deadline:
            del d[k]
        if not d:
            self.clock_s = 0.0   # nobody left to stall: restart the clock, keeping its values small

    def mark(self) -> tuple[float, int]:
        """The uncalibrated stall clock and the dispatch count now, for `stalls_since`."""
        return self.predicted_s, self.dispatches

    def stalls_since(self, mark: tuple[float, int]) -> tuple[float, int]:
        """(ΔC, ΔN) since `mark`: the predicted stall (Σ L·p̂) and the number of prompts dispatched here
        since then, what the decode-time model is fitted on."""
        return self.predicted_s - mark[0], self.dispatches - mark[1]

    def slacks(self, k: int = EXPOSED) -> tuple[float, ...]:
        """The k smallest slacks of at least 0, smallest first."""
        d, now = self._deadlines, self.clock_s
        if not d:
            return ()
        i = bisect.bisect_left(d, now)
        return tuple([x - now for x in d[i:i + k]])   # a list first: a generator costs more for a few items

    def __len__(self) -> int:
        return len(self._deadlines)
