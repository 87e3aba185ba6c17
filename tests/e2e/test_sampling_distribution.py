"""Temperature > 0: emitted tokens follow the target's distribution (chi-square), per head type,
and a deliberately broken acceptance rule fails the same test (the test has power).

A tiny target with an 8-token vocabulary makes the exact distribution of the first three emitted
tokens computable by enumeration (1 + 8 + 64 forwards). 3000 requests with distinct seeds decode
4 tokens each: y1 comes from the prefill, y2 and y3 from the first speculative round (drafts at
positions 2 and 3 are verified, so both acceptance and the residual path are exercised).
"""
import numpy as np
import pytest

from dspark_rt import Decoder, SamplingParams, ops
from tests.support.lossless_harness import emit_from_p
from tests.support.small_pair import N, PROMPT, T, exact, pvalues, small_pair  # noqa: F401 (fixtures)


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


@pytest.mark.parametrize("head", ["none", "vanilla", "gated", "rnn"])
def test_output_follows_target(small_pair, exact, head):
    toks, accepted, drafted = _sample(small_pair[0], small_pair[1][head], head)
    assert 0 < accepted < drafted, "both acceptance and rejection must be exercised"
    p = pvalues(toks, exact)
    print(f"{head}: p-values {p}, accepted {accepted}/{drafted}")
    assert min(p.values()) > 1e-3, p


def test_broken_acceptance_fails(small_pair, exact, monkeypatch):
    # emits from P instead of the residual max(0, P - q) after a rejection (acceptance is the real op's)
    monkeypatch.setattr(ops, "rejection_sample", emit_from_p)
    toks, _, _ = _sample(small_pair[0], small_pair[1]["vanilla"], "vanilla")
    p = pvalues(toks, exact)
    print("broken acceptance p-values", p)
    assert min(p.values()) < 1e-6, p
