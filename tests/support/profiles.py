"""Throughput profiles for tests that need a scheduler to choose."""
from dspark_rt.policies.sps import SPSProfile


def synthetic_profile(max_tokens: int) -> SPSProfile:
    """SPS(B) = 1000 / (1 + B / 4): admitting a draft of survival a at tau, B pays iff
    a > tau / (4 + B), a cut inside the range of the tiny drafters' confidences (~0.3-0.8)."""
    return SPSProfile.from_pairs({B: 1000.0 / (1.0 + B / 4.0) for B in range(1, max_tokens + 1)})
