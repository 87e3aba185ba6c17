"""Speculate or not, per round: the hardware-aware choice down to plain decoding.

Algorithm 1 (sync) only chooses verify lengths: the drafter and the heads run every round even
when no draft pays. AutoPolicy decides before drafting, from earlier rounds only, between

    plain round        R tokens                        at plain(R) rounds/s (target alone)
    speculative round  R + sum of admitted survivals   at sps(R + n) rounds/s (n drafts verified)

where the survivals of the coming round are estimated per draft position from the calibrated
survivals of past rounds (an exponential average), and the speculative side takes the best n
(Algorithm 1's objective, with the estimates for every request). A speculative round then
chooses its lengths with Algorithm 1 on its own confidences (SyncScheduler).

Losslessness: whether a round drafts depends on earlier rounds only, never on anything drawn in
it (DESIGN §4, as for the async budget). To keep the estimates fresh while plain rounds win, one
round in `explore_every` speculates anyway.
"""
import numpy as np

from .prefix import SyncScheduler, _as_profile


class AutoPolicy(SyncScheduler):
    """sps: rounds/s of speculative rounds against verify tokens B (as sync); plain: rounds/s of
    plain rounds against R (an SPSProfile of mode "ar" rounds, or its path). decay: weight of
    the old estimate per observed round; explore_every: speculate at least once in this many
    rounds (0: never force)."""
    name = "auto"

    def __init__(self, sps, plain, *, decay: float = 0.8, explore_every: int = 16,
                 max_tokens: int | None = None):
        super().__init__(sps, max_tokens)
        self.plain = _as_profile(plain)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must lie in [0, 1), got {decay!r}")
        if explore_every < 0:
            raise ValueError(f"explore_every must be >= 0, got {explore_every!r}")
        self.decay, self.explore_every = decay, explore_every
        self.estimate: np.ndarray | None = None  # [gamma] expected survival by position
        self._plain_run = 0                        # plain rounds since the last speculative one
        self.rounds = {"plain": 0, "speculative": 0}

    def speculates(self, caps: list[int], gamma: int) -> bool:
        R = len(caps)
        spec = self._decide(caps, gamma)
        if not spec and self.explore_every and self._plain_run + 1 >= self.explore_every:
            spec = True
        self._plain_run = 0 if spec else self._plain_run + 1
        self.rounds["speculative" if spec else "plain"] += 1
        self.last_stats = {"speculates": spec, "R": R}
        return spec

    def _decide(self, caps, gamma) -> bool:
        R = len(caps)
        if self.estimate is None or R > self.max_tokens or R > self.plain.max_tokens:
            return True  # nothing known yet (or outside the profiles): speculate and learn
        a = np.where(np.arange(1, gamma + 1)[None, :] <= np.asarray(caps)[:, None],
                     self.estimate[None, :gamma], -np.inf)
        flat = a.ravel()
        sorted_a = -np.sort(-flat[np.isfinite(flat)])
        theta_spec = float(self._theta(R, sorted_a).max())
        return theta_spec > R * float(self.plain(R))

    def lengths(self, c_hat, survival, cap, gamma):
        a = survival[:, :gamma].detach().to("cpu").double().numpy()
        if a.size:  # every request's survivals by position inform the next decisions
            mean = np.nan_to_num(a, nan=0.0).mean(axis=0)
            self.estimate = mean if self.estimate is None else \
                self.decay * self.estimate[:gamma] + (1 - self.decay) * mean
        return super().lengths(c_hat, survival, cap, gamma)
