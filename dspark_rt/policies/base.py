"""What a verify-length policy is: one decision per round, and STS calibration.

A round asks its policy three things, in order (DESIGN §4):

    decision = policy.decide(view)      before drafting, from earlier rounds only: which requests
                                        draft and how many drafts each may verify at most
    lengths  = policy.lengths(...)      after drafting, from the calibrated confidences c_hat
                                        [R, gamma] and survivals a = cumprod(c_hat) alone: l_r in
                                        [0, decision.caps[r]] (or the device twin, device_lengths)
    policy.observe(result)              after the round's one host read

A policy must not look at the draft tokens beyond what the confidences carry: that keeps
acceptance lossless. What it keeps per request across rounds it drops in forget(request_id),
which the round state (runner/state.py) calls when a request finishes or is aborted.
"""
import numbers
from dataclasses import dataclass

import torch

from .. import ops


def int_arg(name: str, v, lo: int) -> int:
    """v as an int >= lo (numpy ints too); a bool or a float is a ValueError naming the argument
    (True is an int to Python and would silently run as 1)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return int(v)


@dataclass
class Calibration:
    """Per-position Platt scaling of the confidences (DESIGN §4):
    c_hat_k = sigmoid((logit_k + b_k) / t_k). With biases None (all 0) it is Sequential
    Temperature Scaling, what STS files and SGLang's hold."""
    temperatures: list[float]
    biases: list[float] | None = None

    @classmethod
    def identity(cls, gamma: int) -> "Calibration":
        return cls([1.0] * gamma)

    def apply(self, conf_logit: torch.Tensor):
        """conf_logit [R, gamma] -> (c_hat, survival), both float32 [R, gamma], on its device.
        A request with a NaN confidence (its drafter overflowed) gets c_hat = survival = 0: it
        verifies no draft that round (no_nan_rows)."""
        gamma = conf_logit.shape[1]
        if len(self.temperatures) < gamma:
            raise ValueError(f"calibration has {len(self.temperatures)} temperatures, need {gamma}")
        t = torch.tensor(self.temperatures[:gamma], dtype=torch.float64).to(conf_logit.device,
                                                                             non_blocking=True)
        z = conf_logit.to(torch.float64)
        if self.biases is not None:
            z = z + torch.tensor(self.biases[:gamma], dtype=torch.float64).to(conf_logit.device,
                                                                               non_blocking=True)
        c_hat = torch.sigmoid(z / t)
        return no_nan_rows(conf_logit, c_hat.float(), torch.cumprod(c_hat, dim=1).float())

    def observe(self, conf_logit, lengths: list[int], num_accepted: list[int]) -> None:
        """A served round's raw confidences [R, gamma] (or None), drafts verified and accepted
        per request. Fixed parameters ignore it; OnlineCalibration (online.py) learns from it."""


def no_nan_rows(conf_logit: torch.Tensor, c_hat: torch.Tensor, survival: torch.Tensor):
    """(c_hat, survival) with the rows of requests whose conf_logit holds NaN set to 0: a NaN
    confidence counts as confidence 0, and that request drafts nothing."""
    bad = torch.isnan(conf_logit).any(1, keepdim=True)
    return c_hat.masked_fill(bad, 0.0), survival.masked_fill(bad, 0.0)


@dataclass(frozen=True)
class BatchView:
    """What a policy sees of a round before drafting. ids: request ids in batch order (None when
    the caller has none: a benchmark's synthetic batch); caps: drafts each request may verify
    (0: it opted out of speculation, or no room is left); waiting: per request, positions whose
    drafter context was deferred while it decoded plainly (written before it drafts again)."""
    ids: tuple | None
    caps: tuple[int, ...]
    waiting: tuple[int, ...]
    gamma: int

    def __len__(self) -> int:
        return len(self.caps)


@dataclass(frozen=True)
class Decision:
    """One round's decision, made before drafting. caps[r]: drafts request r may verify (0: it
    does not draft; all 0: a plain round, the target alone). reads_confidence False: every
    request verifies its caps, and the confidences are not read (one device read fewer).
    budget: the number of drafts the round admits by top-K survival on the device (async), None
    for a host decision. explore: the round speculates to learn (auto)."""
    caps: tuple[int, ...]
    reads_confidence: bool = True
    budget: int | None = None
    budget_source: str = ""
    explore: bool = False

    @property
    def drafts(self) -> bool:
        return any(self.caps)

    @classmethod
    def verify_all(cls, caps) -> "Decision":
        return cls(tuple(caps), reads_confidence=False)


class VerifyPolicy:
    """The protocol (module docstring). A policy class declares its registry entry: name, the
    throughput profiles it needs (runner/profiling.py measures them: "speculative", "plain",
    "no_drafts", "context"; those in optional_profiles may be missing) and the options it takes
    by keyword; needs_confidence: it reads the confidence head (a drafter without one cannot run it); defers_context: requests that draft
    nothing in a round keep their drafter context update for later (worth it for a policy that
    decodes plainly for many rounds)."""
    name = "base"
    profiles: tuple[str, ...] = ()
    optional_profiles: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    needs_confidence = False
    defers_context = False

    def decide(self, view: BatchView) -> Decision:
        return Decision(tuple(view.caps))

    def lengths(self, decision: Decision, c_hat: torch.Tensor | None,
                survival: torch.Tensor | None, cap: torch.Tensor) -> torch.Tensor:
        """l [R] int64 in [0, cap_r], cap = decision.caps as a tensor on the confidences' device."""
        raise NotImplementedError

    def observe(self, result) -> None:
        """A round's result (runner.round.RoundResult: decision, ids, lengths, accepted counts and,
        when read, the calibrated survivals [R, gamma] on the host)."""

    def forget(self, request_id) -> None:
        """Drops what this policy keeps about a request that finished or was aborted."""


def device_lengths(survival: torch.Tensor, cap: torch.Tensor, gamma: int, K: int) -> torch.Tensor:
    """The device twin of a budget decision: the top-K candidates by survival, prefix-closed,
    without leaving survival's device (int64 [R]). Excluded candidates (j > cap_r, NaN) form a
    suffix of their request's row and are cut by the count of leading valid ones."""
    a = survival[:, :gamma].to(torch.float32)
    j = torch.arange(1, a.shape[1] + 1, device=a.device)
    excluded = torch.isnan(a) | torch.isneginf(a) | (j[None, :] > cap[:, None])
    a = torch.where(a > 0, a, torch.zeros((), device=a.device))
    a = torch.where(excluded, torch.full((), -torch.inf, device=a.device), a)
    a = torch.cummin(a, dim=1).values
    valid = torch.isfinite(a).long().cumprod(dim=1).sum(dim=1)
    return torch.minimum(ops.prefix_topk(a, K).long(), valid)
