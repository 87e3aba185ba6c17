"""When a policy that may decode plainly drafts anyway, to learn: the exploration schedule.

While plain rounds win, the survival estimates would go stale; so one round in `every`
speculates anyway, for a few requests only (`share` of the batch, at least one, taken in
turn): the others decode plainly in it, so exploring costs the drafting of a few requests, not
of the batch. While exploring keeps confirming that plain rounds win by a wide margin, the
interval doubles (up to MAX_BACKOFF x every rounds); a closer call, or a round that speculates
on the estimates' word, sets it back.

Exploring within a budget: every round adds `budget` x the seconds of a plain round of its
batch to a credit, and an exploring round needs, and spends, the seconds it adds (its rows'
drafting and the drafter context deferred for them, as RoundCost prices them). The credit holds
at most two exploring rounds and starts full, so over any stretch exploring costs at most
`budget` of the plain rounds' time plus two exploring rounds. Without the profiles that price
exploring, only the interval applies.

New requests: a request that never drafted is explored in the first round it could pay in (the
policy decides when); each is tried once, and `tried` remembers it until the request is gone.
Like every decision of a policy, all of this depends on batch sizes, profiles and earlier
rounds alone (DESIGN §4).
"""
from .base import int_arg

MAX_BACKOFF = 8  # exploring intervals grow up to this many times `every`


class ExploreSchedule:
    def __init__(self, every: int = 16, share: float = 0.125, budget: float = 0.02):
        self.every = int_arg("explore_every", every, 0)
        if not 0.0 < share <= 1.0:
            raise ValueError(f"explore_share must lie in (0, 1], got {share!r}")
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"explore_budget must lie in (0, 1], got {budget!r}")
        self.share, self.budget = share, budget
        self.interval = self.every  # plain rounds between exploring ones
        self.credit: float | None = None  # seconds exploring may spend (None: not started)
        self.plain_run = 0                # plain rounds since the last speculative one
        self.tried: set = set()           # request ids explored as new requests
        self.next_row = 0                 # first row of the next exploring rotation

    def rows(self, R: int) -> list[int]:
        """The rows the next exploring round of a batch of R drafts for (all of a batch of 1)."""
        if R < 2:
            return list(range(R))
        return [(self.next_row + i) % R for i in range(self.size(R))]

    def size(self, R: int) -> int:
        """Requests an exploring round of a batch of R drafts for."""
        return max(1, int(R * self.share))

    def rotate(self, R: int) -> list[int]:
        """rows(R), and the rotation moves on past them."""
        out = self.rows(R)
        if R >= 2:
            self.next_row = (self.next_row + len(out)) % R
        return out

    def fresh(self, ids, caps, known) -> list[int]:
        """Rows of requests that never drafted and may draft now (up to one exploring share of the
        batch), in batch order; [] without request ids. known(id): whether it drafted."""
        if ids is None:
            return []
        rows = [i for i, (rid, c) in enumerate(zip(ids, caps))
                if c > 0 and not known(rid) and rid not in self.tried]
        return rows[: self.size(len(caps))]

    def refill(self, cap: float, plain_round_s: float) -> float:
        """One round's credit: + budget x a plain round, at most cap (two exploring rounds);
        returns what there is to spend."""
        if cap > 0:  # else nothing could draft (or nothing is priced): the credit waits
            self.credit = cap if self.credit is None else min(self.credit + self.budget * plain_round_s, cap)
        return self.credit or 0.0

    def spend(self, seconds: float, floor: float) -> None:
        """The first round spends whatever the credit: the debt stays above floor."""
        if seconds > 0:
            self.credit = max((self.credit or 0.0) - seconds, floor)

    def due(self) -> bool:
        """Whether the interval asks for an exploring round now."""
        return bool(self.every) and self.plain_run + 1 >= self.interval

    def explored(self) -> None:
        """An exploring round ran on the interval's word: back off."""
        self.interval = min(2 * self.interval, MAX_BACKOFF * self.every)

    def reset(self) -> None:
        """A round speculated on the estimates' word, or the call was close: no backing off."""
        self.interval = self.every

    def ran(self, speculative: bool) -> None:
        self.plain_run = 0 if speculative else self.plain_run + 1
