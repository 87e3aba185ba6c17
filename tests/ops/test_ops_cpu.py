"""The C++ CPU backend against the PyTorch reference (the spec) on fresh random inputs.

Integer outputs (tokens, accepted counts, emitted tokens, lengths) must match exactly. Float
outputs: float64 must agree to ~1e-12 relative (both sides compute in double and differ only by
summation order over <= a few thousand terms, ~1e-13). float32 follows the STYLE rule
"no worse than 2x a same-precision PyTorch result": the error of the C++ result against the
float64 reference on the same (float32-rounded) inputs may be at most twice the float32
reference's own error, plus a floor of a few ulps for last-bit rounding (both sides round
sums of similar length; neither is more accurate by design).
"""
import math
import random

import numpy as np
import pytest
import torch

from dspark_rt import ops
from dspark_rt.ops import philox, reference

from dspark_rt.testing import op_cases as oc

pytestmark = pytest.mark.skipif("cpp" not in ops.available_backends(),
                                reason="the C++ extension is not built")
DTYPES = [torch.float64, torch.float32]
EPS32 = torch.finfo(torch.float32).eps


def _clone(kw):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _close(got, ref32, ref64, what, floor_ulps=4):
    """float32 rule of the module docstring; float64 (ref32 is None): 1e-12 of the scale."""
    got, ref64 = got.double(), ref64.double()
    assert torch.equal(torch.isnan(got), torch.isnan(ref64)), f"{what}: NaN positions differ"
    fin = torch.isfinite(ref64)
    if not fin.any():
        return
    err = (got - ref64)[fin].abs().max().item()
    scale = ref64[fin].abs().max().item()
    if ref32 is None:
        tol = 1e-12 * (1 + scale)
    else:
        tol = 2 * (ref32.double() - ref64)[fin].abs().max().item() + floor_ulps * EPS32 * scale
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} (scale {scale:.3g})"


# --------------------------------------------------------------------------------------------
# markov_sample

def _markov(kw, backend):
    kw = _clone(kw)
    logits = kw.pop("logits")
    out = ops.markov_sample(logits, kw.pop("hidden"), kw.pop("anchor"), kw.pop("head"),
                            backend=backend, **kw)
    return (logits, *out)  # z, tokens, logprob, lse, conf


def _score(kw, z, r, k):
    """The float64 score the sampler maximises at (request r, step k), given that step's z."""
    T = float(kw["temperature"][r])
    if T == 0:
        return z.double()
    coupled = "coupled" in kw and bool(kw["coupled"][r])
    rnd, purpose, pos = philox.site(kw["round_"][r], coupled, philox.PURPOSE_DRAFT, k + 1)
    g = philox.gumbel(kw["seed"][r], kw["stream"][r], rnd, purpose, pos, torch.arange(z.shape[0]))
    return z.double() / T + g


WEIGHTS = ("hidden", "w1", "w2", "gate_w", "gate_b", "joint_w", "joint_b", "conf_w", "conf_b")


def _bf16_weights(kw):
    """The served configuration of a bf16 model: bf16 hidden and head weights, float32 logits."""
    return {k: v.bfloat16() if k in WEIGHTS and v is not None else v for k, v in kw.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", oc.MARKOV_CASES, ids=str)
def test_markov_sample(case, dtype):
    _check_markov(case, dtype, oc.markov_inputs(case, dtype=dtype))


@pytest.mark.parametrize("case", oc.MARKOV_CASES, ids=str)
def test_markov_sample_bf16_weights(case):
    """bf16 weights under float32 logits: the kernel widens them on load and rounds the
    projected vector u to bf16, exactly the reference's semantics."""
    _check_markov(case, torch.float32, _bf16_weights(oc.markov_inputs(case)))


def _markov_out_of_place(kw, backend, U):
    """markov_sample reading U (kept) and writing z into a fresh float32 / float64 buffer."""
    kw = _clone(kw)
    kw.pop("logits")
    z = torch.full(U.shape, float("nan"), dtype=torch.float64 if U.dtype == torch.float64 else torch.float32)
    out = ops.markov_sample(U, kw.pop("hidden"), kw.pop("anchor"), kw.pop("head"), backend=backend,
                            out=z, **kw)
    return (z, *out)


@pytest.mark.parametrize("case", oc.MARKOV_CASES, ids=str)
def test_markov_out_of_place(case):
    """U read from its own tensor, z written to out: U in the logits dtype, and a bf16 model's
    U in bf16 (its LM head output as it is); every output equals the in-place run on U
    widened first, exactly, and U is left as it was."""
    for key, (dtype, wide) in enumerate([(torch.float32, False), (torch.float64, False),
                                        (torch.float32, True)]):
        kw = oc.markov_inputs(case, dtype=dtype, key=key)
        if wide:
            kw = _bf16_weights(kw)
            kw["logits"] = kw["logits"].bfloat16().to(dtype)  # values a bf16 U holds
        U = kw["logits"].bfloat16() if wide else kw["logits"].clone()
        kept = U.clone()
        for backend in ("cpp", "reference"):
            want = _markov(kw, backend)
            got = _markov_out_of_place(kw, backend, U)
            for a, b in zip(want, got):
                assert torch.equal(a, b), (backend, oc.where(case, key))
            assert torch.equal(U, kept), (backend, oc.where(case, key))


def _flipped_rows(case, kw, z, rz, r64z):
    """[R, gamma] rows of z whose float32 tolerance (module docstring) one bf16 rounding step
    of u excuses, with bf16 weights. u (g * e gated, tanh(out) rnn) is formed in float32 by
    both sides in different orders, then rounded to bf16; within a float32 ulp of a bf16
    midpoint (odds ~1e-4 per component) the sides round it one bf16 step (2^-7 relative at
    most) apart, moving bias_v by 2^-7 |u_j| |w2[v, j]|. Such rows must be rare: a kernel that
    skipped the rounding would miss the tolerance in (nearly) every row."""
    none = torch.zeros(z.shape[:2], dtype=torch.bool)
    if case.head not in ("gated", "rnn", "selector") or kw["w2"].dtype != torch.bfloat16:
        return none
    fin = torch.isfinite(r64z)
    err = lambda a: (a.double() - r64z.double()).where(fin, 0.0).abs()
    tol = 2 * float(err(rz).max()) + 4 * EPS32 * float(r64z.double().where(fin, 0.0).abs().max())
    row_err = err(z).amax(-1)
    off = row_err > tol
    u_max = float(kw["w1"].double().abs().max()) if case.head == "gated" else 1.0  # |g|, |tanh| < 1
    if case.head == "selector":  # u = (gate_w h) * e
        u_max *= float((kw["hidden"].double() @ kw["gate_w"].double().T).abs().max())
    bound = tol + 2 * 2.0 ** -7 * u_max * float(kw["w2"].double().abs().max())  # two steps a row
    assert bool((row_err[off] <= bound).all()), f"z rows off by {float(row_err.max()):.3g} > {bound:.3g}"
    assert int(off.sum()) <= max(1, off.numel() // 20), f"{int(off.sum())} rows of z off: u not rounded?"
    return off


def _check_markov(case, dtype, kw):
    where = oc.where(case)
    z, tok, lp, lse, conf = _markov(kw, "cpp")
    rz, rtok, rlp, rlse, rconf = _markov(kw, "reference")
    # -inf entries of z (the selector's non-candidates) depend only on U: they must match
    assert torch.equal(z.isneginf(), rz.isneginf()), where
    # Greedy steps are argmax of the returned z, structurally (no reference needed).
    greedy = kw["temperature"] == 0
    if greedy.any():
        assert torch.equal(tok[greedy], z[greedy].double().nan_to_num(-math.inf).argmax(-1)), where
    # Steps to compare per request: all, unless a float32 near-tie made the paths split.
    upto = [case.gamma] * case.R
    for r in range(case.R):
        diff = (tok[r] != rtok[r]).nonzero()
        if not len(diff):
            continue
        k = int(diff[0])
        assert dtype == torch.float32, f"float64 tokens differ at request {r} step {k}: {where}"
        # A float32 split is legitimate only at a near-tie of the reference's own scores:
        # z differs by a few ulps of the row's largest |z| (argued below), so the two winners'
        # scores must lie within that of each other.
        s = _score(kw, rz[r, k], r, k)
        T = float(kw["temperature"][r]) or 1.0
        gap = abs(float(s[rtok[r, k]] - s[tok[r, k]]))
        tie = 64 * EPS32 * float(rz[r, k].abs().max()) / T
        assert gap <= tie, (f"request {r} step {k}: token {int(tok[r, k])} vs reference "
                            f"{int(rtok[r, k])}, score gap {gap:.3g} > {tie:.3g}: {where}")
        upto[r] = k + 1  # z and lse of step k still share the same history; logprob does not
    assert sum(u < case.gamma for u in upto) <= max(1, case.R // 2), f"too many near-ties: {where}"
    if dtype == torch.float64:
        ref32 = None
        r64 = (rz, rlp, rlse, rconf)
    else:  # the float32 reference's own error, measured against float64 on the same inputs
        kw64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.dtype == torch.float32
                    and k != "temperature" else v) for k, v in kw.items()}
        r64 = _markov(kw64, "reference")
        r64 = (r64[0], r64[2], r64[3], r64[4])
        ref32 = (rz, rlp, rlse, rconf)
    steps = torch.arange(case.gamma)[None, :]
    upto = torch.tensor(upto)[:, None]
    flipped = _flipped_rows(case, kw, z, rz, r64[0])
    for name, got, i in (("z", z, 0), ("lse", lse, 2), ("conf_logit", conf, 3), ("logprob", lp, 1)):
        # logprob of a split step is of two different tokens: compare it only before the split
        mask = steps < (upto if name != "logprob" else torch.where(upto < case.gamma, upto - 1, upto))
        mask &= ~flipped if name != "conf_logit" else True
        if mask.any():
            _close(got[mask], None if ref32 is None else ref32[i][mask], r64[i][mask],
                   f"{name}: {where}")


# --------------------------------------------------------------------------------------------
# rejection_sample

def _rejection(kw, backend):
    kw = _clone(kw)
    return ops.rejection_sample(kw.pop("target_logits"), kw.pop("cu_rows"), kw.pop("draft_tokens"),
                                kw.pop("draft_logits"), kw.pop("draft_lse"), backend=backend, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", oc.REJECTION_CASES, ids=str)
def test_rejection_sample(case, dtype):
    # The reference upcasts to float64 and so does the kernel: tokens match exactly for both.
    for key in range(3):
        kw = oc.rejection_inputs(case, dtype=dtype, key=key)
        acc, out, failed = _rejection(kw, "cpp")
        racc, rout, rfailed = _rejection(kw, "reference")
        assert torch.equal(acc, racc) and torch.equal(out, rout), oc.where(case, key)
        assert not failed.any() and not rfailed.any(), oc.where(case, key)


@pytest.mark.parametrize("case", oc.REJECTION_CASES, ids=str)
def test_rejection_bf16_target_logits(case):
    """A bf16 model's verify logits served as they are, under float32 drafts: the kernel widens
    them on load, so its tokens are the reference's and those of the float32 copy, exactly."""
    for key in range(3):
        kw = oc.rejection_inputs(case, dtype=torch.float32, key=key)
        half = {**kw, "target_logits": kw["target_logits"].bfloat16()}
        wide = {**kw, "target_logits": half["target_logits"].float()}
        got, ref, cast = _rejection(half, "cpp"), _rejection(half, "reference"), _rejection(wide, "cpp")
        for a, b, c in zip(got, ref, cast):
            assert torch.equal(a, b) and torch.equal(a, c), oc.where(case, key)


def _plant(kw, rng, values):
    """kw with values (NaN, +inf, -inf) planted at a random entry of about a third of the target
    rows; returns it and the failed flags the plants imply (a NaN or +inf in any of a request's
    rows, padding rows past cu_rows[R] excluded)."""
    t = kw["target_logits"].clone()
    cu = kw["cu_rows"].tolist()
    want = [False] * (len(cu) - 1)
    for i in range(t.shape[0]):
        if rng.random() < 0.35:
            v = rng.choice(values)
            t[i, rng.randrange(t.shape[1])] = v
            owner = next((r for r in range(len(cu) - 1) if cu[r] <= i < cu[r + 1]), None)
            if owner is not None and not v == -math.inf:
                want[owner] = True
    return {**kw, "target_logits": t}, torch.tensor(want)


@pytest.mark.parametrize("target_dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [oc.RejectionCase(9, 3, 37, "random", "mixed", "random", coupled="mixed"),
                                  oc.RejectionCase(6, 2, 517, "full", "sampled"),
                                  oc.RejectionCase(5, 0, 100, "zero", "greedy"),
                                  oc.RejectionCase(7, 5, 129, "random", "mixed", noncontig=True)], ids=str)
def test_rejection_failed_rows(case, target_dtype):
    """failed[r]: one of request r's rows holds NaN or +inf (-inf is a masked entry, not a
    failure; rows past cu_rows[R] belong to no request), on every backend and target dtype."""
    import random
    dt = torch.float64 if target_dtype == torch.float64 else torch.float32
    fails = oks = 0
    for key in range(6):
        kw = oc.rejection_inputs(case, dtype=dt, key=key)
        pad = torch.zeros(2, case.V, dtype=dt)
        kw = {**kw, "target_logits": torch.cat([kw["target_logits"], pad]).to(target_dtype)}
        kw, want = _plant(kw, random.Random(key), [math.nan, math.inf, -math.inf])
        fails, oks = fails + int(want.sum()), oks + int((~want).sum())
        for backend in ("cpp", "reference"):
            failed = _rejection(kw, backend)[2]
            assert failed.dtype == torch.bool and torch.equal(failed, want), (backend, oc.where(case, key))
    assert fails and oks, "the plants must fail some requests and spare others"


def _old_residual_prefilter_drops(kw, acc, out):
    """Sweeps (request, rejected row) where the CUDA residual pre-filter as it was (a float32
    estimate of P - q with a flat 1e-4 relative margin) calls the reference's residual token's
    residual zero, i.e. would never evaluate it: the mutant the cold cases must catch."""
    f = np.float32
    drops = sweeps = 0
    cu = kw["cu_rows"]
    for r in range(cu.shape[0] - 1):
        a, lo, ell = int(acc[r]), int(cu[r]), int(cu[r + 1] - cu[r]) - 1
        if a == ell:
            continue
        T = float(kw["temperature"][r])
        x = kw["target_logits"][lo + a].numpy().astype(f)
        z = kw["draft_logits"][r, a].numpy().astype(f)
        m_t, inv_t = f(x.max()), f(1) / f(T)
        log_s = f(math.log(np.exp((x.astype(np.float64) - float(m_t)) / T).sum()))
        cq = f(float(kw["draft_lse"][r, a]) - float(m_t) / T)
        pf, qf = np.exp((x - m_t) * inv_t - log_s), np.exp((z - m_t) * inv_t - cq)
        y = int(out[r, a])
        drops += not ((pf[y] - qf[y]) + f(1e-4) * (pf[y] + qf[y]) > 0)
        sweeps += 1
    return drops, sweeps


def test_rejection_cold_cases_have_power():
    """At T = 0.01-0.03 with the draft's maximum far above the target's, float exponents lose
    ~1e-3 relative: the shared cold cases (run on every backend by test_rejection_sample) must
    contain residual tokens that a flat 1e-4 pre-filter margin prunes (the CUDA kernel's bug)."""
    drops = sweeps = 0
    for case in [c for c in oc.REJECTION_CASES if c.drafts == "shifted"]:
        for key in range(20):
            kw = oc.rejection_inputs(case, key=key)
            acc, out, _ = _rejection(kw, "cpp")
            racc, rout, _ = _rejection(kw, "reference")
            assert torch.equal(acc, racc) and torch.equal(out, rout), oc.where(case, key)
            d, n = _old_residual_prefilter_drops(kw, racc, rout)
            drops, sweeps = drops + d, sweeps + n
    assert drops > 0, f"no residual token the old pre-filter drops in {sweeps} sweeps ({oc.SEED=})"


def _posinf_rows(kw, rng):
    """kw with +inf planted in about half of the target rows (a few entries each)."""
    t = kw["target_logits"].clone()
    for i in range(t.shape[0]):
        if rng.random() < 0.5:
            t[i, torch.randint(0, t.shape[1], (2,), generator=torch.Generator().manual_seed(i))] = math.inf
    return {**kw, "target_logits": t}


@pytest.mark.parametrize("case", [oc.RejectionCase(9, 3, 37, "random", "mixed", "random", coupled="mixed"),
                                  oc.RejectionCase(6, 2, 517, "full", "sampled")], ids=str)
def test_rejection_posinf_logits(case):
    """A +inf target logit (the runner fails such requests) gives the reference's tokens: the
    log-sum-exp of its row is +inf, never NaN, on every backend."""
    import random
    for key in range(3):
        kw = _posinf_rows(oc.rejection_inputs(case, key=key), random.Random(key))
        got, want = _rejection(kw, "cpp"), _rejection(kw, "reference")
        assert all(torch.equal(a, b) for a, b in zip(got, want)), oc.where(case, key)


def test_markov_posinf_logits():
    """markov_sample's lse of a row holding +inf is +inf (torch.logsumexp), its logprob NaN."""
    case = oc.MarkovCase(4, 3, 517, "none", temps="mixed")
    kw = oc.markov_inputs(case, dtype=torch.float64)
    kw["logits"][1, 0, 7] = kw["logits"][2, 2, 500] = kw["logits"][3, 1, 0] = math.inf
    z, tokens, logprob, lse, _ = _markov(kw, "cpp")
    rz, rtokens, rlogprob, rlse, _ = _markov(kw, "reference")
    assert torch.equal(tokens, rtokens), oc.where(case)
    assert lse[1, 0] == math.inf and lse[3, 1] == math.inf and lse[2, 2] == math.inf
    _close(lse, None, rlse, "lse")
    _close(logprob, None, rlogprob, "logprob")


def test_rejection_greedy_structural():
    """Greedy: accepted = longest prefix equal to the target's argmax; then the argmax."""
    g = oc.generator("greedy-structural")
    R, G, V = 64, 7, 50
    ells = torch.randint(0, G + 1, (R,), generator=g)
    cu = torch.zeros(R + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(ells + 1, 0)
    target = torch.randn(int(cu[-1]), V, generator=g)
    best = target.argmax(-1)
    drafts = torch.randint(0, V, (R, G), generator=g)
    want = torch.randint(0, G + 1, (R,), generator=g).minimum(ells)
    for r in range(R):
        lo = int(cu[r])
        drafts[r, :want[r]] = best[lo:lo + want[r]]
        if want[r] < ells[r]:
            drafts[r, want[r]] = (best[lo + want[r]] + 1) % V
    zeros = torch.zeros(R, dtype=torch.int64)
    acc, out, _ = ops.rejection_sample(target, cu, drafts, torch.randn(R, G, V), torch.zeros(R, G),
                                    temperature=torch.zeros(R), seed=zeros, stream=zeros,
                                    round_=zeros, backend="cpp")
    assert torch.equal(acc.long(), want), oc.where("greedy-structural")
    for r in range(R):
        a, lo = int(want[r]), int(cu[r])
        assert out[r, :a].tolist() == drafts[r, :a].tolist()
        assert int(out[r, a]) == int(best[lo + a]) and (out[r, a + 1:] == -1).all()


def _chi2_pvalue(tokens, P):
    from scipy.stats import chisquare
    counts = torch.bincount(tokens, minlength=P.shape[0]).double()
    return chisquare(counts.numpy(), (P * counts.sum()).numpy()).pvalue


def _stat_setup(V, seed, R=40_000, T=0.7):
    """One draft (gamma = 1) against the same target/draft distributions in R requests."""
    g = torch.Generator().manual_seed(seed)
    t_row = torch.randn(2, V, generator=g, dtype=torch.float64) * 1.5  # rows: position 1, bonus
    z = torch.randn(V, generator=g, dtype=torch.float64) * 1.5
    P = torch.softmax(t_row[0] / T, -1)
    q = torch.softmax(z / T, -1)
    x = torch.multinomial(q, R, replacement=True, generator=g)
    return g, P, q, x, t_row, z


@pytest.mark.parametrize("V", [4, 5, 6])
def test_rejection_distribution(V):
    """T > 0: the first emitted token (accepted draft or residual sample) is distributed as P,
    whatever the draft distribution q; a deliberately broken sampler fails the same test."""
    R, T = 40_000, 0.7
    g, P, q, x, t_row, z = _stat_setup(V, seed=100 + V, R=R, T=T)
    kw = dict(temperature=torch.full((R,), T), seed=torch.full((R,), 12345 + V),
              stream=torch.arange(R), round_=torch.zeros(R, dtype=torch.int64))
    acc, out, _ = ops.rejection_sample(
        t_row.float().repeat(R, 1), torch.arange(0, 2 * R + 1, 2, dtype=torch.int32), x[:, None],
        z.float().expand(R, 1, V).contiguous(), torch.logsumexp(z.float().double() / T, -1).float().expand(R, 1).contiguous(),
        backend="cpp", **kw)
    assert 0 < int(acc.sum()) < R  # both branches taken
    p = _chi2_pvalue(out[:, 0], P)
    assert p > 1e-3, f"C++ rejection sampler: chi-square p = {p:.3g} (V={V})"
    # Broken variants, in Python, on the same draws. Each must be detected.
    u = torch.rand(R, generator=g, dtype=torch.float64)
    from_p = torch.multinomial(P, R, replacement=True, generator=g)
    resid = (P - q).clamp(min=0)
    from_resid = torch.multinomial(resid / resid.sum(), R, replacement=True, generator=g)
    ok = u * q[x] < P[x]
    broken = {
        "emit from P instead of the residual": torch.where(ok, x, from_p),
        "accept iff u < q/p": torch.where(u * P[x] < q[x], x, from_resid),
    }
    for name, y in broken.items():
        p_bad = _chi2_pvalue(y, P)
        assert p_bad < 1e-6, f"the test has no power against '{name}': p = {p_bad:.3g} (V={V})"
    assert _chi2_pvalue(torch.where(ok, x, from_resid), P) > 1e-3  # the Python twin is right


# --------------------------------------------------------------------------------------------
# prefix_topk

@pytest.mark.parametrize("case", oc.PREFIX_TOPK_CASES, ids=str)
def test_prefix_topk(case):
    survival, Ks = oc.prefix_topk_inputs(case)
    for K in Ks:
        got = ops.prefix_topk(survival, K, backend="cpp")
        want = reference.prefix_topk(survival, K)
        assert torch.equal(got, want), f"K={K}: {got.tolist()} vs {want.tolist()}: {oc.where(case)}"


# --------------------------------------------------------------------------------------------
# verify_attention

def _attention(kw, backend):
    kw = _clone(kw)
    return ops.verify_attention(kw.pop("q"), kw.pop("cu_q"), kw.pop("k_cache"), kw.pop("v_cache"),
                                kw.pop("block_tables"), kw.pop("kv_lens"), backend=backend, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", oc.ATTENTION_CASES, ids=str)
def test_verify_attention(case, dtype):
    kw = oc.attention_inputs(case, dtype=dtype)
    got = _attention(kw, "cpp")
    ref = _attention(kw, "reference")
    assert not got.isnan().any(), f"NaN leaked from a page or slot the request does not own: {oc.where(case)}"
    if dtype == torch.float64:
        _close(got, None, ref, f"out: {oc.where(case)}")
    else:
        kw64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in kw.items()}
        # Floor of 8 ulps: the kernel's exp (ExpF, ~1 ulp) and torch's (Sleef, <= 1 ulp) may
        # round differently, on top of summation order over up to a few hundred keys.
        _close(got, ref, _attention(kw64, "reference"), f"out: {oc.where(case)}", floor_ulps=8)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("case", oc.ATTENTION_CASES, ids=str)
def test_verify_attention_plan_reuse(case, backend):
    """One plan for several layers (caches of one shape) gives exactly the per-call result, into
    a fresh tensor or into out=."""
    kw = oc.attention_inputs(case)
    q, cu_q, bt, kv_lens = kw["q"], kw["cu_q"], kw["block_tables"], kw["kv_lens"]
    caches = [(kw["k_cache"], kw["v_cache"])]
    caches.append(tuple(torch.where(c.isnan(), c, torch.randn_like(c)) for c in caches[0]))
    mask = dict(causal=case.causal, window=case.window)
    plan = ops.plan_verify_attention(cu_q, kv_lens, bt, caches[0][0], h_q=case.h_q, **mask,
                                     backend=backend)
    out = torch.full((q.shape[0], case.h_q, case.head_dim), math.nan)
    for k_cache, v_cache in caches:
        args = (q, cu_q, k_cache, v_cache, bt, kv_lens)
        want = ops.verify_attention(*args, **mask, scale=kw["scale"], backend=backend)
        got = ops.verify_attention(*args, **mask, scale=kw["scale"], plan=plan)
        assert torch.equal(got, want), oc.where(case)
        into = ops.verify_attention(*args, **mask, scale=kw["scale"], plan=plan, out=out)
        assert into is out and torch.equal(out, want), oc.where(case)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_verify_attention_window_edges(backend):
    """A window as wide as every context is no window (bit for bit); a causal window of 1 sees
    only the query's own key, so the output is that key's value."""
    case = oc.AttentionCase((5, 3), (30, 7), 4, 2, 16, 8)
    kw = oc.attention_inputs(case)
    want = _attention(kw, backend)
    assert torch.equal(_attention({**kw, "window": 35}, backend), want)  # kv_len 35: all keys
    assert not torch.equal(_attention({**kw, "window": 34}, backend), want)  # the last row binds
    own = _attention({**kw, "window": 1}, backend)
    ps, L = case.page_size, [35, 10]
    for r, (lo, n) in enumerate(((0, 5), (5, 3))):
        for i in range(n):
            pos = L[r] - n + i
            page = int(kw["block_tables"][r, pos // ps])
            v = kw["v_cache"][page, pos % ps].repeat_interleave(2, 0)  # KV head of each q head
            assert torch.allclose(own[lo + i], v, atol=1e-6)


def test_verify_attention_plan_mismatch():
    """A plan serves only the batch and heads it was made for; bad metadata fails at plan time."""
    kw = oc.attention_inputs(oc.AttentionCase((3, 2), (20, 5), 6, 2, 16, 8))
    q, cu_q, kc, vc, bt, kv_lens = (kw[k] for k in ("q", "cu_q", "k_cache", "v_cache",
                                                    "block_tables", "kv_lens"))
    plan = ops.plan_verify_attention(cu_q, kv_lens, bt, kc, h_q=6)
    run = lambda **ch: ops.verify_attention(*[ch.get(k, kw[k]) for k in (
        "q", "cu_q", "k_cache", "v_cache", "block_tables", "kv_lens")],
        causal=ch.get("causal", True), plan=ch.get("plan", plan), out=ch.get("out"))
    run()
    _raises(lambda: run(kv_lens=kv_lens.clone()), "plan", "kv_lens")
    _raises(lambda: run(cu_q=cu_q.clone()), "plan", "cu_q")
    _raises(lambda: run(causal=False), "plan", "causal")
    _raises(lambda: run(q=q[:, :4].contiguous()), "plan", "h_q")
    _raises(lambda: run(plan="plan"), "plan", "plan_verify_attention")
    _raises(lambda: run(out=torch.empty(q.shape[0], 6, 8)), "out", "shape")
    bad = bt.clone()
    bad[0, 0] = 10_000
    _raises(lambda: ops.plan_verify_attention(cu_q, kv_lens, bad, kc, h_q=6), "plan_verify_attention",
            "block_tables")
    _raises(lambda: ops.plan_verify_attention(cu_q, kv_lens, bt, kc, h_q=5), "h_q")


def test_verify_attention_bad_pages():
    """Page ids outside the cache: the door refuses host metadata (OpError), the C++ kernel
    refuses too when reached directly, and the reference (the semantics of the device kernels,
    which cannot check without a sync) gives NaN in every row of that request and only there."""
    from dspark_rt import _C
    case = oc.AttentionCase((3, 2, 4), (20, 5, 9), 6, 2, 16, 8)
    kw = oc.attention_inputs(case)
    good = _attention(kw, "reference")
    cu = kw["cu_q"]
    for bad_page in (-1, kw["k_cache"].shape[0], 2 ** 31 - 1):
        bt = kw["block_tables"].clone()
        bt[1, 0] = bad_page
        _raises(lambda: _attention({**kw, "block_tables": bt}, "cpp"), "block_tables")
        got = reference.verify_attention(kw["q"], cu, kw["k_cache"], kw["v_cache"], bt,
                                         kw["kv_lens"], True, kw["scale"])
        rows = slice(int(cu[1]), int(cu[2]))
        assert got[rows].isnan().all(), bad_page
        keep = torch.ones(got.shape[0], dtype=torch.bool)
        keep[rows] = False
        assert torch.equal(got[keep], good[keep]), bad_page
        p = ops.attention._attention_params(case.R, case.h_q, kw["k_cache"], torch.float32, True)
        p.max_pages, p.scale = bt.shape[1], kw["scale"]
        out = torch.empty_like(kw["q"])
        p.q, p.cu_q, p.k_cache, p.v_cache = (t.data_ptr() for t in (kw["q"], cu, kw["k_cache"], kw["v_cache"]))
        p.block_tables, p.kv_lens, p.out = bt.data_ptr(), kw["kv_lens"].data_ptr(), out.data_ptr()
        with pytest.raises(ValueError, match="verify_attention.*bad argument"):
            _C.verify_attention(p, "cpp", 0)
    bt = kw["block_tables"].clone()  # kv_len beyond the table row: NaN rows as well
    got = reference.verify_attention(kw["q"], cu, kw["k_cache"], kw["v_cache"], bt[:, :2],
                                     kw["kv_lens"], True, kw["scale"])
    assert got[int(cu[0]):int(cu[1])].isnan().all() and not got[int(cu[1]):].isnan().any()


# --------------------------------------------------------------------------------------------
# determinism, batch order, thread count

def _permute(kw, perm, batch_keys):
    return {k: (v[perm] if k in batch_keys else v) for k, v in kw.items()}


def test_markov_determinism_and_batch_order():
    case = oc.MarkovCase(6, 5, 3001, "gated", conf="markov", temps="mixed")
    kw = oc.markov_inputs(case, dtype=torch.float32)
    a, b = _markov(kw, "cpp"), _markov(kw, "cpp")
    assert all(torch.equal(x, y) for x, y in zip(a, b)), oc.where(case)
    perm = torch.randperm(case.R, generator=oc.generator(case, "perm"))
    keys = {"logits", "hidden", "anchor", "temperature", "seed", "stream", "round_"}
    c = _markov(_permute(kw, perm, keys), "cpp")
    # Each request's tokens depend only on its own (seed, stream, round): bit-identical.
    assert all(torch.equal(x[perm], y) for x, y in zip(a, c)), oc.where(case)


def test_rejection_determinism_and_batch_order():
    case = oc.RejectionCase(9, 5, 300, "full", "mixed")
    kw = oc.rejection_inputs(case, dtype=torch.float32)
    a, b = _rejection(kw, "cpp"), _rejection(kw, "cpp")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), oc.where(case)
    perm = torch.randperm(case.R, generator=oc.generator(case, "perm"))
    rows = kw["target_logits"].view(case.R, case.gamma + 1, -1)[perm].reshape(-1, case.V)
    kwp = _permute(kw, perm, {"draft_tokens", "draft_logits", "draft_lse", "temperature", "seed",
                              "stream", "round_"})
    kwp["target_logits"] = rows
    c = _rejection(kwp, "cpp")
    assert torch.equal(a[0][perm], c[0]) and torch.equal(a[1][perm], c[1]), oc.where(case)


def test_results_independent_of_thread_count():
    mk = oc.markov_inputs(oc.MarkovCase(3, 4, 4099, "rnn", conf="plain"), dtype=torch.float32)
    at = oc.attention_inputs(oc.AttentionCase((8, 3, 5), (100, 40, 70), 8, 2, 64, 16),
                             dtype=torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (_markov(mk, "cpp"), _attention(at, "cpp"))
    finally:
        torch.set_num_threads(threads)
    many = (_markov(mk, "cpp"), _attention(at, "cpp"))
    assert all(torch.equal(x, y) for x, y in zip(one[0], many[0]))
    assert torch.equal(one[1], many[1])


def _split_score(units, tiles, chunk, target):
    """verify_attention's split-KV cost model (csrc/attn_split.h), written again, in eighths of a
    tile time: max(HBM: 8 W / target, a block's own stream: 2 x waves x longest item) + 8 per wave
    + the merge, one per split of the most-split unit; None past the 2 x target partial slots or
    128 splits of a unit. Entries without units take no part."""
    units, tiles = zip(*[(u, t) for u, t in zip(units, tiles) if u > 0])
    S = [-(-t // chunk) if t > 0 else 1 for t in tiles]
    items = sum(u * s for u, s in zip(units, S))
    longest = max(-(-t // s) if t > 0 else 0 for t, s in zip(tiles, S))
    split = items > sum(units)
    if split and (items > 2 * target or max(S) > 128):
        return None
    waves = -(-items // target)
    hbm = -(-8 * sum(u * t for u, t in zip(units, tiles)) // target)
    return max(hbm, 2 * waves * longest) + 8 * waves + (max(S) if split else 0)


def test_attention_splits_by_cost_model():
    """The CUDA planner's split-KV chunk (its host twin): the model's optimum over every chunk
    when the longest unit is under 64k keys, never worse than filling the GPU once, no split once
    the units fill it, entries without units (requests without query rows) ignored. The merge is
    priced: batch 1 over 4k keys (8 KV heads, 65 tiles) takes 9 splits, not the 33 that fill
    264 blocks once; 5 requests take 2 (80 items still saturate HBM), in one wave where the
    fill-once chunk needs two."""
    from dspark_rt import _C
    NO_SPLIT = 0x7fffffff
    rng = random.Random(oc.SEED)
    for _ in range(400):
        target = rng.choice([8, 66, 264, 528])
        n = rng.randint(1, 40)
        units = [rng.choice([0, 1, 2, 4, 8]) for _ in range(n)]
        tiles = [rng.randint(0, rng.choice([5, 80, 600])) for _ in range(n)]
        chunk = _C.attn_split_chunk(units, tiles, target)
        t_max = max([t for u, t in zip(units, tiles) if u], default=0)
        if sum(units) >= target or t_max == 0:
            assert chunk == NO_SPLIT, (units, tiles, target)
            continue
        got = _split_score(units, tiles, chunk, target)
        scores = [_split_score(units, tiles, c, target) for c in [NO_SPLIT, *range(2, t_max + 1)]]
        work = sum(u * t for u, t in zip(units, tiles))
        fill_once = _split_score(units, tiles, max(2, -(-work // target)), target)
        assert got is not None and got == min(x for x in scores if x is not None), (units, tiles, target)
        assert fill_once is None or got <= fill_once
    assert -(-65 // _C.attn_split_chunk([8], [65], 264)) == 9
    chunk = _C.attn_split_chunk([8] * 5, [64] * 5, 264)
    assert -(-64 // chunk) == 2, chunk  # split, one wave
    assert _split_score([8] * 5, [64] * 5, 10, 264) > _split_score([8] * 5, [64] * 5, chunk, 264)
    assert _C.attn_split_chunk([8] * 5 + [0], [64] * 5 + [10 ** 5], 264) == chunk
    assert _C.attn_split_chunk([8] * 40, [64] * 40, 264) == NO_SPLIT


# --------------------------------------------------------------------------------------------
# bad inputs: through the door (OpError naming the argument) and at the binding

def _raises(fn, *words):
    with pytest.raises(ops.OpError) as e:
        fn()
    for w in words:
        assert w in str(e.value), f"{w!r} not in {str(e.value)!r}"


def test_bad_inputs_markov():
    kw = oc.markov_inputs(oc.MarkovCase(2, 3, 40, "gated", conf="plain"))
    run = lambda **ch: _markov({**kw, **ch}, "cpp")
    _raises(lambda: run(logits=kw["logits"].half()), "dtype", "float16")
    _raises(lambda: run(hidden=kw["hidden"][:, :2]), "hidden", "shape")
    _raises(lambda: run(anchor=torch.tensor([0, 40])), "anchor")
    _raises(lambda: run(gate_w=kw["gate_w"][:, 1:]), "gate_w")
    _raises(lambda: run(temperature=kw["temperature"].double()), "temperature")
    _raises(lambda: run(seed=kw["seed"][:1]), "seed")


def test_bad_out_markov():
    """markov_sample's out: named when it has the wrong shape, device layout or overlaps U; U in
    a dtype that is neither out's nor the weights' is named; out=logits is in place."""
    kw = _bf16_weights(oc.markov_inputs(oc.MarkovCase(2, 3, 40, "vanilla")))
    U = kw.pop("logits")
    args = (kw.pop("hidden"), kw.pop("anchor"), kw.pop("head"))
    run = lambda u, out: ops.markov_sample(u, *args, out=out, **_clone(kw))
    _raises(lambda: run(U, torch.empty(2, 3, 41)), "out", "shape")
    _raises(lambda: run(U, torch.empty(2, 40, 3).transpose(1, 2)), "out", "contiguous")
    flat = torch.zeros(280)
    flat[:240] = U.float().view(-1)
    _raises(lambda: run(flat[:240].view(2, 3, 40), flat[40:].view(2, 3, 40)), "out", "overlap")
    _raises(lambda: run(U.half(), torch.empty(2, 3, 40)), "logits", "float16", "bfloat16")
    _raises(lambda: run(U.double(), torch.empty(2, 3, 40)), "logits", "float64")
    f16 = {k: v.half() if k in WEIGHTS and v is not None else v for k, v in kw.items()}
    _raises(lambda: ops.markov_sample(U.half(), args[0].half(), *args[1:], backend="cpp",
                                      out=torch.empty(2, 3, 40, dtype=torch.float16), **f16),
            "out dtype", "float16", "cpp")
    z = U.clone()
    want = ops.markov_sample(z, *args, **_clone(kw))
    inplace = U.clone()
    got = run(inplace, inplace)
    assert torch.equal(inplace, z) and all(torch.equal(a, b) for a, b in zip(want, got))


def test_bad_weight_dtypes_markov():
    """Hidden sets the weight dtype; a head weight of another dtype is named."""
    kw = _bf16_weights(oc.markov_inputs(oc.MarkovCase(2, 3, 40, "gated", conf="markov")))
    run = lambda backend=None, **ch: _markov({**kw, **ch}, backend)
    for name in ("w1", "w2", "gate_w", "gate_b", "conf_w", "conf_b"):
        _raises(lambda: run(**{name: kw[name].float()}), name, "bfloat16", "float32")
    _raises(lambda: run(hidden=kw["hidden"].double()), "hidden", "float64", "float32 logits")
    f16 = {k: v.half() if k in WEIGHTS and v is not None else v for k, v in kw.items()}
    _raises(lambda: _markov(f16, "cpp"), "cpp", "float16")  # the C++ kernel widens bf16 only
    assert torch.equal(_markov(f16, None)[1], _markov(f16, "reference")[1])  # default: reference


def test_markov_backend_takes_the_dtype_pair(monkeypatch):
    monkeypatch.setattr(ops.door, "available_backends", lambda: ["reference", "cpp", "cuda"])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert ops.markov._markov_backend(cpu, None, f32, "vanilla", bf16) == "cpp"
    assert ops.markov._markov_backend(cpu, None, f32, "vanilla", f16) == "reference"
    assert ops.markov._markov_backend(cpu, None, torch.float64, "vanilla", bf16) == "reference"
    for wdt in (f32, bf16, f16):
        assert ops.markov._markov_backend(cuda, None, f32, "gated", wdt) == "cuda"
    assert ops.markov._markov_backend(cuda, None, bf16, "gated", bf16) == "cuda"


def test_bad_inputs_coupled():
    mk = oc.markov_inputs(oc.MarkovCase(2, 3, 40, "vanilla"))
    _raises(lambda: _markov({**mk, "coupled": torch.ones(3, dtype=torch.bool)}, "cpp"), "coupled", "shape")
    rj = oc.rejection_inputs(oc.RejectionCase(3, 4, 30, "full"))
    _raises(lambda: _rejection({**rj, "coupled": torch.ones(3, dtype=torch.int64)}, "cpp"), "coupled")


def test_rejection_coupled_plain_step():
    """No drafts (plain decoding): a coupled row emits argmax(row / T + g_{n0+1}), the noise of
    output index n0 + 1 (round n0 + 1, purpose coupled, position 0), on both backends."""
    kw = oc.rejection_inputs(oc.RejectionCase(6, 0, 300, "zero", "sampled", coupled="all"))
    for backend in ("cpp", "reference"):
        _, out, _ = _rejection(kw, backend)
        for r in range(6):
            g = philox.gumbel(kw["seed"][r], kw["stream"][r], kw["round_"][r] + 1,
                              philox.PURPOSE_COUPLED, 0, torch.arange(300))
            row = kw["target_logits"][r].double() / float(kw["temperature"][r])
            assert int(out[r, 0]) == int((row + g).argmax()), (backend, r)


# --------------------------------------------------------------------------------------------
# the rnn head on CUDA tensors: the door routes it to the reference (no CUDA kernel)

def test_rnn_on_cuda_routes_to_reference(monkeypatch):
    """The backend choice alone (no GPU needed): pretend this build has the CUDA kernels."""
    monkeypatch.setattr(ops.door, "available_backends", lambda: ["reference", "cpp", "cuda"])
    cuda, cpu, f32 = torch.device("cuda"), torch.device("cpu"), torch.float32
    assert ops.markov._markov_backend(cuda, None, f32, "rnn") == "reference"
    assert ops.markov._markov_backend(cuda, None, torch.bfloat16, "rnn") == "reference"
    for head in ("none", "vanilla", "gated"):
        assert ops.markov._markov_backend(cuda, None, f32, head) == "cuda"
    assert ops.markov._markov_backend(cuda, "cuda", f32, "rnn") == "cuda"  # explicit: the kernel refuses
    assert ops.markov._markov_backend(cpu, None, f32, "rnn") == "cpp"


def test_rnn_decode_on_cpp(tiny_target, tiny_drafters, monkeypatch):
    """A whole CPU decode with the rnn head drafts on the C++ kernel and equals greedy AR
    (float64, as in test_greedy_equality.py)."""
    from dspark_rt import Decoder, SamplingParams
    calls = []
    real = ops.door.run
    monkeypatch.setattr(ops.door, "run", lambda name, p, be, dev: (calls.append((name, be)),
                                                                  real(name, p, be, dev)))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [3, 17, 42]]
    spec = Decoder.from_pretrained(tiny_target, tiny_drafters("rnn", 4), mode="dspark",
                                   dtype="float64").generate(prompts, params, use_tqdm=False)
    assert ("markov_sample", "cpp") in calls
    ar = Decoder.from_pretrained(tiny_target, mode="ar", dtype="float64").generate(
        prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in ar]
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0


def test_bad_inputs_rejection():
    kw = oc.rejection_inputs(oc.RejectionCase(3, 4, 30, "full"))
    run = lambda **ch: _rejection({**kw, **ch}, "cpp")
    _raises(lambda: run(draft_tokens=kw["draft_tokens"] + 30), "draft_tokens")
    _raises(lambda: run(cu_rows=torch.tensor([0, 5, 9, 15], dtype=torch.int32)), "cu_rows")
    _raises(lambda: run(cu_rows=kw["cu_rows"].long()), "cu_rows")
    _raises(lambda: run(draft_lse=kw["draft_lse"].double()), "draft_lse")
    _raises(lambda: run(draft_logits=kw["draft_logits"][:, :2]), "draft_logits")
    _raises(lambda: run(target_logits=kw["target_logits"].half()), "dtype", "float16")
    _raises(lambda: run(draft_logits=kw["draft_logits"].half()), "draft_logits", "float16")
    _raises(lambda: run(target_logits=kw["target_logits"].bfloat16(),
                        draft_logits=kw["draft_logits"].double()), "draft_logits", "float64")
    _raises(lambda: run(target_logits=kw["target_logits"].int()), "target_logits", "int32")


def test_bad_inputs_attention_and_topk():
    kw = oc.attention_inputs(oc.AttentionCase((3, 2), (20, 5), 6, 2, 16, 8))
    run = lambda **ch: _attention({**kw, **ch}, "cpp")
    bt = kw["block_tables"].clone()
    bt[0, 0] = 10_000
    _raises(lambda: run(block_tables=bt), "block_tables")
    _raises(lambda: run(cu_q=torch.tensor([0, 6, 5], dtype=torch.int32)), "cu_q")
    _raises(lambda: run(kv_lens=torch.tensor([2, 7], dtype=torch.int32)), "kv_lens")
    _raises(lambda: run(k_cache=kw["k_cache"][..., :8]), "k_cache")
    _raises(lambda: run(q=kw["q"][:, :5]), "h_q")
    _raises(lambda: ops.prefix_topk(torch.rand(3, 4).double(), 2), "survival")
    _raises(lambda: ops.prefix_topk(torch.rand(3, 4), -1), "K")


def test_binding_errors():
    from dspark_rt import _C
    info = _C.build_info()
    assert {"version", "cuda", "cuda_archs", "cuda_version", "compiler", "openmp"} <= set(info)
    p = _C.MarkovSampleParams()
    with pytest.raises(ValueError, match="head"):
        p.head = 5
    with pytest.raises(ValueError, match="dtype"):
        p.dtype = -1
    p.R, p.gamma, p.V = 1, 1, 10  # every pointer null: the launcher refuses, nothing crashes
    with pytest.raises(ValueError, match="markov_sample.*bad argument"):
        _C.markov_sample(p, "cpp", 0)
    q = _C.PrefixTopkParams()
    with pytest.raises(ValueError, match="backend"):
        _C.prefix_topk(q, "tpu", 0)
    if not info["cuda"]:
        with pytest.raises(RuntimeError, match="prefix_topk: this build has no CUDA kernels"):
            _C.prefix_topk(q, "cuda", 0)
    a = _C.VerifyAttentionParams()
    a.R, a.dtype = 1, 3  # bfloat16, and no cu_q: refused, nothing read
    with pytest.raises(ValueError, match="verify_attention.*bad argument"):
        _C.verify_attention(a, "cpp", 0)
    lin = _C.LinearParams()
    lin.M, lin.N, lin.K, lin.ldx, lin.ldw, lin.ldo = 2, 3, 4, 4, 4, 3  # null pointers
    with pytest.raises(ValueError, match="linear.*bad argument"):
        _C.linear(lin, "cpp", 0)
    t = torch.zeros(4)
    a.q = t.data_ptr()
    assert a.q == t.data_ptr()


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_rejection_padding_rows_belong_to_no_request(backend):
    """Rows past cu_rows[R] (an async verify batch's padding) are never read: NaN there changes
    nothing, on fresh random inputs."""
    for key in range(3):
        kw = oc.rejection_inputs(oc.RejectionCase(5, 4, 40), key=key)
        want = _rejection(kw, backend)
        pad = torch.full((3, 40), float("nan"), dtype=kw["target_logits"].dtype)
        got = _rejection({**kw, "target_logits": torch.cat([kw["target_logits"], pad])}, backend)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), key


def test_door_edge_cases():
    """Inputs a careless caller sends: each is an OpError naming the argument (not a binding
    'bad argument', a raw pybind TypeError, a ZeroDivisionError or silent inf), or, for a K
    beyond every candidate, the same result as admitting every candidate."""
    kw = oc.markov_inputs(oc.MarkovCase(2, 3, 40, "vanilla"))
    run = lambda **ch: _markov({**kw, **ch}, "cpp")
    _raises(lambda: run(w1=kw["w1"][:, :0], w2=kw["w2"][:, :0]), "w1", "rank")
    _raises(lambda: run(logits=kw["logits"][..., :0], w1=kw["w1"][:0], w2=kw["w2"][:0]), "logits", "V")
    for bad in (float("inf"), float("nan"), -1.0):
        t = kw["temperature"].clone()
        t[0] = bad
        _raises(lambda: run(temperature=t), "temperature")
    rk = oc.rejection_inputs(oc.RejectionCase(3, 4, 30, "full"))
    t = rk["temperature"].clone()
    t[1] = float("inf")
    _raises(lambda: _rejection({**rk, "temperature": t}, "cpp"), "temperature")
    at = oc.attention_inputs(oc.AttentionCase((3, 2), (20, 5), 6, 2, 16, 8))
    _raises(lambda: _attention({**at, "q": at["q"][..., :0]}, "cpp"), "head_dim")
    surv = torch.rand(3, 4)
    assert torch.equal(ops.prefix_topk(surv, 2 ** 63), ops.prefix_topk(surv, 12))
    _raises(lambda: ops.prefix_topk(surv, True), "K")


def test_selector_top_k_must_fit_the_vocabulary():
    """top_k outside [1, V] is an error naming it (never clamped), as is top_k with another head."""
    kw = oc.markov_inputs(oc.MarkovCase(2, 3, 37, "selector", rank=8, d=16, top_k=5))
    for bad in (0, 38, 2.0, None):
        with pytest.raises(ops.OpError, match="top_k"):
            _markov({**kw, "top_k": bad}, "cpp")
    with pytest.raises(ops.OpError, match="top_k is only for head 'selector'"):
        _markov({**oc.markov_inputs(oc.MarkovCase(2, 3, 37, "vanilla", rank=8, d=16)), "top_k": 5}, "cpp")
