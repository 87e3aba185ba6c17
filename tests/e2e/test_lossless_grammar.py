"""Under a grammar the output law is P' = P * mask / Z at every position (DESIGN §6), through
speculative rounds, and the wrong grammar walks fail (tests/support/grammar_harness.py)."""
import pytest

from tests.support import grammar_harness as G
from tests.support import lossless_harness as H

N = 3000
CASES = [(H.Case("dspark", "fixed", "vanilla", 1.0), "regex"),
         (H.Case("dspark", "sync", "gated", 0.6), "choice"),
         (H.Case("dflash", "fixed", "none", 1.0), "choice")]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return H.write_pair(tmp_path_factory.mktemp("grammar_pair"))


@pytest.mark.slow
@pytest.mark.parametrize("case,form", CASES, ids=[f"{c.id}-{f}" for c, f in CASES])
def test_output_law_under_a_grammar(pair, case, form):
    s = G.sample(pair, case, form, N)
    p, detail = H.pvalue(s.tokens, G.masked_joint(pair["target"], case.T, form))
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
