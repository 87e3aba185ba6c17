"""Speculate or not, per round: the hardware-aware choice down to plain decoding.

Algorithm 1 (sync) only chooses verify lengths: the drafter and the heads run every round even
when no draft pays. AutoPolicy decides before drafting, from earlier rounds only, between

    plain round        R tokens                        at plain(R) rounds/s (target alone)
    speculative round  R + sum of admitted survivals   in 1/drafting(R) + t(R + n) - t(R) s
                                                       (n drafts verified; t(B) = 1/plain(B))

drafting(R): rounds/s of speculative rounds of R requests that verify nothing (the profile of
shape "no_drafts": the drafter, the heads and one verify token each); the verify forward's
growth with n comes from the plain profile (linear beyond its last point). Without that profile
the speculative side is priced by sps(R + n), which on most machines undercounts the cost of
drafting for many requests (sps is measured with R = ceil(B / (gamma + 1))). The survivals of
the coming round are estimated per draft position from the calibrated
survivals of past rounds (exponential averages): one shared, and one per request that drafted
(with the request ids of begin_round). The speculative side drafts for the k requests with the
best estimates (the others decode plainly in the round) and takes the best n (Algorithm 1's
objective on their estimates), k and n those of the highest expected tokens/s; it speculates
only when that beats a plain round by SPEC_GAIN (1.1x: the profiles time real rounds, but not
a speculative round's host scheduling, on a CPU a fifth of a small plain round). A round then
chooses its lengths with Algorithm 1 on its own confidences (SyncScheduler), except when the
estimates say every draft pays: then it verifies them all without reading the confidences (as
"fixed" does), reading them again at least once in explore_every rounds.

Losslessness: whether a round drafts depends on earlier rounds only, never on anything drawn in
it (DESIGN §4, as for the async budget). To keep the estimates fresh while plain rounds win, one
round in `explore_every` speculates anyway, for a few requests only (`explore_share` of the
batch, at least one, taken in turn): the others decode plainly in it, so exploring costs the
drafting of a few requests, not of the batch. While exploring keeps confirming that plain rounds
win by a wide margin (the best speculative round expected below CLEAR_LOSS x a plain round's
tokens/s), the interval doubles (up to MAX_BACKOFF x explore_every rounds); a closer call, or a
round that speculates on the estimates' word, sets it back. The first round, with nothing known,
explores the same way instead of drafting for the whole batch. The estimates age by rounds, not
by updates, times the share of the batch an update sees: what a single request's exploring round
sees after a long plain stretch outweighs the stale estimate (text that falls into a repetition
is drafted far better than its first lines), what an eighth of a batch sees does not.

Exploring within a budget. Exploring is the price of knowing when speculation pays, and on a
machine where drafting costs about a plain round (a CPU, or a small batch on a large drafter)
one round in explore_every can cost more than its information is worth. So exploring spends a
credit: every round adds explore_budget x the seconds of a plain round of its batch, and an
exploring round (forced by the interval, or exploring new requests) needs, and spends, the
seconds it adds: the drafting of its requests (the no-drafts profile of as many requests, less
a plain round of as many) and the drafter context they write first (the positions deferred
while they decoded plainly, begin_round's `waiting`, at the context profile's cost); only rows
that may draft are priced. The credit holds at most two exploring rounds of the batch (the
dearer of the rotation's next rows and the new requests' rows) and starts full, so over any
stretch exploring costs at most explore_budget of the plain rounds' time plus two exploring
rounds, as the profiles price it (the speculative round's scheduling on the host is not in
them: ~1 ms a round on a 2-core CPU). The first round, with nothing known, explores whatever the
credit (its debt is bounded by the same two rounds). Without the no-drafts profile exploring is
not priced and only the interval applies; without the context profile its context is not. Like
every decision here, the credit depends on batch sizes, profiles and earlier decisions alone.

New requests. The shared estimate is what other requests taught it, and a plain stretch backs
exploring off: a request that joins then (at batch 1, every new prompt) could decode plainly for
a hundred rounds although its text is drafted almost whole. So a request that never drafted is
explored in the first round it could pay in: when a speculative round in which it (with the
other new ones of an exploring share) drafted and every draft survived would beat a plain round
by a clear margin (CLEAR_GAIN). The bound depends on the batch size and the profiles alone
(lossless, as every decision here); on a machine where drafting a few requests of a large batch
cannot pay even then, new requests there are not explored.
"""
import numpy as np
import torch

from .base import int_arg
from .prefix import SyncScheduler, _as_profile, candidates, ranked


MAX_BACKOFF = 8   # exploring intervals grow up to this many times explore_every ...
CLEAR_LOSS = 0.9   # ... while speculation is expected below this share of plain tokens/s
CLEAR_GAIN = 4 / 3  # a new request is explored when its best case beats plain rounds by this
# a round speculates on the estimates' word only when they expect this much over a plain round:
# the profiles leave out a speculative round's host-side scheduling (reading the confidences,
# Algorithm 1; ~1 ms a round on a 2-core CPU, a fifth of a plain round of the shipped pair)
SPEC_GAIN = 1.1


class AutoPolicy(SyncScheduler):
    """sps: rounds/s of speculative rounds against verify tokens B (as sync); plain: rounds/s of
    plain rounds against R (an SPSProfile of mode "ar" rounds, or its path); drafting: rounds/s
    of speculative rounds of R requests verifying no draft (shape "no_drafts"), or None;
    context: drafter context updates/s against positions written (shape "context"), or None. decay:
    weight of the old estimate per observed round; explore_every: speculate at least once in this
    many rounds (0: never force); explore_budget: exploring costs at most this share of the
    plain rounds' time (module docstring)."""
    name = "auto"
    defers_context = True  # plain rounds cost what plain decoding costs: no drafter context

    def __init__(self, sps, plain, drafting=None, context=None, *, decay: float = 0.8,
                 explore_every: int = 16, explore_share: float = 0.125,
                 explore_budget: float = 0.02, max_tokens: int | None = None):
        # every profile is read through its monotone fit: measured costs are noisy, true ones
        # never fall with the round's size
        super().__init__(_as_profile(sps).monotone(), max_tokens)
        self.plain = _as_profile(plain).monotone()
        self.drafting = None if drafting is None else _as_profile(drafting).monotone()
        # per-round decisions read dense tables, not the profiles: a round costs microseconds
        M = self.plain.max_tokens
        self._plain_s = 1.0 / self.plain.dense(M)  # [M + 1] seconds of a plain round of B
        lo = max(1, M // 2)
        self._plain_slope = max((self._plain_s[M] - self._plain_s[lo]) / (M - lo), 0.0) if M > lo else 0.0
        self._draft_s = None if self.drafting is None else 1.0 / self.drafting.dense(self.drafting.max_tokens)
        self.context = None if context is None else _as_profile(context).monotone()
        self._ctx_s = None if self.context is None else \
            1.0 / self.context.dense(self.context.max_tokens)  # [M + 1] seconds per B positions
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must lie in [0, 1), got {decay!r}")
        explore_every = int_arg("explore_every", explore_every, 0)
        if not 0.0 < explore_share <= 1.0:
            raise ValueError(f"explore_share must lie in (0, 1], got {explore_share!r}")
        if not 0.0 < explore_budget <= 1.0:
            raise ValueError(f"explore_budget must lie in (0, 1], got {explore_budget!r}")
        self.decay, self.explore_every, self.explore_share = decay, explore_every, explore_share
        self.explore_budget = explore_budget
        self._credit: float | None = None          # seconds of drafting exploring may spend
        self._costs: dict = {}                     # k -> _drafting_cost(k); -n -> context of n
        self._plain_s_of: dict = {}                # R -> _plain_round_s(R)
        self._explore = False                      # this round speculates only to explore
        self._interval = explore_every             # plain rounds between exploring ones
        self._margin = 0.0                         # best speculative / plain tokens/s, last decided
        self._age = 0                              # rounds since the estimates were updated
        self._explore_from = 0                     # first request of the next exploring round
        self.estimate: np.ndarray | None = None  # [gamma] expected survival by position
        self._own: dict = {}                       # request id -> (its own estimate, round seen)
        self._updates = 0                          # estimate updates so far (lengths)
        self._last = None                          # (inputs, outputs) of the last _decide
        self._ids: list | None = None              # this round's request ids (None: not known)
        self._waiting: list | None = None          # this round's deferred positions per request
        self._tried: set = set()                   # ids explored as new requests
        self._explore_rows: list | None = None     # the rows an exploring round drafts for
        self._could_pay: dict = {}                 # (R, drafting, drafts) -> bool: the bound
        self._chosen: set | None = None            # batch rows that draft (None: all of them)
        self._round = 0
        self._plain_run = 0                        # plain rounds since the last speculative one
        self._blind_run = 0                        # rounds verified blind since the last read
        self._blind = False                        # this round verifies every draft unread
        self.rounds = {"plain": 0, "speculative": 0, "blind": 0}

    @property
    def needs_confidence(self) -> bool:
        """False for a round the estimates say verifies every draft: its confidences are not
        read (one device read fewer, as under "fixed")."""
        return not self._blind

    def begin_round(self, ids, waiting=None) -> None:
        """ids: the round's request ids; waiting: per request, the positions whose drafter
        context it would write before drafting (deferred in plain rounds), or None."""
        self._ids, self._waiting = ids, waiting  # read this round only, not kept
        if self._ids is not None and len(self._own) + len(self._tried) > 2 * len(self._ids) + 16:
            here = set(self._ids)  # forget the requests that finished
            self._own = {k: v for k, v in self._own.items() if k in here}
            self._tried &= here

    def speculates(self, caps: list[int], gamma: int) -> bool:
        R = len(caps)
        self._round += 1
        if self._ids is not None and len(self._ids) != R:
            self._ids = None  # not this batch's
        if self._waiting is not None and len(self._waiting) != R:
            self._waiting = None
        spec, everything = self._decide(caps, gamma)
        # what exploring would cost this round: the rows of the rotation that may draft, or the
        # new requests' rows; the credit holds up to two of the dearer one
        share = [i for i in self._rotation(R) if caps[i] > 0]
        cost = self._explore_cost(share)
        new_rows = self._fresh_rows(caps)
        fresh_cost = self._explore_cost(new_rows) if new_rows else 0.0
        cap = 2 * max(cost, fresh_cost)
        if cap > 0:  # else nothing could draft (or nothing is priced): the credit waits
            self._credit = cap if self._credit is None else \
                min(self._credit + self.explore_budget * self._plain_round_s(R), cap)
        credit = self._credit or 0.0
        self._explore = spec is None  # nothing known yet: a few requests draft to learn
        if spec is None:
            spec, everything = True, False  # read the confidences: they are what it learns
        elif spec or self._margin >= CLEAR_LOSS:
            self._interval = self.explore_every  # speculating, or a close call: no backing off
        if not spec and self.explore_every and self._plain_run + 1 >= self._interval and \
                credit >= cost:
            spec = self._explore = True
            self._interval = min(2 * self._interval, MAX_BACKOFF * self.explore_every)
        self._explore_rows = self._new_requests(caps, gamma, new_rows, credit >= fresh_cost) \
            if new_rows and (not spec or self._explore) else None
        if self._explore_rows:
            spec = self._explore = True
        spent = (fresh_cost if self._explore_rows else cost) if self._explore else 0.0
        if spent > 0:  # the first round spends whatever the credit: the debt stays bounded
            self._credit = max(credit - spent, -cap)
        self._age += 1
        # blind rounds do not refresh the estimates: one in explore_every reads the confidences
        fresh = not self.explore_every or self._blind_run + 1 < self.explore_every
        self._blind = spec and everything and fresh
        self._blind_run = self._blind_run + 1 if self._blind else 0
        self._plain_run = 0 if spec else self._plain_run + 1
        self.rounds["speculative" if spec else "plain"] += 1
        self.rounds["blind"] += self._blind
        self.last_stats = {"speculates": spec, "blind": self._blind, "R": R}
        return spec

    def draft_caps(self, caps: list[int]) -> list[int]:
        """An exploring round keeps the caps of the new requests it explores, else of
        explore_share of the requests (in turn); another speculative round those of the requests
        whose drafts the estimates say pay."""
        R = len(caps)
        if not self._explore:
            return caps if self._chosen is None else \
                [c if i in self._chosen else 0 for i, c in enumerate(caps)]
        if self._explore_rows:
            keep = set(self._explore_rows)
            return [c if i in keep else 0 for i, c in enumerate(caps)]
        if R < 2:
            return caps
        keep = set(self._rotation(R))
        self._explore_from = (self._explore_from + len(keep)) % R
        return [c if i in keep else 0 for i, c in enumerate(caps)]

    def _share(self, R: int) -> int:
        """Requests an exploring round of a batch of R drafts for."""
        return max(1, int(R * self.explore_share))

    def _rotation(self, R: int) -> list[int]:
        """The rows the next exploring round of a batch of R drafts for (all of a batch of 1)."""
        if R < 2:
            return list(range(R))
        return [(self._explore_from + i) % R for i in range(self._share(R))]

    def _fresh_rows(self, caps) -> list:
        """Rows of requests that never drafted and may draft now (up to an exploring share of
        the batch), in batch order; [] without request ids."""
        if self._ids is None:
            return []
        rows = [i for i, (rid, c) in enumerate(zip(self._ids, caps))
                if c > 0 and rid not in self._own and rid not in self._tried]
        return rows[: self._share(len(caps))]

    def _explore_cost(self, rows) -> float:
        """Seconds an exploring round adds for these rows: their drafting, and the drafter
        context deferred for them (when begin_round said how much and the profile prices it)."""
        cost = self._drafting_cost(len(rows))
        if self._ctx_s is not None and self._waiting is not None:
            n = sum([self._waiting[i] for i in rows])
            if n > 0:
                ctx = self._costs.get(-n)  # negative keys: context of n positions
                if ctx is None:
                    M = self.context.max_tokens  # beyond the profile: its cost per position
                    ctx = float(self._ctx_s[n]) if n <= M else n * float(self._ctx_s[M]) / M
                    self._costs[-n] = ctx
                cost += ctx
        return cost

    def _drafting_cost(self, k: int) -> float:
        """Seconds the drafting of k requests adds to a round: the no-drafts round of k requests
        less a plain round of as many; 0 (not priced) without the profile or beyond it."""
        if self._draft_s is None or not 1 <= k <= self.drafting.max_tokens:
            return 0.0
        cost = self._costs.get(k)  # every round asks: numpy scalars cost microseconds each
        if cost is None:
            cost = self._costs[k] = max(float(self._draft_s[k] - self._verify_s(k)), 0.0)
        return cost

    def _new_requests(self, caps, gamma, rows, affordable: bool) -> list | None:
        """rows (_fresh_rows) to explore this round, when the best case of their drafting would
        pay clearly (module docstring) and the credit holds their cost; None otherwise."""
        R = len(caps)
        if not affordable:
            return None  # not now: exploring has spent its budget (they stay new)
        n = sum(min(caps[i], gamma) for i in rows)
        key = (R, len(rows), n)
        if key not in self._could_pay:
            if R > self.max_tokens or R > self.plain.max_tokens:
                self._could_pay[key] = False  # outside the profiles: left to the estimates
            else:
                best = float(self._round_theta(R, len(rows), np.ones(n)).max())
                self._could_pay[key] = best * float(self._verify_s(R)) / R >= CLEAR_GAIN
        if not self._could_pay[key]:
            return None
        self._tried.update(self._ids[i] for i in rows)
        return rows

    def _decide(self, caps, gamma) -> tuple[bool, bool]:
        """(whether drafting pays, whether the best round verifies every draft); (None, False)
        before any estimate. With request ids, each request has its own estimate (from the
        rounds it drafted in; the shared one until then): the requests are ranked by their
        expected accepted drafts and the round drafts for the best k of them, k = 1, 2, 4, ..,
        R, while the round's expected tokens/s keeps rising; the rest decode plainly in it."""
        R = len(caps)
        self._chosen = None
        if self.estimate is None:
            return None, False
        # between estimate updates a decision depends on the batch alone: plain stretches (the
        # common case under load) reuse it instead of pricing every k again each round
        key = (self._updates, id(self.estimate), len(self._own), gamma, tuple(caps),
               None if self._ids is None else tuple(self._ids))
        if self._last is not None and self._last[0] == key:
            out, self._chosen, self._margin = self._last[1]
            return out
        out = self._decide_now(caps, gamma, R)
        self._last = (key, (out, self._chosen, self._margin))
        return out

    def _decide_now(self, caps, gamma, R) -> tuple[bool, bool]:
        if R > self.max_tokens or R > self.plain.max_tokens:
            return True, False  # outside the profiles: speculate (and learn)
        if self._ids is None or not any(rid in self._own for rid in self._ids):
            # one estimate for all: all draft, or none. Position j's value once per request
            # whose cap reaches j, in descending order (the estimate does not rise along j)
            est = np.minimum.accumulate(self.estimate[:gamma])
            reach = np.bincount(np.minimum(np.asarray(caps, dtype=np.int64), gamma), minlength=gamma + 1)
            shared = np.repeat(est, reach[::-1].cumsum()[::-1][1:])  # requests with cap >= j
            order, ks = None, [R]
        else:
            reach = np.arange(gamma) < np.minimum(np.asarray(caps, dtype=np.int64), gamma)[:, None]
            est = self._estimates(R, gamma) * reach  # [R, gamma], non-increasing along rows
            order = np.argsort(-est.sum(axis=1), kind="stable")
            ks = sorted({min(2 ** i, R) for i in range(R.bit_length() + 1)})
        best, best_k, everything = 0.0, 0, False
        for k in ks:
            if order is None:
                a = shared
            else:
                rows = est[order[:k]]
                a = -np.sort(-rows[rows > 0])  # Algorithm 1's order: descending survival
            theta = self._round_theta(R, k, a)
            j = int(np.argmax(theta))
            if theta[j] <= best:
                break
            best, best_k, everything = float(theta[j]), k, j == len(a)
        self._margin = best * float(self._verify_s(R)) / R
        if self._margin <= SPEC_GAIN:
            return False, False
        if order is not None and best_k < R:
            self._chosen = set(order[:best_k].tolist())
        return True, everything

    def _estimates(self, R: int, gamma: int) -> np.ndarray:
        """[R, gamma]: each request's own estimate, else the shared one."""
        out = np.tile(self.estimate[:gamma], (R, 1))
        if self._ids is not None:
            for i, rid in enumerate(self._ids):
                own = self._own.get(rid)
                if own is not None:
                    out[i] = own[0][:gamma]
        return np.minimum.accumulate(out, axis=1)

    def _round_theta(self, R: int, drafting: int, sorted_a: np.ndarray) -> np.ndarray:
        """Expected tokens/s of a speculative round of R requests, `drafting` of which drafted,
        after admitting the first n of sorted_a, n = 0 .. N (cut at max_tokens):
        (R + a_1 + .. + a_n) / (drafting's own cost + t(R) + slope * n). Drafting's own cost is
        the no-drafts round of `drafting` requests less a plain round of as many; slope is the
        plain profile's chord from R to R + N, so the cost grows linearly within a round and
        Algorithm 1's early stop cannot trip on a step of the measured curve (a dip of Theta
        that later candidates would have lifted again). Without the no-drafts profile:
        Algorithm 1's tau * SPS(R + n)."""
        if self._draft_s is None or drafting > self.drafting.max_tokens or drafting < 1:
            return self._theta(R, sorted_a)
        n = min(len(sorted_a), self.max_tokens - R)
        tokens = np.empty(n + 1)
        tokens[0] = R
        np.cumsum(sorted_a[:n], dtype=np.float64, out=tokens[1:])
        tokens[1:] += R
        t_R = float(self._verify_s(R))
        slope = (float(self._verify_s(R + n)) - t_R) / n if n else 0.0
        return tokens / (self._drafting_cost(drafting) + t_R + slope * np.arange(n + 1))

    def _plain_round_s(self, R: int) -> float:
        """_verify_s(R) as a float, remembered per R (asked every round)."""
        t = self._plain_s_of.get(R)
        if t is None:
            t = self._plain_s_of[R] = float(self._verify_s(R))
        return t

    def _verify_s(self, B):
        """Seconds of a plain round of B tokens, linear beyond the plain profile's last point."""
        M = self.plain.max_tokens
        B = np.asarray(B)
        return self._plain_s[np.minimum(B, M)] + np.maximum(B - M, 0) * self._plain_slope

    def lengths(self, c_hat, survival, cap, gamma):
        if survival is None:  # a blind round: every draft the caps allow
            return torch.clamp(cap, max=gamma)
        drafted = (cap > 0).to("cpu")  # requests that drafted (an exploring round: a few)
        a = survival[:, :gamma].detach().to("cpu").double()[drafted].numpy()
        if a.size:  # the drafting requests' survivals by position inform the next decisions
            self._updates += 1
            mean = np.nan_to_num(a, nan=0.0).mean(axis=0)
            # the old estimate's weight: it ages by rounds, times the share of the batch seen now
            old = self.decay ** max(self._age * a.shape[0] / len(drafted), 1.0)
            self.estimate = mean if self.estimate is None else \
                old * self.estimate[:gamma] + (1 - old) * mean
            self._age = 0
            if self._ids is not None and len(self._ids) == len(drafted):
                # each drafting request's own estimate, aged by the rounds since it last drafted
                for r, row in zip(np.flatnonzero(drafted.numpy()), np.nan_to_num(a, nan=0.0)):
                    own = self._own.get(self._ids[r])
                    w = 0.0 if own is None else self.decay ** (self._round - own[1])
                    self._own[self._ids[r]] = (row if own is None else w * own[0][:gamma] + (1 - w) * row,
                                               self._round)
        # Algorithm 1 (greedy admission in rank order, stop at the first candidate that does not
        # raise Theta: non-anticipating, so lossless) on this policy's round cost, which prices
        # drafting for the requests that drafted once and each verified token at the plain
        # profile's growth; SyncScheduler's SPS(B) charges drafting again for every gamma + 1
        # tokens, and so verifies too little when many requests draft
        a = candidates(survival, cap, gamma)
        R = a.shape[0]
        if R == 0 or R > self.max_tokens:
            return super().lengths(c_hat, survival, cap, gamma)
        order = ranked(a)
        sorted_a = a.T.ravel()[order]
        sorted_a = sorted_a[np.isfinite(sorted_a)]
        theta = self._round_theta(R, int(drafted.sum()), sorted_a)
        drops = np.flatnonzero(theta[1:] <= theta[:-1])
        n = int(drops[0]) if len(drops) else len(theta) - 1
        return self._finish(a, np.bincount(order[:n] % R, minlength=R), n).to(cap.device)
