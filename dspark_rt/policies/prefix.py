"""Hardware-aware prefix schedulers (DESIGN §4): how many drafts each request verifies.

Both maximise expected emitted tokens per second, Theta = tau * SPS(B), where B = R + sum l_r
is the verify forward's size and tau = R + sum of the admitted survivals a_{r,j} (each request
emits its target token plus, in expectation, its surviving drafts).

Losslessness. Survival a_{r,j+1} depends on the sampled draft x_{r,j}. A rule that looks at
a_{r,j+1} to decide whether x_{r,j} is verified makes the verify decision depend on the token
being verified and biases the output (paper Appendix A). The synchronous scheduler avoids this by
stopping at the first candidate that does not pay (candidate (r, j) is admitted using only
candidates ranked above it, none of which is (r, j+1)); the asynchronous one fixes the budget K
from rounds that are already verified and then admits the top-K, where (r, j) is admitted or not
using only candidates ranked above it.

Candidates: (r, j) for j <= min(gamma, cap_r), ranked by a_{r,j} descending, ties to the lower j,
then to the lower r. Survivals are cumulative products, so they never increase along j; the
schedulers take a running minimum along j (a no-op on such input) and treat NaN as excluded, so
that any admitted set is prefix-closed even on malformed input. Lengths come back as int64 on
cap's device; the work itself is a few numpy calls on the host.
"""
from collections import deque
from pathlib import Path

import numpy as np
import torch

from .. import ops
from .base import BatchView, Decision, VerifyPolicy, int_arg
from .sps import SPSProfile


def _as_profile(sps) -> SPSProfile:
    if isinstance(sps, SPSProfile):
        return sps
    if isinstance(sps, (str, Path)):
        return SPSProfile.load(sps)
    raise TypeError(f"sps must be an SPSProfile or the path of a saved one, got {type(sps)}")


def candidates(survival: torch.Tensor, cap: torch.Tensor, gamma: int) -> np.ndarray:
    """float32 [R, gamma] host array of survivals, -inf for excluded candidates (j > cap_r, NaN or
    -inf input, after an excluded one), made non-increasing along j. Schedulers work in numpy on
    the host: per-round arrays are tiny and numpy's per-call overhead is a fraction of torch's."""
    a = survival[:, :gamma].detach().to("cpu", torch.float32).numpy().copy()
    j = np.arange(1, a.shape[1] + 1)
    cap = cap.detach().to("cpu", torch.int64).numpy()
    excluded = np.isnan(a) | np.isneginf(a) | (j[None, :] > cap[:, None])
    a[~(a > 0)] = 0.0  # survivals are probabilities; also turns -0.0 into +0.0 for ranked()
    a[excluded] = -np.inf
    return np.minimum.accumulate(a, axis=1)


def ranked(a: np.ndarray) -> np.ndarray:
    """Flat j-major indices (j * R + r) of candidates() output a [R, gamma], ordered by
    (a desc, j asc, r asc). The order is one int64 sort of (descending float bits, index): for
    the values a holds (+0.0 .. +inf and -inf) the float32 bit pattern orders like the value,
    and an unstable integer sort is ~5x faster than numpy's stable float argsort."""
    flat = np.ascontiguousarray(a.T).ravel()
    n = flat.size
    shift = max(1, n.bit_length())
    bits = flat.view(np.int32).astype(np.int64)
    bits[bits < 0] = -1  # -inf (the only negative candidates() leaves) ranks last
    key = ((0x7FFFFFFF - bits) << shift) | np.arange(n, dtype=np.int64)
    return np.sort(key) & ((1 << shift) - 1)


class _Scheduler(VerifyPolicy):
    needs_confidence = True
    profiles = ("speculative",)

    def __init__(self, sps, max_tokens: int | None = None):
        self.sps = _as_profile(sps)
        self.max_tokens = self.sps.max_tokens if max_tokens is None else int_arg("max_tokens", max_tokens, 1)
        if not 1 <= self.max_tokens <= self.sps.max_tokens:
            raise ValueError(f"max_tokens must lie in [1, {self.sps.max_tokens}] (the profile's "
                             f"largest B), got {max_tokens}")
        self._sps = self.sps.dense(self.max_tokens)  # float64 [max_tokens + 1]
        self.last_stats: dict = {}

    def _theta(self, R: int, sorted_a: np.ndarray) -> np.ndarray:
        """float64 [n + 1]: Theta after admitting the first n candidates, n = 0..len(sorted_a),
        cut where B = R + n would exceed max_tokens."""
        n = min(len(sorted_a), self.max_tokens - R)
        # tau_n = R + a_1 + ... + a_n, summed left to right in float64 like the paper's loop
        tau = np.cumsum(np.concatenate([[float(R)], sorted_a[:n].astype(np.float64)]))
        return tau * self._sps[R:R + n + 1]

    def _finish(self, a: np.ndarray, lengths: np.ndarray, budget: int, **extra) -> torch.Tensor:
        R = a.shape[0]
        admitted = np.arange(1, a.shape[1] + 1)[None, :] <= lengths[:, None]
        exp_acc = float(a[admitted].sum(dtype=np.float64))
        B = R + int(lengths.sum())
        theta = (R + exp_acc) * float(self._sps[B]) if 1 <= B <= self.max_tokens else 0.0
        out = torch.from_numpy(lengths.astype(np.int64))
        self.last_stats = {"budget": int(budget), "verify_tokens": B, "lengths": out.clone(),
                           "expected_accepted": exp_acc, "expected_tokens_per_s": theta, **extra}
        return out


class SyncScheduler(_Scheduler):
    """Paper Algorithm 1: greedy admission by survival with the non-anticipating early stop.

    l_r = 0, B = R, tau = R, Theta_best = R * SPS(R); for each candidate in rank order: l_r = j,
    B += 1, tau += a_{r,j}, Theta = tau * SPS(B); keep if Theta > Theta_best, else stop (also stop
    when B would exceed max_tokens). Because every kept candidate raised Theta_best to its own
    Theta, the stop is the first n with Theta_n <= Theta_{n-1}, which is computed vectorised.
    last_stats["budget"] = number of admitted drafts.
    """
    name = "sync"

    def lengths(self, decision, c_hat, survival, cap):
        a = candidates(survival, cap, survival.shape[1])
        R = a.shape[0]
        if R == 0 or R > self.max_tokens:
            return self._finish(a, np.zeros(R, np.int64), 0).to(cap.device)
        order = ranked(a)
        sorted_a = a.T.ravel()[order]
        sorted_a = sorted_a[np.isfinite(sorted_a)]  # excluded ones sort last
        theta = self._theta(R, sorted_a)
        drops = np.flatnonzero(theta[1:] <= theta[:-1])
        n = int(drops[0]) if len(drops) else len(theta) - 1
        # the first n in rank order are prefix-closed: (r, j-1) always ranks before (r, j)
        return self._finish(a, np.bincount(order[:n] % R, minlength=R), n).to(cap.device)


class AsyncScheduler(_Scheduler):
    """Production variant: budget K from survivals two rounds old, current round admits top-K.

    plan_budget(a) is the unconstrained global search K* = argmax_K (R + sum of the K largest
    survivals) * SPS(R + K) (smallest K on ties); it runs on the survivals of round t and is used
    in round t + 2, so in a pipelined engine it is off the critical path. When the batch size
    changed in between, K scales with it (K * R_now / R_then, rounded). Admission is
    ops.prefix_topk(current survivals, K). The first `delay` rounds, with no history yet, use
    K = R * gamma (verify everything the caps and max_tokens allow): that depends on nothing
    drawn in the current round, so losslessness holds for them too.
    last_stats["budget"] = K used this round; "planned_budget" = K planned for round t + delay.
    """
    name = "async"

    delay = 2  # rounds between the survivals a budget is planned on and the round that uses it

    def __init__(self, sps, max_tokens: int | None = None):
        super().__init__(sps, max_tokens)
        self._history: deque = deque()  # (K_planned, R_then), oldest first

    def reset(self):
        self._history.clear()

    def plan_budget(self, a: np.ndarray) -> int:
        """The global search over candidate survivals a [R, gamma] (-inf = excluded)."""
        R = a.shape[0]
        if R == 0 or R > self.max_tokens:
            return 0
        flat = a.ravel()
        sorted_a = -np.sort(-flat[np.isfinite(flat)])  # values only: order of ties is moot
        return int(np.argmax(self._theta(R, sorted_a)))  # first maximum: smallest K

    def admit(self, a: np.ndarray, K: int) -> np.ndarray:
        """Critical path: lengths [R] of the top-K candidates of a [R, gamma] (K is clamped to
        the valid candidates, so an excluded one is never admitted)."""
        K = min(K, int(np.isfinite(a).sum()))
        return ops.prefix_topk(torch.from_numpy(a), K).numpy()

    def decide(self, view: BatchView) -> Decision:
        """K for this round, planned `delay` rounds ago from survivals already verified (scaled
        to this R), or R * gamma while there is no history; the round admits the top-K
        survivals on the device (base.device_lengths), or on the host (lengths) when a request
        filters its rows."""
        if not any(view.caps):
            return Decision(tuple(view.caps))
        R, gamma = len(view), view.gamma
        if len(self._history) >= self.delay:
            K_then, R_then = self._history.popleft()
            K, source = (K_then if R_then == R else round(K_then * R / max(R_then, 1))), "history"
        else:
            K, source = R * gamma, "default"
        return Decision(tuple(view.caps), budget=max(0, min(K, self.max_tokens - R)),
                        budget_source=source)

    def lengths(self, decision, c_hat, survival, cap):
        a = candidates(survival, cap, survival.shape[1])
        return torch.from_numpy(self.admit(a, decision.budget).astype(np.int64)).to(cap.device)

    def observe(self, result) -> None:
        """After the round's host read: plans the budget of round t + delay from this round's
        survivals [R, gamma] (on the host) and caps."""
        d = result.decision
        if result.survival is None or d.budget is None:
            return
        cap = torch.tensor(d.caps, dtype=torch.int64)
        self._plan(candidates(result.survival, cap, result.survival.shape[1]), result.lengths,
                   d.budget, d.budget_source)

    def _plan(self, a: np.ndarray, lengths, K: int, source: str) -> torch.Tensor:
        """Plans the budget of round t + delay on candidates a and records last_stats. Returns
        the lengths as an int64 tensor."""
        planned = self.plan_budget(a)
        self._history.append((planned, a.shape[0]))
        return self._finish(a, np.asarray(lengths, dtype=np.int64), K, budget_source=source,
                            planned_budget=planned)
