"""Verify-length policies (DESIGN §4): fixed, threshold, and the hardware-aware prefix
schedulers sync and async, which read the machine's throughput profile SPS(B) (sps.py), and
auto, which also decides per round whether drafting pays at all (auto.py);
STS calibration of the confidences (sts.py), survival tables and Platt scaling fitted offline or
online from served rounds (online.py)."""
from .auto import AutoPolicy
from .base import Calibration, VerifyPolicy
from .online import OnlineCalibration
from .table import TableCalibration
from .prefix import AsyncScheduler, SyncScheduler
from .rules import FixedPolicy, ThresholdPolicy

POLICIES = {"fixed": FixedPolicy, "threshold": ThresholdPolicy, "sync": SyncScheduler,
            "async": AsyncScheduler, "auto": AutoPolicy}


def make_policy(policy, **kwargs) -> VerifyPolicy:
    """policy: a name in POLICIES ("threshold" takes threshold=, "sync" and "async" take
    sps=<SPSProfile or path>, "auto" sps=, plain=, drafting= and context=, see AutoPolicy) or a
    VerifyPolicy instance."""
    if isinstance(policy, VerifyPolicy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)} or a VerifyPolicy, got {policy!r}")
    return POLICIES[policy](**kwargs)


__all__ = ["Calibration", "OnlineCalibration", "TableCalibration", "VerifyPolicy", "FixedPolicy", "ThresholdPolicy", "SyncScheduler",
           "AsyncScheduler", "AutoPolicy", "POLICIES", "make_policy"]
