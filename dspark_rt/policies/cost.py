"""What a round costs on this machine: measured profiles in, seconds and tokens/s out.

    plain round        R tokens                        in t(R) = 1 / plain(R) s
    speculative round  R + sum of admitted survivals   in drafting(k) + t(R) + slope * n s
                                                       (k requests drafted, n drafts verified)

plain(B): rounds/s of plain rounds of B tokens (target alone), read linearly beyond its last
point. drafting(k): what drafting for k requests adds to a round, the profile of shape
"no_drafts" (rounds that draft for k requests and verify none) less a plain round of k; slope:
the plain profile's chord from R to R + n, so a round's cost grows linearly with the drafts it
verifies and Algorithm 1's early stop cannot trip on a step of the measured curve. context(n):
seconds of a drafter context update of n positions (shape "context"). Without the no-drafts
profile a speculative round is priced by Algorithm 1's tau * SPS(R + n), which on most machines
undercounts drafting for many requests (SPS is measured with R = ceil(B / (gamma + 1))).

Every profile is read through its monotone fit: measured costs are noisy, true ones never fall
with the round's size. Per-round questions read dense tables, not the profiles: a round costs
microseconds.
"""
import numpy as np

from .sps import SPSProfile


class RoundCost:
    """sps: the speculative profile (Algorithm 1's SPS(B)) as a dense table [max_tokens + 1];
    plain, drafting, context: SPSProfiles (drafting and context may be None: not priced)."""

    def __init__(self, sps: np.ndarray, max_tokens: int, plain: SPSProfile,
                 drafting: SPSProfile | None = None, context: SPSProfile | None = None):
        self.sps, self.max_tokens = sps, max_tokens
        self.plain = plain.monotone()
        M = self.plain.max_tokens
        self._plain_s = 1.0 / self.plain.dense(M)  # [M + 1] seconds of a plain round of B
        lo = max(1, M // 2)
        self._plain_slope = max((self._plain_s[M] - self._plain_s[lo]) / (M - lo), 0.0) if M > lo else 0.0
        self.drafting = None if drafting is None else drafting.monotone()
        self._draft_s = None if self.drafting is None else 1.0 / self.drafting.dense(self.drafting.max_tokens)
        self.context = None if context is None else context.monotone()
        self._ctx_s = None if self.context is None else 1.0 / self.context.dense(self.context.max_tokens)
        self._memo: dict = {}  # ("plain" | "draft" | "ctx", n) -> seconds: numpy scalars cost µs

    def in_range(self, R: int) -> bool:
        """Whether a round of R requests lies inside the profiles."""
        return R <= self.max_tokens and R <= self.plain.max_tokens

    def plain_s(self, B):
        """Seconds of a plain round of B tokens (array or int), linear beyond the profile."""
        M = self.plain.max_tokens
        B = np.asarray(B)
        return self._plain_s[np.minimum(B, M)] + np.maximum(B - M, 0) * self._plain_slope

    def plain_round_s(self, R: int) -> float:
        """plain_s(R) as a float, remembered per R (asked every round)."""
        t = self._memo.get(("plain", R))
        if t is None:
            t = self._memo[("plain", R)] = float(self.plain_s(R))
        return t

    def drafting_s(self, k: int) -> float:
        """Seconds drafting for k requests adds to a round; 0 (not priced) without the no-drafts
        profile or beyond it."""
        if self._draft_s is None or not 1 <= k <= self.drafting.max_tokens:
            return 0.0
        t = self._memo.get(("draft", k))
        if t is None:
            t = self._memo[("draft", k)] = max(float(self._draft_s[k] - self.plain_s(k)), 0.0)
        return t

    def context_s(self, n: int) -> float:
        """Seconds of writing n positions of drafter context; 0 without the context profile
        (beyond it: its cost per position at the last point)."""
        if self._ctx_s is None or n <= 0:
            return 0.0
        t = self._memo.get(("ctx", n))
        if t is None:
            M = self.context.max_tokens
            t = self._memo[("ctx", n)] = float(self._ctx_s[n]) if n <= M else n * float(self._ctx_s[M]) / M
        return t

    def explore_s(self, rows: list[int], waiting) -> float:
        """Seconds an exploring round adds for these rows: their drafting, and the drafter context
        deferred for them (waiting: positions per request of the batch, or None)."""
        cost = self.drafting_s(len(rows))
        if waiting is not None:
            cost += self.context_s(sum([waiting[i] for i in rows]))
        return cost

    def theta(self, R: int, drafting: int, sorted_a: np.ndarray) -> np.ndarray:
        """float64 [n + 1]: expected tokens/s of a speculative round of R requests, `drafting` of
        which drafted, after admitting the first n survivals of sorted_a (cut at max_tokens):
        (R + a_1 + .. + a_n) / (drafting_s + t(R) + slope * n), or without the no-drafts
        profile Algorithm 1's (R + a_1 + .. + a_n) * SPS(R + n)."""
        n = min(len(sorted_a), self.max_tokens - R)
        if self._draft_s is None or not 1 <= drafting <= self.drafting.max_tokens:
            # tau_n summed left to right in float64, like the paper's loop (SyncScheduler)
            tau = np.cumsum(np.concatenate([[float(R)], sorted_a[:n].astype(np.float64)]))
            return tau * self.sps[R:R + n + 1]
        tokens = np.empty(n + 1)
        tokens[0] = R
        np.cumsum(sorted_a[:n], dtype=np.float64, out=tokens[1:])
        tokens[1:] += R
        t_R = float(self.plain_s(R))
        slope = (float(self.plain_s(R + n)) - t_R) / n if n else 0.0
        return tokens / (self.drafting_s(drafting) + t_R + slope * np.arange(n + 1))

    def gain(self, R: int, theta: float) -> float:
        """A speculative round's expected tokens/s over a plain round's (R / t(R))."""
        return theta * self.plain_round_s(R) / R
