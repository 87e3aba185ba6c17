"""Policies that decide per request, with no model of the machine: verify every draft (fixed),
or the longest prefix of confident ones (threshold)."""
import torch

from .base import BatchView, Decision, VerifyPolicy


class FixedPolicy(VerifyPolicy):
    """Verify every draft (l = gamma), the DFlash baseline: the confidences are never read."""
    name = "fixed"

    def decide(self, view: BatchView) -> Decision:
        return Decision.verify_all(view.caps)

    def lengths(self, decision, c_hat, survival, cap):
        return cap.clone()


class ThresholdPolicy(VerifyPolicy):
    """Longest prefix whose calibrated per-position confidences all exceed `threshold`."""
    name = "threshold"
    options = ("threshold",)
    needs_confidence = True

    def __init__(self, threshold: float = 0.5):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must lie in [0, 1], got {threshold!r}")
        self.threshold = threshold

    def lengths(self, decision, c_hat, survival, cap):
        keep = (c_hat > self.threshold).to(torch.int64).cumprod(dim=1).sum(dim=1)
        return torch.minimum(keep, cap)
