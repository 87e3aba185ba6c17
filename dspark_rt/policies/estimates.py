"""Expected survival by draft position, learned from served rounds: what the coming round's
drafts will likely survive, before they are drafted.

One shared estimate (all requests), and one per request that drafted (its text may be drafted
far better or worse than the others'), both exponential averages of the calibrated survivals of
the rounds they drafted in. The shared one ages by rounds, not by updates, times the share of
the batch an update sees: what a single request's round sees after a long plain stretch
outweighs the stale estimate (text that falls into a repetition is drafted far better than its
first lines), what an eighth of a batch sees does not. A request's own estimate ages by the
rounds since it last drafted.
"""
import numpy as np


class SurvivalEstimates:
    """decay: the old estimate's weight per round. shared: [gamma] or None before any update;
    version changes whenever an estimate does (decisions cached on it stay valid until then)."""

    def __init__(self, decay: float = 0.8):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must lie in [0, 1), got {decay!r}")
        self.decay = decay
        self.shared: np.ndarray | None = None
        self._own: dict = {}  # request id -> (its estimate [gamma], round it last drafted in)
        self.age = 0          # rounds since the shared estimate was updated
        self.version = 0

    def tick(self) -> None:
        """One round passed."""
        self.age += 1

    def knows(self, request_id) -> bool:
        """Whether this request has drafted (and so has its own estimate)."""
        return request_id in self._own

    def update(self, ids, drafted: np.ndarray, a: np.ndarray, round_no: int) -> None:
        """drafted: [R] bool, the requests of the round that drafted; a: [n, gamma] float64, their
        calibrated survivals (NaN counts as 0); ids: the round's request ids or None."""
        if not a.size:
            return
        a = np.nan_to_num(a, nan=0.0)
        gamma = a.shape[1]
        old = self.decay ** max(self.age * a.shape[0] / len(drafted), 1.0)
        mean = a.mean(axis=0)
        self.shared = mean if self.shared is None else old * self.shared[:gamma] + (1 - old) * mean
        self.age = 0
        self.version += 1
        if ids is None or len(ids) != len(drafted):
            return
        for r, row in zip(np.flatnonzero(drafted), a):
            own = self._own.get(ids[r])
            w = 0.0 if own is None else self.decay ** (round_no - own[1])
            self._own[ids[r]] = (row if own is None else w * own[0][:gamma] + (1 - w) * row, round_no)

    def for_batch(self, ids, R: int, gamma: int) -> np.ndarray:
        """[R, gamma], non-increasing along each row: each request's own estimate, else the
        shared one."""
        out = np.tile(self.shared[:gamma], (R, 1))
        if ids is not None:
            for i, rid in enumerate(ids):
                own = self._own.get(rid)
                if own is not None:
                    out[i] = own[0][:gamma]
        return np.minimum.accumulate(out, axis=1)

    def forget(self, request_id) -> None:
        if self._own.pop(request_id, None) is not None:
            self.version += 1

    def __len__(self) -> int:
        """Requests with an estimate of their own."""
        return len(self._own)
