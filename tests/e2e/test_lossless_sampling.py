"""Sampled output follows the target's law exactly, and the test can tell realistic bugs apart.

Harness (tests/support/lossless_harness.py): an 8-token target, so the exact joint law of the first five
emitted tokens is computed by enumeration; drafters with gamma 3 (every head type, heads made
strong enough to matter, and a DFlash2 drafting from its top 4 of the 8 tokens), so y2..y5 straddle one or two round boundaries. A case samples
N = 10,000 seeded requests through Decoder.generate and tests seven statistics: the marginals
of y2..y5 and the joint laws of the consecutive pairs (y2,y3), (y3,y4), (y4,y5); its p-value
is their Bonferroni-corrected minimum. Correct code must pass at p > 1e-3; every wrong variant
must fail at p < 1e-6. The policies run while they choose: threshold 0.5 on confidences that
depend on the previous token, sync and async on the profile SPS(B) = B^-1/2 (async with budgets
planned on an earlier batch), each asserted to verify some drafts and cut others. The logits
processors (min_p, allowed_token_ids, bad_words, min_tokens; tests/support/processor_laws.py)
get cases of their own: the exact law is the processed target's, each enumerated row processed
with the tokens before it.

Power (`python -m tests.support.lossless_harness --n 10000`, 2-core CPU, 2026-12-01): each mutant's
noncentrality measured at 10,000 samples, scaled to N, gives the probability of p < 1e-6:

| mutant | what is wrong | p at N (correct code, same case) | power at 3,000 / 10,000 |
| --- | --- | --- | --- |
| emit-from-P | residual replaced by P after a rejection | 1e-26 at 5,000 (0.79) | 0.98 / 1.00 |
| q-from-U | acceptance sees U instead of z = U + bias | 0 (0.74) | 1.00 / 1.00 |
| q-untempered | acceptance's q drops the temperature | 1e-37 at 5,000 (0.39) | 1.00 / 1.00 |
| P-untempered | verify rounds' P drops the temperature | 8e-25 (0.27) | 0.19 / 1.00 |
| bonus-row-off-by-one | bonus token drawn from the last draft's row | 4e-63 at 5,000 (0.57) | 1.00 / 1.00 |
| filter-one-side | top-k applied to plain steps, not verify rounds | 0 (0.02) | 1.00 / 1.00 |
| threshold-lookahead | verify decision reads the next position's confidence | 4e-258 (1.0) | 1.00 / 1.00 |
| selector-q-unmasked | DFlash2: q over the whole vocabulary, not its top-k candidates (2026-12-02) | 0 (1.0) | 1.00 / 1.00 |
| nan-draft-through | a drafter's NaN q row is tested, its NaN residual emits token 0 (2026-12-03) | 0 (1.0) | 1.00 / 1.00 |
| bad-words-committed-only | bad words matched against the committed tokens, not the drafts before the verify row (2026-12-03) | 5e-16 (1.0) | 0.13 / 1.00 |
| processor-one-side | allowed_token_ids applied to plain steps, not verify rounds (2026-12-03) | 0 (1.0) | 1.00 / 1.00 |

The retrospective Algorithm 1 (paper Appendix A; search past the first drop) needs a batch of one
request to show its bias end to end, too slow here (power 0.5 at 3,000 one-request rounds); it is
caught through the real rejection_sample in tests/policies/test_schedulers.py::
test_appendix_a_retrospective_fails (p 1e-84), and its cousin, a verify decision that peeks at
the token being verified, is threshold-lookahead above.
"""
import pytest

from tests.support import lossless_harness as H

N = 10_000

CASES = [
    H.Case("dflash", "fixed", "none", 1.0),
    H.Case("dflash", "fixed", "none", 0.6, top_p=0.8),
    H.Case("dspark", "fixed", "vanilla", 0.6, top_k=3),
    H.Case("dspark", "fixed", "rnn", 1.5),
    H.Case("dspark", "threshold", "gated", 1.0, top_p=0.8),
    H.Case("dspark", "threshold", "vanilla", 0.6),
    H.Case("dspark", "sync", "vanilla", 1.5, top_k=3),
    H.Case("dspark", "sync", "rnn", 1.0),
    H.Case("dspark", "async", "gated", 0.6),
    H.Case("dspark", "async", "vanilla", 1.5, top_p=0.8),
    H.Case("dspark", "auto", "gated", 1.0, top_k=3),
    H.Case("dspark", "fixed", "selector", 1.0),
    H.Case("dspark", "fixed", "selector", 0.6, top_p=0.8),
    H.Case("dspark", "fixed", "vanilla", 1.0, nan_drafts=True),  # NaN q: rejections, never tokens
    # logits processors of the target's rows (tests/support/processor_laws.py)
    H.Case("dspark", "fixed", "vanilla", 1.0, proc="min_p"),
    H.Case("dspark", "sync", "gated", 1.0, proc="allowed"),
    H.Case("dspark", "fixed", "vanilla", 1.0, proc="bad_words"),
    H.Case("dspark", "threshold", "rnn", 0.6, proc="bad_words"),
    H.Case("dflash", "fixed", "none", 1.0, proc="min_tokens"),
    H.Case("dspark", "sync", "rnn", 1.0, proc="min_tokens"),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return H.write_pair(tmp_path_factory.mktemp("lossless_pair"))


@pytest.fixture(scope="module")
def joints(pair):
    cache = {}

    def get(case):
        key = (case.T, case.top_k, case.top_p, case.proc)
        if key not in cache:
            cache[key] = H.exact_joint(pair["target"], *key)
        return cache[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_output_law_is_the_target_law(pair, joints, case):
    s = H.sample(pair, case, N)
    p, detail = H.pvalue(s.tokens, joints(case))
    verified = s.drafted / (s.rounds * 3)
    print(f"{case.id}: p {p:.3g}, accepted {s.accepted}/{s.drafted}, verified {verified:.2f}, "
          f"{ {k: round(v[0], 4) for k, v in detail.items()} }")
    assert 0 < s.accepted < s.drafted, "acceptance and rejection must both happen"
    if case.policy != "fixed":
        assert 0.05 < verified < 0.95, f"{case.policy} must verify some drafts and cut others"
    assert p > H.P_PASS, detail


@pytest.mark.slow
@pytest.mark.parametrize("mutant", H.MUTANTS, ids=[m.name for m in H.MUTANTS])
def test_wrong_variant_fails(pair, joints, mutant):
    s = H.sample(pair, mutant.case, N, mutant)
    p, detail = H.pvalue(s.tokens, joints(mutant.case))
    print(f"{mutant.name}: p {p:.3g}")
    assert p < H.P_FAIL, f"{mutant.name} ({mutant.why}) passed: {detail}"
