"""Prefix schedulers: against plain brute force, invariants under hypothesis, and losslessness on
the paper's Appendix A counterexample (the retrospective variant must fail, so the test has power).
"""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from dspark_rt import ops
from dspark_rt.policies import BatchView, Decision, device_lengths
from dspark_rt.policies.prefix import AsyncScheduler, SyncScheduler, candidates, ranked
from dspark_rt.policies.sps import SPSProfile


class RetrospectiveScheduler(AsyncScheduler):
    """WRONG on purpose (tests only): the global search on the *current* survivals, no early stop.
    Whether x_{r,j} is verified then depends on a_{r,j+1}, which depends on x_{r,j} itself."""
    name = "retrospective"

    def lengths(self, decision, c_hat, survival, cap):
        a = candidates(survival, cap, survival.shape[1])
        K = self.plan_budget(a)
        return self._finish(a, self.admit(a, K), K)


def one_round(sched, c, surv, cap, gamma):
    """A round's three calls on the host path, as runner/round.py makes them: decide (before
    drafting), lengths (from the confidences), observe (after the read). A round whose caps
    are all 0 drafts nothing and asks for no lengths. Returns the lengths [R]."""
    R = surv.shape[0]
    d = sched.decide(BatchView(None, tuple(min(int(k), gamma) for k in cap), (0,) * R, gamma))
    if not d.drafts:
        return torch.zeros(R, dtype=torch.int64)
    ell = sched.lengths(d, c, surv, torch.tensor(d.caps, dtype=torch.int64))
    sched.observe(SimpleNamespace(decision=d, ids=None, survival=surv, lengths=ell.tolist()))
    return ell


# --- brute force, written plainly -----------------------------------------------------------------

def brute_candidates(surv, cap, gamma):
    """[(a, j, r)] for 0-based j < min(gamma, cap_r), sorted by a desc, then j, then r."""
    R = surv.shape[0]
    out = [(float(surv[r, j]), j, r) for r in range(R) for j in range(min(gamma, int(cap[r])))]
    return sorted(out, key=lambda c: (-c[0], c[1], c[2]))


def brute_sync(surv, cap, gamma, sps, max_tokens):
    R = surv.shape[0]
    ell = [0] * R
    if R > max_tokens:
        return ell
    B, tau = R, float(R)
    best = tau * sps(B)
    for a, j, r in brute_candidates(surv, cap, gamma):
        if j != ell[r]:  # does not extend r's prefix: not admissible
            continue
        if B + 1 > max_tokens:
            break
        theta = (tau + a) * sps(B + 1)
        if not theta > best:
            break  # the early stop
        ell[r], B, tau, best = j + 1, B + 1, tau + a, theta
    return ell


def brute_budget(surv, cap, gamma, sps, max_tokens):
    """argmax over K of (R + sum of the K best survivals) * SPS(R + K); smallest K on ties."""
    R = surv.shape[0]
    vals = [c[0] for c in brute_candidates(surv, cap, gamma)]
    best_K, best, tau = 0, R * sps(R), float(R)
    for K in range(1, len(vals) + 1):
        if R + K > max_tokens:
            break
        tau += vals[K - 1]
        if tau * sps(R + K) > best:
            best_K, best = K, tau * sps(R + K)
    return best_K


def brute_topk(surv, cap, gamma, K):
    R = surv.shape[0]
    admitted = {(j, r) for _, j, r in brute_candidates(surv, cap, gamma)[:K]}
    ell = [0] * R
    for j, r in sorted(admitted):
        assert j == 0 or (j - 1, r) in admitted, "top-K broke a prefix"
        ell[r] += 1
    return ell


# --- random cases -----------------------------------------------------------------------------------

def random_case(rng, R, gamma, dyadic):
    """(c_hat, survival, cap) like the runtime's: survival = cumprod(c_hat) in float32. Dyadic
    confidences (multiples of 1/8) make survival ties common and every sum exact."""
    if dyadic:
        c = torch.tensor(rng.integers(0, 9, size=(R, gamma)) / 8.0, dtype=torch.float32)
    else:
        c = torch.tensor(rng.beta(4, 1, size=(R, gamma)), dtype=torch.float32)
    cap = torch.tensor(rng.integers(0, gamma + 2, size=R), dtype=torch.int64)
    return c, torch.cumprod(c, dim=1), cap


def random_sps(rng, max_B, dense=True):
    """A jagged random table; every B measured when dense, else a random subset (step lookup)."""
    Bs = np.arange(1, max_B + 1) if dense else np.unique(np.r_[rng.integers(1, max_B + 1, 5), max_B])
    return SPSProfile(Bs.tolist(), (rng.random(len(Bs)) * 90 + 10).tolist())


@pytest.mark.parametrize("dyadic", [True, False])
def test_sync_equals_brute_force(dyadic):
    rng = np.random.default_rng(0 if dyadic else 1)
    for case in range(300):
        R, gamma = int(rng.integers(1, 7)), int(rng.integers(1, 8))
        # max B around the full batch, so both the early stop and the token cap get exercised
        prof = random_sps(rng, max(1, R * (gamma + 1) + int(rng.integers(-3, 3))), case % 2 == 0)
        c, surv, cap = random_case(rng, R, gamma, dyadic)
        sched = SyncScheduler(prof)
        got = sched.lengths(Decision(tuple(cap.tolist())), c, surv, cap)  # a pure function
        want = brute_sync(surv.numpy(), cap, gamma, prof, prof.max_tokens)
        assert got.tolist() == want, (case, surv, cap)
        assert got.dtype == torch.int64
        assert sched.last_stats["verify_tokens"] == R + sum(want)
        assert sched.last_stats["budget"] == sum(want)


def test_ranking_order_and_masking():
    rng = np.random.default_rng(3)
    for _ in range(50):
        R, gamma = int(rng.integers(1, 40)), int(rng.integers(1, 17))
        c, surv, cap = random_case(rng, R, gamma, dyadic=True)
        surv[rng.random((R, gamma)) < 0.05] = -0.0
        a = candidates(surv, cap, gamma)
        assert np.all(a[:, 1:] <= a[:, :-1]) and not np.isnan(a).any()
        assert np.all(np.isneginf(a) == (np.arange(1, gamma + 1)[None, :] > cap.numpy()[:, None]))
        flat = a.T.ravel()
        want = sorted(range(R * gamma), key=lambda i: (-flat[i], i))  # index i = j * R + r
        assert ranked(a).tolist() == want


def test_sync_stops_at_first_drop_even_if_later_pays():
    # B = 1 -> 2 drops throughput, 3 pays more than anything: the global search would take 2
    # drafts, Algorithm 1 stops at the first.
    prof = SPSProfile([1, 2, 3], [1.0, 0.6, 0.6])
    c = torch.tensor([[0.5, 0.9]])
    surv = torch.cumprod(c, 1)
    assert one_round(SyncScheduler(prof), c, surv, torch.tensor([2]), 2).tolist() == [0]
    retro = RetrospectiveScheduler(prof)
    assert one_round(retro, c, surv, torch.tensor([2]), 2).tolist() == [2]


def test_async_budget_is_global_argmax_two_rounds_old():
    rng = np.random.default_rng(2)
    for trial in range(40):
        R, gamma = int(rng.integers(1, 6)), int(rng.integers(1, 8))
        prof = random_sps(rng, R * (gamma + 1), dense=trial % 2 == 0)
        sched = AsyncScheduler(prof)
        history = []  # of the rounds that drafted (a round whose caps are all 0 does not)
        for _ in range(6):
            c, surv, cap = random_case(rng, R, gamma, dyadic=trial % 3 == 0)
            if not cap.any():
                continue
            got = one_round(sched, c, surv, cap, gamma)
            K, t = sched.last_stats["budget"], len(history)
            if t < 2:
                assert sched.last_stats["budget_source"] == "default"
                assert K == min(R * gamma, prof.max_tokens - R)
            else:
                old_surv, old_cap = history[t - 2]
                assert K == brute_budget(old_surv, old_cap, gamma, prof, prof.max_tokens)
            assert sched.last_stats["planned_budget"] == brute_budget(
                surv.numpy(), cap, gamma, prof, prof.max_tokens)
            assert got.tolist() == brute_topk(surv.numpy(), cap, gamma, K)
            history.append((surv.numpy(), cap))


def test_async_rescales_budget_when_batch_changes():
    prof = SPSProfile(list(range(1, 65)), [100.0] * 64)  # flat: verify as much as allowed
    sched = AsyncScheduler(prof)
    ones = lambda R: torch.ones(R, 4)
    for R in (4, 4, 2):
        one_round(sched, ones(R), ones(R), torch.full((R,), 4), 4)
    assert sched.last_stats["budget"] == 8  # K = 16 planned on 4 requests, used on 2


def test_nan_and_caps_exclude_candidates():
    prof = SPSProfile(list(range(1, 33)), [100.0] * 32)
    c = torch.tensor([[1.0, float("nan"), 1.0], [1.0, 1.0, 1.0]])
    surv = torch.cumprod(c, 1)
    for sched in (SyncScheduler(prof), AsyncScheduler(prof)):
        assert one_round(sched, c, surv, torch.tensor([3, 2]), 3).tolist() == [1, 2]
        assert one_round(sched, c, surv, torch.tensor([0, 0]), 3).tolist() == [0, 0]


def test_batch_larger_than_profile():
    prof = SPSProfile([1, 2, 3], [3.0, 2.0, 1.0])
    c = torch.ones(5, 2)
    for sched in (SyncScheduler(prof), AsyncScheduler(prof)):
        assert one_round(sched, c, c, torch.full((5,), 2), 2).tolist() == [0] * 5
    with pytest.raises(ValueError):
        SyncScheduler(prof, max_tokens=4)


# --- hypothesis invariants ------------------------------------------------------------------------

@st.composite
def rounds(draw):
    R, gamma = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    n_rounds = draw(st.integers(1, 4))
    eighths = st.integers(0, 8)
    cs = [draw(st.lists(st.lists(eighths, min_size=gamma, max_size=gamma), min_size=R, max_size=R))
          for _ in range(n_rounds)]
    caps = [draw(st.lists(st.integers(0, gamma + 1), min_size=R, max_size=R)) for _ in range(n_rounds)]
    max_B = draw(st.integers(1, R * (gamma + 1) + 2))
    sps = draw(st.lists(st.floats(0.5, 100.0), min_size=max_B, max_size=max_B))
    steps = draw(st.lists(st.integers(0, 3), min_size=max_B, max_size=max_B))
    return R, gamma, cs, caps, sps, steps


def run_rounds(sched, R, gamma, cs, caps):
    out = []
    for c, cap in zip(cs, caps):
        c = torch.tensor(c, dtype=torch.float32) / 8
        cap = torch.tensor(cap, dtype=torch.int64)
        if not cap.any():
            continue  # no drafts: a plain round
        ell = one_round(sched, c, torch.cumprod(c, 1), cap, gamma)
        out.append((ell.tolist(), dict(sched.last_stats), cap))
    return out


def profile(values):
    return SPSProfile(list(range(1, len(values) + 1)), values)


@settings(max_examples=150, deadline=None)
@given(rounds())
def test_invariants(case):
    R, gamma, cs, caps, sps, _ = case
    for cls in (SyncScheduler, AsyncScheduler):
        sched = cls(profile(sps))
        for ell, stats, cap in run_rounds(sched, R, gamma, cs, caps):
            assert all(0 <= l <= min(gamma, int(k)) for l, k in zip(ell, cap))
            if R <= sched.max_tokens:
                assert R + sum(ell) <= sched.max_tokens
            assert sum(ell) <= stats["budget"]
            assert stats["verify_tokens"] == R + sum(ell)


@settings(max_examples=150, deadline=None)
@given(rounds(), st.integers(-20, 20))
def test_sps_scale_changes_nothing(case, e):
    # powers of two scale every product exactly, so not even a float tie can move
    R, gamma, cs, caps, sps, _ = case
    for cls in (SyncScheduler, AsyncScheduler):
        base = run_rounds(cls(profile(sps)), R, gamma, cs, caps)
        scaled = run_rounds(cls(profile([v * 2.0 ** e for v in sps])), R, gamma, cs, caps)
        assert [b[0] for b in base] == [s[0] for s in scaled]


@settings(max_examples=150, deadline=None)
@given(rounds())
def test_relatively_faster_large_batches_never_shorten(case):
    # SPS'(B) = SPS(B) * 2**m(B) with m non-decreasing: large B relatively cheaper
    R, gamma, cs, caps, sps, steps = case
    m = np.cumsum(steps)
    for cls in (SyncScheduler, AsyncScheduler):
        base = run_rounds(cls(profile(sps)), R, gamma, cs, caps)
        boosted = run_rounds(cls(profile([v * 2.0 ** int(k) for v, k in zip(sps, m)])),
                             R, gamma, cs, caps)
        for b, f in zip(base, boosted):
            assert sum(f[0]) >= sum(b[0])
            if cls is AsyncScheduler:
                assert f[1]["planned_budget"] >= b[1]["planned_budget"]


# --- losslessness: paper Appendix A -------------------------------------------------------------------

P_TARGET, Q_DRAFT = (0.7, 0.3), (0.5, 0.5)
# SPS(1) = 1, SPS(2) = SPS(3) = 0.6 with c_1 = 0.5, c_2 = 0.9 (x_1 = 0) or 0.1 (x_1 = 1):
#   verify 1: (1 + .5) * .6 = .90 < 1            never pays
#   verify 2: (1 + .5 + .45) * .6 = 1.17 > 1     pays iff c_2 is high
#             (1 + .5 + .05) * .6 = 0.93 < 1
APPENDIX_A_SPS = SPSProfile([1, 2, 3], [1.0, 0.6, 0.6])


def first_tokens(sched, n_rounds=4000, seed=11):
    """Simulate n_rounds independent rounds of one request; the first emitted token of each."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(torch.tensor(Q_DRAFT), 2 * n_rounds, replacement=True,
                               generator=g).view(n_rounds, 2)
    ell = torch.empty(n_rounds, dtype=torch.int64)
    for i in range(n_rounds):
        c = torch.tensor([[0.5, 0.9 if drafts[i, 0] == 0 else 0.1]])
        ell[i] = one_round(sched, c, torch.cumprod(c, 1), torch.tensor([2]), 2)[0]
    # every round in one batched call: row i is round i, its own Philox stream
    cu_rows = torch.zeros(n_rounds + 1, dtype=torch.int32)
    cu_rows[1:] = torch.cumsum(ell + 1, 0)
    target = torch.log(torch.tensor(P_TARGET)).repeat(int(cu_rows[-1]), 1)
    draft_logits = torch.log(torch.tensor(Q_DRAFT)).expand(n_rounds, 2, 2).contiguous()
    _, out, _ = ops.rejection_sample(
        target, cu_rows, drafts, draft_logits, torch.zeros(n_rounds, 2),
        temperature=torch.ones(n_rounds), seed=torch.full((n_rounds,), seed, dtype=torch.int64),
        stream=torch.arange(n_rounds), round_=torch.zeros(n_rounds, dtype=torch.int64))
    return out[:, 0], ell, drafts


def chi2_p(tokens):
    n0 = int((tokens == 0).sum())
    n = tokens.numel()
    return chisquare([n0, n - n0], [P_TARGET[0] * n, P_TARGET[1] * n]).pvalue, n0 / n


def test_appendix_a_retrospective_fails():
    tokens, ell, drafts = first_tokens(RetrospectiveScheduler(APPENDIX_A_SPS))
    assert torch.equal(ell, torch.where(drafts[:, 0] == 0, 2, 0))  # the biased rule, as designed
    p, freq = chi2_p(tokens)
    assert p < 1e-6 and abs(freq - 0.85) < 0.03, (p, freq)


@pytest.mark.parametrize("cls", [SyncScheduler, AsyncScheduler])
def test_appendix_a_causal_schedulers_pass(cls):
    tokens, ell, drafts = first_tokens(cls(APPENDIX_A_SPS))
    if cls is SyncScheduler:
        assert int(ell.sum()) == 0  # verifying 1 never pays, and it stops there
    else:
        # K from two rounds back: 2 drafts about half of the time, whatever x_1 is now
        assert 0.4 < float((ell == 2).float().mean()) < 0.6 and set(ell.tolist()) <= {0, 2}
        hi = drafts[:, 0] == 0
        assert abs(float((ell[hi] == 2).float().mean()) - float((ell[~hi] == 2).float().mean())) < 0.06
    p, freq = chi2_p(tokens)
    assert p > 1e-3, (p, freq)
    assert not math.isnan(freq)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(1, 7), st.integers(0, 60), st.integers(0, 2**31 - 1))
def test_device_admission_equals_host_admission(R, gamma, K, seed):
    """The runner's async path (device_lengths: no host clamp of K) admits exactly what the
    host path admits, NaN / -inf survivals, ties and caps included."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 5, (R, gamma), generator=g).float() / 4  # ties likely
    c[torch.rand(R, gamma, generator=g) < 0.1] = float("nan")
    c[torch.rand(R, gamma, generator=g) < 0.05] = float("-inf")
    surv = torch.cumprod(c, 1)
    cap = torch.randint(0, gamma + 2, (R,), generator=g)
    a = candidates(surv, cap, gamma)
    host = AsyncScheduler.admit(None, a, K)
    dev = device_lengths(surv, cap, gamma, K)
    assert dev.tolist() == host.tolist(), (c, cap, K)
