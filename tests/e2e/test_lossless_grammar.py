"""Under a grammar the output law is P' = P * mask / Z at every position (DESIGN §6), through
speculative rounds, and the wrong grammar walks fail (tests/support/grammar_harness.py: a toy
automaton over the lossless harness's 8 tokens, a regex and a choice list).

Measured at N = 3,000 (2-core CPU, 2026-12-03), the mutants on the regex case (dspark fixed
vanilla, T 1). With top-k / top-p the law is their filter of P' (the mask first, as vLLM does).

| variant | what is wrong | p |
| --- | --- | --- |
| correct | | 1 (sync gated T 0.6: 0.24; choice on dflash: 1; threshold top-p 0.7: 0.56; async top-k 2: 1; auto regex: 0.67) |
| filter-before-mask | top-k / top-p applied to P, then the mask (the code before this test) | 3e-149 (top-p), 0 (top-k) |
| no-rollback | the matcher keeps the walked drafts after a rejection | 4e-196 |
| stale-state | row k masked with the committed state, not the state after x_1 .. x_k | 0 |
| target-unmasked | only draft position 1 (q) is masked, the target rows are not | 0 |
| residual-unmasked | acceptance sees P', the token after a rejection max(0, P - q) | 5e-200 |
"""
import pytest

from tests.support import grammar_harness as G
from tests.support import lossless_harness as H

N = 3000
CASES = [(H.Case("dspark", "fixed", "vanilla", 1.0), "regex"),
         (H.Case("dspark", "sync", "gated", 0.6), "regex"),
         (H.Case("dflash", "fixed", "none", 1.0), "choice"),
         (H.Case("dspark", "threshold", "vanilla", 0.6, top_p=0.7), "regex"),
         (H.Case("dspark", "async", "gated", 1.0, top_k=2), "regex"),
         (H.Case("dspark", "auto", "vanilla", 1.0), "regex")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return H.write_pair(tmp_path_factory.mktemp("grammar_pair"))


@pytest.mark.slow
@pytest.mark.parametrize("case,form", CASES, ids=[f"{c.id}-{f}" for c, f in CASES])
def test_output_law_under_a_grammar(pair, case, form):
    s = G.sample(pair, case, form, N)
    p, detail = H.pvalue(s.tokens, G.masked_joint(pair["target"], case.T, form, case.top_k, case.top_p))
    print(f"{case.id}-{form}: p {p:.3g}, accepted {s.accepted}/{s.drafted}")
    assert 0 < s.accepted < s.drafted
    assert p > H.P_PASS, detail


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(G.MUTANTS))
def test_wrong_grammar_walk_fails(pair, name):
    case, form = CASES[0]
    s = G.sample(pair, case, form, N, G.MUTANTS[name])
    p, detail = H.pvalue(s.tokens, G.masked_joint(pair["target"], case.T, form))
    print(f"{name}: p {p:.3g}")
    assert p < H.P_FAIL, f"{name} passed: {detail}"
