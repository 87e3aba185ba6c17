"""Speculate or not, per round: the hardware-aware choice down to plain decoding.

Algorithm 1 (sync) only chooses verify lengths: the drafter and the heads run every round even
when no draft pays. AutoPolicy decides before drafting, from earlier rounds only, whether a round
drafts and for which requests, by composing three parts:

    RoundCost (cost.py)               what a plain or speculative round costs here (profiles)
    SurvivalEstimates (estimates.py)  what the coming round's drafts will likely survive
    ExploreSchedule (explore.py)      when to draft anyway, to keep the estimates fresh

decide(): the requests are ranked by their expected accepted drafts and the round drafts for the
best k of them (k = 1, 2, 4, .., R) while its expected tokens/s keeps rising; it speculates when
that beats a plain round by SPEC_GAIN (the profiles time real rounds, but not a speculative
round's host scheduling: on a CPU a fifth of a small plain round). When the estimates say every
draft pays, the round verifies them all without reading the confidences (as "fixed" does),
reading them again at least once in explore_every rounds. Otherwise the round exploring asks
for, if any; else a plain round. lengths(): Algorithm 1 on its own confidences, priced by the
round cost. observe(): the survivals of the requests that drafted update the estimates.

Losslessness: whether and what a round drafts depends on earlier rounds only, never on anything
drawn in it (DESIGN §4, as for the async budget).
"""
import numpy as np
import torch

from .base import BatchView, Decision
from .cost import RoundCost
from .estimates import SurvivalEstimates
from .explore import ExploreSchedule
from .prefix import SyncScheduler, _as_profile, candidates, ranked

CLEAR_LOSS = 0.9    # exploring backs off while speculation is expected below this share of plain
CLEAR_GAIN = 4 / 3  # a new request is explored when its best case beats plain rounds by this
SPEC_GAIN = 1.1     # a round speculates on the estimates' word only above this gain


class AutoPolicy(SyncScheduler):
    """sps: rounds/s of speculative rounds against verify tokens B (as sync); plain: of plain rounds
    against R; drafting: of rounds of R requests drafting and verifying nothing (shape
    "no_drafts"), or None; context: drafter context updates/s against positions written, or None
    (each an SPSProfile or its path). decay: the estimates' (estimates.py); explore_every,
    explore_share, explore_budget: the schedule's (explore.py)."""
    name = "auto"
    profiles = ("speculative", "plain", "no_drafts", "context")
    optional_profiles = ("no_drafts", "context")  # without them, drafting or context is not priced
    options = ("decay", "explore_every", "explore_share", "explore_budget")
    defers_context = True  # plain rounds cost what plain decoding costs: no drafter context

    def __init__(self, sps, plain, drafting=None, context=None, *, decay: float = 0.8,
                 explore_every: int = 16, explore_share: float = 0.125,
                 explore_budget: float = 0.02, max_tokens: int | None = None):
        super().__init__(_as_profile(sps).monotone(), max_tokens)
        self.cost = RoundCost(self._sps, self.max_tokens, _as_profile(plain),
                              None if drafting is None else _as_profile(drafting),
                              None if context is None else _as_profile(context))
        self.estimates = SurvivalEstimates(decay)
        self.explore = ExploreSchedule(explore_every, explore_share, explore_budget)
        self._round = 0
        self._blind_run = 0   # rounds verified blind since the confidences were last read
        self._last = None     # (key, decision) of the last pricing: plain stretches reuse it
        self._could_pay: dict = {}  # (R, rows, drafts) -> whether new requests could pay
        self.rounds = {"plain": 0, "speculative": 0, "blind": 0}

    # -- the three calls ---------------------------------------------------------------------

    def decide(self, view: BatchView) -> Decision:
        caps, R, gamma, ids, ex = list(view.caps), len(view), view.gamma, view.ids, self.explore
        self._round += 1
        spec, everything, chosen, margin = self._price(caps, gamma, ids)
        # what exploring would cost now: the rotation's rows that may draft, or the new requests'
        share = [i for i in ex.rows(R) if caps[i] > 0]
        cost = self.cost.explore_s(share, view.waiting)
        new_rows = ex.fresh(ids, caps, self.estimates.knows)
        fresh_cost = self.cost.explore_s(new_rows, view.waiting) if new_rows else 0.0
        floor = -2 * max(cost, fresh_cost)
        credit = ex.refill(-floor, self.cost.plain_round_s(R))
        explore = spec is None  # nothing known yet: a few requests draft, to learn
        if explore:
            spec, everything = True, False  # read the confidences: they are what it learns
        elif spec or margin >= CLEAR_LOSS:
            ex.reset()
        if not spec and ex.due() and credit >= cost:
            spec = explore = True
            ex.explored()
        fresh = self._new_requests(caps, gamma, ids, new_rows, credit >= fresh_cost) \
            if new_rows and (not spec or explore) else None
        if fresh:
            spec = explore = True
        if explore:
            ex.spend(fresh_cost if fresh else cost, floor)
        self.estimates.tick()
        # blind rounds do not refresh the estimates: one in explore_every reads the confidences
        blind = spec and everything and (not ex.every or self._blind_run + 1 < ex.every)
        self._blind_run = self._blind_run + 1 if blind else 0
        ex.ran(spec)
        self.rounds["speculative" if spec else "plain"] += 1
        self.rounds["blind"] += blind
        self.last_stats = {"speculates": spec, "blind": blind, "R": R}
        if not spec:
            return Decision((0,) * R)
        if fresh:
            keep = set(fresh)
        elif explore:
            keep = set(ex.rotate(R))
        else:
            keep = chosen
        if keep is not None:
            caps = [c if i in keep else 0 for i, c in enumerate(caps)]
        return Decision(tuple(caps), reads_confidence=not blind, explore=explore)

    def lengths(self, decision, c_hat, survival, cap):
        """Algorithm 1 (greedy admission in rank order, stop at the first candidate that does not
        raise Theta: non-anticipating, so lossless) on the round cost, which prices drafting for
        the requests that drafted once and each verified token at the plain profile's growth
        (SyncScheduler's SPS(B) charges drafting again for every gamma + 1 tokens, and so
        verifies too little when many requests draft)."""
        a = candidates(survival, cap, survival.shape[1])
        R = a.shape[0]
        if R == 0 or R > self.max_tokens:
            return super().lengths(decision, c_hat, survival, cap)
        order = ranked(a)
        sorted_a = a.T.ravel()[order]
        sorted_a = sorted_a[np.isfinite(sorted_a)]
        theta = self.cost.theta(R, int((cap > 0).sum()), sorted_a)
        drops = np.flatnonzero(theta[1:] <= theta[:-1])
        n = int(drops[0]) if len(drops) else len(theta) - 1
        return self._finish(a, np.bincount(order[:n] % R, minlength=R), n).to(cap.device)

    def observe(self, result) -> None:
        """The survivals of the requests that drafted (read rounds only) update the estimates."""
        if result.survival is None:
            return
        drafted = np.asarray(result.decision.caps) > 0
        a = result.survival.detach().to("cpu", torch.float64).numpy()[drafted]
        self.estimates.update(result.ids, drafted, a, self._round)

    def forget(self, request_id) -> None:
        self.estimates.forget(request_id)
        self.explore.tried.discard(request_id)

    # -- pricing -----------------------------------------------------------------------------

    def _price(self, caps, gamma, ids):
        """(speculate?, verify every draft?, rows that draft or None for all, best speculative /
        plain tokens/s); speculate is None before any estimate. Between estimate updates a
        decision depends on the batch alone: plain stretches (the common case under load) reuse
        it instead of pricing every k again each round."""
        if self.estimates.shared is None:
            return None, False, None, 0.0
        key = (self.estimates.version, gamma, tuple(caps), None if ids is None else tuple(ids))
        if self._last is None or self._last[0] != key:
            self._last = (key, self._price_now(caps, gamma, ids))
        return self._last[1]

    def _price_now(self, caps, gamma, ids):
        R = len(caps)
        if not self.cost.in_range(R):
            return True, False, None, 0.0  # outside the profiles: speculate (and learn)
        est = self.estimates
        if ids is None or not any(est.knows(rid) for rid in ids):
            # one estimate for all: all draft, or none. Position j's value once per request
            # whose cap reaches j, in descending order (the estimate does not rise along j)
            shared = np.minimum.accumulate(est.shared[:gamma])
            reach = np.bincount(np.minimum(np.asarray(caps, dtype=np.int64), gamma), minlength=gamma + 1)
            sorted_all = np.repeat(shared, reach[::-1].cumsum()[::-1][1:])  # requests with cap >= j
            order, ks = None, [R]
        else:
            reach = np.arange(gamma) < np.minimum(np.asarray(caps, dtype=np.int64), gamma)[:, None]
            per = est.for_batch(ids, R, gamma) * reach  # [R, gamma], non-increasing along rows
            order = np.argsort(-per.sum(axis=1), kind="stable")
            ks = sorted({min(2 ** i, R) for i in range(R.bit_length() + 1)})
        best, best_k, everything = 0.0, 0, False
        for k in ks:
            if order is None:
                a = sorted_all
            else:
                rows = per[order[:k]]
                a = -np.sort(-rows[rows > 0])  # Algorithm 1's order: descending survival
            theta = self.cost.theta(R, k, a)
            j = int(np.argmax(theta))
            if theta[j] <= best:
                break
            best, best_k, everything = float(theta[j]), k, j == len(a)
        margin = self.cost.gain(R, best)
        if margin <= SPEC_GAIN:
            return False, False, None, margin
        chosen = set(order[:best_k].tolist()) if order is not None and best_k < R else None
        return True, everything, chosen, margin

    def _new_requests(self, caps, gamma, ids, rows, affordable: bool) -> list | None:
        """rows (never drafted) to explore this round: when the best case of their drafting (every
        draft survives) beats a plain round by CLEAR_GAIN and the credit holds their cost. The
        bound depends on the batch size and the profiles alone; on a machine where drafting a
        few requests of a large batch cannot pay even then, new requests there are not explored
        (they stay new)."""
        if not affordable:
            return None
        R = len(caps)
        n = sum(min(caps[i], gamma) for i in rows)
        key = (R, len(rows), n)
        if key not in self._could_pay:
            self._could_pay[key] = self.cost.in_range(R) and \
                self.cost.gain(R, float(self.cost.theta(R, len(rows), np.ones(n)).max())) >= CLEAR_GAIN
        if not self._could_pay[key]:
            return None
        self.explore.tried.update(ids[i] for i in rows)
        return rows
