"""Verify-length policies (DESIGN §4): fixed, threshold, and the hardware-aware prefix
schedulers sync and async, which read the machine's throughput profile SPS(B) (sps.py), and
auto, which also decides per round whether drafting pays at all (auto.py, composed of cost.py,
estimates.py and explore.py); STS calibration of the confidences (sts.py), survival tables and
Platt scaling fitted offline or online from served rounds (online.py).

The registry: POLICIES maps each name to its class, which declares the profiles it needs and the
options it takes; make_policy builds one from them (the Decoder, the CLI and the server all go
through it)."""
from .auto import AutoPolicy
from .base import BatchView, Calibration, Decision, VerifyPolicy, device_lengths
from .online import OnlineCalibration
from .table import TableCalibration
from .prefix import AsyncScheduler, SyncScheduler
from .rules import FixedPolicy, ThresholdPolicy

POLICIES = {cls.name: cls for cls in (FixedPolicy, ThresholdPolicy, SyncScheduler, AsyncScheduler,
                                      AutoPolicy)}
# the profiles a policy may declare, in the order its constructor takes them
PROFILES = ("speculative", "plain", "no_drafts", "context")


def policy_class(policy: str) -> type:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)} or a VerifyPolicy, got {policy!r}")
    return POLICIES[policy]


def make_policy(policy, profiles: dict | None = None, **options) -> VerifyPolicy:
    """policy: a name in POLICIES or a VerifyPolicy instance (returned as it is). profiles: name ->
    SPSProfile (or its path) for the profiles the class declares (None for one the class lists in
    optional_profiles); options: the keywords it declares, e.g. threshold= for
    "threshold". An option or profile the class does not declare is a ValueError naming it."""
    if isinstance(policy, VerifyPolicy):
        return policy
    cls = policy_class(policy)
    bad = sorted(set(options) - set(cls.options))
    if bad:
        raise ValueError(f"policy {policy!r} takes the options {list(cls.options)}, got {bad}")
    profiles = dict(profiles or {})
    extra = sorted(set(profiles) - set(cls.profiles))
    if extra:
        raise ValueError(f"policy {policy!r} reads the profiles {list(cls.profiles)}, got {extra}")
    missing = [p for p in cls.profiles if profiles.get(p) is None and p not in cls.optional_profiles]
    if missing:
        raise ValueError(f"policy {policy!r} needs the profiles {missing}")
    return cls(*[profiles.get(name) for name in cls.profiles], **options)


__all__ = ["BatchView", "Calibration", "Decision", "OnlineCalibration", "TableCalibration",
           "VerifyPolicy", "FixedPolicy", "ThresholdPolicy", "SyncScheduler", "AsyncScheduler",
           "AutoPolicy", "POLICIES", "PROFILES", "device_lengths", "make_policy", "policy_class"]
