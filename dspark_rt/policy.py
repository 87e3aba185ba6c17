"""Verify-length policies: how many of a request's gamma drafts the target checks this round.

A policy sees, per round, the calibrated per-position confidences c_hat [R, gamma], the prefix
survivals a = cumprod(c_hat) [R, gamma] and a per-request cap [R] (tokens the request may still
emit, minus the target's own token), and returns lengths l_r in [0, min(gamma, cap_r)]. A policy
may keep state across rounds (the asynchronous scheduler does); it must not look at the draft
tokens themselves beyond what the confidences carry, which is what keeps acceptance lossless.
"""
from dataclasses import dataclass

import torch


@dataclass
class Calibration:
    """Sequential Temperature Scaling: c_hat_k = sigmoid(logit_k / t_k) (DESIGN §4)."""
    temperatures: list[float]

    @classmethod
    def identity(cls, gamma: int) -> "Calibration":
        return cls([1.0] * gamma)

    def apply(self, conf_logit: torch.Tensor):
        """conf_logit [R, gamma] -> (c_hat, survival), both float32 [R, gamma], on its device."""
        gamma = conf_logit.shape[1]
        if len(self.temperatures) < gamma:
            raise ValueError(f"calibration has {len(self.temperatures)} temperatures, need {gamma}")
        t = torch.tensor(self.temperatures[:gamma], dtype=torch.float64).to(conf_logit.device,
                                                                             non_blocking=True)
        c_hat = torch.sigmoid(conf_logit.to(torch.float64) / t)
        return c_hat.float(), torch.cumprod(c_hat, dim=1).float()


class VerifyPolicy:
    name = "base"
    needs_confidence = False

    def lengths(self, c_hat: torch.Tensor | None, survival: torch.Tensor | None,
                cap: torch.Tensor, gamma: int) -> torch.Tensor:
        raise NotImplementedError


class FixedPolicy(VerifyPolicy):
    """Verify every draft (l = gamma), the DFlash baseline."""
    name = "fixed"

    def lengths(self, c_hat, survival, cap, gamma):
        return torch.clamp(cap, max=gamma)


class ThresholdPolicy(VerifyPolicy):
    """Longest prefix whose calibrated per-position confidences all exceed `threshold`."""
    name = "threshold"
    needs_confidence = True

    def __init__(self, threshold: float = 0.5):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must lie in [0, 1], got {threshold!r}")
        self.threshold = threshold

    def lengths(self, c_hat, survival, cap, gamma):
        keep = (c_hat > self.threshold).to(torch.int64).cumprod(dim=1).sum(dim=1)
        return torch.minimum(keep, cap)


POLICIES = {"fixed": FixedPolicy, "threshold": ThresholdPolicy}


def make_policy(policy, **kwargs) -> VerifyPolicy:
    """policy: a name in POLICIES ("sync" and "async" take sps=<SPSProfile or path>) or a
    VerifyPolicy instance."""
    if isinstance(policy, VerifyPolicy):
        return policy
    if "sync" not in POLICIES:  # the schedulers import this module, so register them lazily
        from .schedulers import AsyncScheduler, SyncScheduler
        POLICIES.update({"sync": SyncScheduler, "async": AsyncScheduler})
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)} or a VerifyPolicy, got {policy!r}")
    return POLICIES[policy](**kwargs)
