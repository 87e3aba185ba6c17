"""A V=8 target and one gamma-3 drafter per head type, and the exact joint law of its first
three emitted tokens (y1, y2, y3) at temperature T by enumeration (1 + 8 + 64 forwards), with
the chi-square p-values of sampled tokens against it. y1 comes from the prefill, y2 and y3 from
the first speculative round. Used by tests/e2e/test_coupled.py (fixtures small_pair and exact,
imported by name); the full law across round boundaries is tests/support/lossless_harness.py."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark_rt import Decoder, testing
from tests.support.helpers import full_forward_logits

V, N, T, PROMPT = 8, 3000, 0.9, [1, 2, 3]


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    target = tmp_path_factory.mktemp("small_target")
    testing.write_tiny_target(target, seed=3, vocab=V, hidden=32, layers=2, heads=2, kv_heads=1,
                              head_dim=16, logit_scale=4.0)
    drafters = {}
    for head in ("none", "vanilla", "gated", "rnn"):
        d = tmp_path_factory.mktemp(f"small_{head}")
        testing.write_tiny_drafter(d, target, head=head, layers=1, block_size=3,
                                   target_layer_ids=[0], markov_rank=4, confidence=True,
                                   confidence_markov=head != "none", seed=11,
                                   share_target_layers=True)
        drafters[head] = d
    return target, drafters


@pytest.fixture(scope="module")
def exact(small_pair):
    """Exact joint distribution of (y1, y2, y3) under the target at temperature T [V, V, V]."""
    dec = Decoder.from_pretrained(small_pair[0], mode="ar", dtype="float64")
    probs = lambda seq: torch.softmax(full_forward_logits(dec.target, seq)[-1] / T, -1)
    p1 = probs(PROMPT)
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    for a in range(V):
        p2 = probs(PROMPT + [a])
        for b in range(V):
            joint[a, b] = p1[a] * p2[b] * probs(PROMPT + [a, b])
    return joint.numpy()


def chi2_pvalue(counts, expected_p):
    """Chi-square p-value, cells with expected count < 5 merged into one."""
    counts, exp = np.asarray(counts, float).ravel(), np.asarray(expected_p, float).ravel() * N
    small = exp < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    return chisquare(counts, exp * counts.sum() / exp.sum()).pvalue


def pvalues(toks, joint):
    """p-values of y2, y3 and (y2, y3) of sampled tokens [n, >= 3] against the exact joint."""
    y2 = np.bincount(toks[:, 1], minlength=V)
    y3 = np.bincount(toks[:, 2], minlength=V)
    y23 = np.bincount(toks[:, 1] * V + toks[:, 2], minlength=V * V)
    return {"y2": chi2_pvalue(y2, joint.sum((0, 2))), "y3": chi2_pvalue(y3, joint.sum((0, 1))),
            "y2y3": chi2_pvalue(y23, joint.sum(0))}
