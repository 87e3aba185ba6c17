"""Policies that decide per request, with no model of the machine: verify every draft (fixed),
or the longest prefix of confident ones (threshold)."""
import torch

from .base import VerifyPolicy


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
