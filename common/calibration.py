"""Per-backend calibration of the routing model's time to first token and decode time, online.

The routing costs (`gateway.routing.policies.marginal_delay`) model one engine: FIFO chunked prefill,
where a request's first token waits for the prompt tokens ahead of it, and a prefill stalls the
requests decoding beside it by its own prefill time. Engines differ (prefill-first scheduling stalls
every decode for whole prompts plus a step, a batch cap or a full cache makes new requests wait for
running ones), so each backend's terms are fitted to what its requests show, from figures the gateway
already has. Two linear models per backend, both `RidgeFit`s:

    time to first token   TTFT ≈ a1·(B + L)·p̂ + a2·ŝ + a3·n·ŝ + a4·W_kv
        B: prompt tokens ahead of it there, L: its own, p̂ / ŝ: learned prefill rate and decode step,
        n: requests in flight there, W_kv: the KV wait term (max(0, U + R − K) / K · T̄_service)
        prior a = (1, 1, 0, 1): the uncalibrated model; bounds a1 ∈ [0.25, 4], a2..a4 ∈ [0, 4]
    decode time           t_last − t_first ≈ s0·(M − 1) + κ·ΔC + c·ΔN
        M: tokens it generated, ΔC: the stall clock's advance during its decode (Σ L_k·p̂ over the
        prompts dispatched there meanwhile, `common.itl_slack`), ΔN: how many they were
        prior (ŝ prior, 1, 0); bounds s0 ∈ [0, 1 s], κ ∈ [0.5, 2.5], c ∈ [0, 0.1 s]

s0 is the decode step without stalls (ŝ, the mean inter-token time delivered, includes them), κ
scales a prompt's predicted stall and c is a fixed stall per prompt (a prefill-first engine's extra
step). A `RidgeFit` is exponentially weighted least squares (forgetting λ = 0.99 a sample: about the
last 100 count) pulled towards its prior as if by `prior_weight` (2) samples along each feature's
typical size, so a feature that has not varied keeps its prior coefficient (the pull is stronger
where features are correlated: a few percent of bias towards the prior on a noise-free engine); each
observation is clipped to [prediction / C, prediction · C] (C = 4) before it counts, so a stall does
not throw the fit; coefficients are clipped to their bounds; refitted (a Cholesky solve of 3 or 4
unknowns) at each of the first `refit_every` samples and then every `refit_every`-th (8 for the
decode model, 64 for the first-token model, which is shown and not routed on). The sums take an
observation at the next refit (`_fold`), not as it comes: per sum the same steps in the same order as
when each was taken at once, so the same figures to the last digit, at half the CPU (the three sums
rebuilt as lists for each first-token sample, one a request, cost the request path ~6 µs in
benchmarks/gateway_micro.py). Each fit also keeps EWMAs of what it observed, what it had predicted
for those observations and what the uncalibrated model (its prior) would have: how far the model is
off for that backend, and how much calibration closes.

What routes on them (`marginal_delay`): the decode model's κ and c price a prompt's stall on the
requests decoding there, and s0 sets their inter-token budgets (`common.itl_slack`). The first-token
model is fitted and shown (/admin/backends, `learned_speed`) but does not route: on the engine family
of benchmarks/routing_family.py, routing on it instead of the uncalibrated first-token time cost
about a point of goodput per member at 0.9x, and as a penalty for a predicted first token past 2 s
it cost 1-3 points at 1.2x (docs/ROUTING.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import mul

TTFT_PRIOR = (1.0, 1.0, 0.0, 1.0)
TTFT_KV_WAIT = 3   # the index of W_kv among the first-token features
TTFT_BOUNDS = ((0.25, 4.0), (0.0, 4.0), (0.0, 4.0), (0.0, 4.0))
STALL_FACTOR_BOUNDS = (0.5, 2.5)
STALL_PER_PROMPT_BOUNDS = (0.0, 0.1)
DECODE_FLOOR_BOUNDS = (0.0, 1.0)


@dataclass(frozen=True, slots=True)
class FitParams:
    memory: float = 0.99             # λ: each sample's weight decays by this at every later sample
    prior_weight: float = 2.0        # the prior counts as this many typical samples
    clip: float = 4.0                # C
    refit_every: int = 8


class RidgeFit:
    """y ≈ θ·x, exponentially weighted ridge least squares towards a prior (see the module docstring)."""

    __slots__ = ("_a", "_b", "_n", "_p", "_pairs", "_pending", "_s", "bounds", "coefficients", "observed_mean",
                 "predicted_mean", "prior", "prior_mean", "samples")

    def __init__(self, prior: Sequence[float], bounds: Sequence[tuple[float, float]],
                 params: FitParams | None = None) -> None:
        k = len(prior)
        self.prior = tuple(prior)
        self.bounds = tuple(bounds)
        self.coefficients = self.prior
        self.samples = 0
        # what it shows: the recent observations, the calibrated predictions made for them (before each
        # was learned from) and the uncalibrated model's (the prior's), as EWMAs of weight 1 − λ
        self.observed_mean = self.predicted_mean = self.prior_mean = 0.0
        self._p = params or FitParams()
        self._pairs = [(i, j) for i in range(k) for j in range(i, k)]
        self._a = [0.0] * len(self._pairs)        # Σ λ^age x xᵀ, its upper triangle row by row
        self._b = [0.0] * k                       # Σ λ^age x y
        self._s = [0.0] * k                       # Σ λ^age x_j²: each feature's typical size
        self._n = 0.0                             # Σ λ^age
        self._pending: list[tuple[Sequence[float], float]] = []   # (x, clipped y) not yet in the sums

    def predict(self, x: Sequence[float]) -> float:
        return float(sum(map(mul, self.coefficients, x)))

    def add(self, x: Sequence[float], y: float) -> None:
        """One observation `y` of features `x`."""
        p = self._p
        predicted = self.predict(x)
        w = max(1.0 - p.memory, 1.0 / (self.samples + 1))   # the first samples count whole, then 1 − λ
        self.observed_mean += w * (y - self.observed_mean)
        self.predicted_mean += w * (predicted - self.predicted_mean)
        self.prior_mean += w * (float(sum(map(mul, self.prior, x))) - self.prior_mean)
        if predicted > 0.0:
            y = min(predicted * p.clip, max(predicted / p.clip, y))
        self._pending.append((x, y))   # x is kept until the next refit: a tuple, never changed
        self.samples += 1
        if self.samples <= p.refit_every or self.samples % p.refit_every == 0:
            self._refit()

    def _fold(self) -> None:
        """The pending observations into the sums, oldest first: each sum decays by λ and takes its term,
        observation by observation, as when each was taken at once (in loops over a few numbers, not a
        new list per sum and observation)."""
        pending, lam = self._pending, self._p.memory
        a, b, s = self._a, self._b, self._s
        for e, (i, j) in enumerate(self._pairs):
            v = a[e]
            for x, _ in pending:
                v = lam * v + x[i] * x[j]
            a[e] = v
        for i in range(len(b)):
            vb, vs = b[i], s[i]
            for x, y in pending:
                xi = x[i]
                vb = lam * vb + xi * y
                vs = lam * vs + xi * xi
            b[i], s[i] = vb, vs
        n = self._n
        for _ in pending:
            n = lam * n + 1.0
        self._n = n
        pending.clear()

    def _refit(self) -> None:
        self._fold()
        k, a, prior, scale = len(self.prior), self._a, self.prior, self._p.prior_weight / self._n
        ridge = [scale * v + 1e-12 for v in self._s]
        upper = [[0.0] * k for _ in range(k)]
        for v, (i, j) in zip(a, self._pairs, strict=True):
            upper[i][j] = v
        theta = _solve_spd(upper, ridge, [self._b[i] + ridge[i] * prior[i] for i in range(k)])
        self.coefficients = tuple([min(hi, max(lo, t)) for t, (lo, hi) in zip(theta, self.bounds, strict=True)])


def _solve_spd(upper: list[list[float]], ridge: list[float], v: list[float]) -> list[float]:
    """(A + diag(ridge)) · x = v, A symmetric given by its upper triangle, A + diag(ridge) positive
    definite: Cholesky (= L·Lᵀ) and two substitutions, in plain loops (3-4 unknowns)."""
    k = len(v)
    low = [[0.0] * k for _ in range(k)]
    for i in range(k):
        li = low[i]
        for j in range(i + 1):
            lj = low[j]
            acc = upper[j][i] + (ridge[i] if i == j else 0.0)
            for t in range(j):
                acc -= li[t] * lj[t]
            li[j] = acc ** 0.5 if i == j else acc / lj[j]
    y = [0.0] * k
    for i in range(k):
        acc = v[i]
        for t in range(i):
            acc -= low[i][t] * y[t]
        y[i] = acc / low[i][i]
    x = [0.0] * k
    for i in range(k - 1, -1, -1):
        acc = y[i]
        for t in range(i + 1, k):
            acc -= low[t][i] * x[t]
        x[i] = acc / low[i][i]
    return x


def ttft_fit(params: FitParams | None = None) -> RidgeFit:
    """The first-token model: shown, not routed on, so refitted every 64 samples (after the first 64)."""
    return RidgeFit(TTFT_PRIOR, TTFT_BOUNDS, params or FitParams(refit_every=64))


def decode_fit(decode_step_s: float, params: FitParams | None = None) -> RidgeFit:
    """The decode-time model, its prior the unstalled step `decode_step_s`, κ = 1 and no fixed stall."""
    return RidgeFit((decode_step_s, 1.0, 0.0), (DECODE_FLOOR_BOUNDS, STALL_FACTOR_BOUNDS, STALL_PER_PROMPT_BOUNDS),
                    params)
