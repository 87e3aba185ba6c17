"""What a verify-length policy is: the protocol the round calls, and STS calibration.

A policy sees, per round, the calibrated per-position confidences c_hat [R, gamma], the prefix
survivals a = cumprod(c_hat) [R, gamma] and a per-request cap [R] (drafts the request may
verify: its own target token must still fit), and returns lengths l_r in [0, min(gamma, cap_r)].
It must not look at the draft tokens beyond what the confidences carry: that keeps acceptance
lossless (DESIGN §4).
"""
import numbers
from dataclasses import dataclass

import torch


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


class VerifyPolicy:
    """The protocol. speculates() may skip a round's drafting (AutoPolicy). Host policies
    implement lengths(); the round reads the confidences to the
    host for them when needs_confidence is set. A policy with admits_on_device = True (async)
    decides on the device instead, in three calls per round:

        K, source = next_budget(R, gamma)                  budget, from earlier rounds only
        lengths = admit_on_device(survival, cap, gamma, K)  [R] int64 on the device
        observe(survival, cap, lengths, K, source)         after the round's one host read

    (the round falls back to lengths() when a request filters its rows: top-k / top-p need the
    rows on the host). A policy may keep state across rounds through observe()."""
    name = "base"
    needs_confidence = False
    admits_on_device = False
    # a request that drafts nothing in a round keeps its drafter context update for later
    # (runner/round.py): worth it for a policy that decodes plainly for many rounds
    defers_context = False

    def begin_round(self, ids, waiting=None) -> None:
        """The round's request ids in batch order (None when the caller has none) and, per
        request, the positions whose drafter context is deferred (None: not known), before
        speculates(): for a policy that keeps per-request state (AutoPolicy)."""

    def speculates(self, caps: list[int], gamma: int) -> bool:
        """Whether this round drafts at all (False: a plain round, the target alone), decided
        before drafting and so from earlier rounds only. caps: drafts each request may verify."""
        return True

    def draft_caps(self, caps: list[int]) -> list[int]:
        """The caps of a round that speculates; a request whose cap this makes 0 skips drafting
        (decided from earlier rounds only, as speculates())."""
        return caps

    def lengths(self, c_hat: torch.Tensor | None, survival: torch.Tensor | None,
                cap: torch.Tensor, gamma: int) -> torch.Tensor:
        raise NotImplementedError

    def next_budget(self, R: int, gamma: int) -> tuple[int, str]:
        raise NotImplementedError(f"policy {self.name!r} does not admit on the device")

    def admit_on_device(self, survival, cap, gamma: int, K: int) -> torch.Tensor:
        raise NotImplementedError(f"policy {self.name!r} does not admit on the device")

    def observe(self, survival, cap, lengths: list[int], K: int, source: str) -> None:
        """survival [R, gamma] and cap [R] on the host, the lengths the round verified."""
