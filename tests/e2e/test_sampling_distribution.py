"""Temperature > 0: emitted tokens follow the target's distribution (chi-square), per head type,
and a deliberately broken acceptance rule fails the same test (the test has power).

A tiny target with an 8-token vocabulary makes the exact distribution of the first three emitted
tokens computable by enumeration (1 + 8 + 64 forwards). 3000 requests with distinct seeds decode
4 tokens each: y1 comes from the prefill, y2 and y3 from the first speculative round (drafts at
positions 2 and 3 are verified, so both acceptance and the residual path are exercised).
"""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark_rt import Decoder, SamplingParams, ops, testing
from tests.helpers import full_forward_logits
from tests.lossless_harness import emit_from_p

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


def _sample(target, drafter, head):
    mode = "dflash" if head == "none" else "dspark"
    dec = Decoder.from_pretrained(target, drafter, mode=mode)
    params = [SamplingParams(temperature=T, seed=10_000 + i, max_tokens=4, ignore_eos=True)
              for i in range(N)]
    outs = dec.generate([PROMPT] * N, params, use_tqdm=False)
    toks = np.array([o.token_ids[:3] for o in outs])
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    return toks, accepted, drafted


def _chi2(counts, expected_p):
    """Chi-square p-value, cells with expected count < 5 merged into one."""
    counts, exp = np.asarray(counts, float).ravel(), np.asarray(expected_p, float).ravel() * N
    small = exp < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    return chisquare(counts, exp * counts.sum() / exp.sum()).pvalue


def _pvalues(toks, joint):
    y2 = np.bincount(toks[:, 1], minlength=V)
    y3 = np.bincount(toks[:, 2], minlength=V)
    y23 = np.bincount(toks[:, 1] * V + toks[:, 2], minlength=V * V)
    return {"y2": _chi2(y2, joint.sum((0, 2))), "y3": _chi2(y3, joint.sum((0, 1))),
            "y2y3": _chi2(y23, joint.sum(0))}


@pytest.mark.parametrize("head", ["none", "vanilla", "gated", "rnn"])
def test_output_follows_target(small_pair, exact, head):
    toks, accepted, drafted = _sample(small_pair[0], small_pair[1][head], head)
    assert 0 < accepted < drafted, "both acceptance and rejection must be exercised"
    p = _pvalues(toks, exact)
    print(f"{head}: p-values {p}, accepted {accepted}/{drafted}")
    assert min(p.values()) > 1e-3, p


def test_broken_acceptance_fails(small_pair, exact, monkeypatch):
    # emits from P instead of the residual max(0, P - q) after a rejection (acceptance is the real op's)
    monkeypatch.setattr(ops, "rejection_sample", emit_from_p)
    toks, _, _ = _sample(small_pair[0], small_pair[1]["vanilla"], "vanilla")
    p = _pvalues(toks, exact)
    print("broken acceptance p-values", p)
    assert min(p.values()) < 1e-6, p
