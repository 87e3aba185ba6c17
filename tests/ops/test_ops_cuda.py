"""The CUDA backend against the PyTorch reference (run on the same GPU, in the same dtype) and,
for float32, against the C++ backend on CPU copies of the same inputs. Inputs come from
dspark_rt/testing/op_cases.py (fresh every run; DSPARK_TEST_SEED reproduces), plus GPU-sized cases that
reach the tensor-core paths, several request groups, split-KV and 32k contexts.

Tolerances are in units of the dtype: EPS below is its relative spacing (2^-23 float32, 2^-10
float16, 2^-7 bfloat16 as an upper bound; one rounding moves a value by at most EPS/2 of it),
argued next to each check. Integer outputs are exact, with one documented exception: a drafted
token is the argmax of double scores built from z, and z itself may differ by a rounding between
backends (the bias is summed in another order), so where the two best scores of a step lie within
that z difference of each other the backends may pick different tokens. The check then proves
the tie (the CUDA token's reference score is within the z discrepancy of the best) and stops
comparing that request, whose later steps legitimately differ.
"""
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from dspark_rt import ops
from dspark_rt.ops import philox, reference

from dspark_rt.testing import op_cases as oc


def _cuda_ready():
    return torch.cuda.is_available() and "cuda" in ops.available_backends()


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda_ready(), reason="needs a GPU and a CUDA build of _C")]
DEV = "cuda"
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [F32, BF16, F16]
EPS = {F32: 2.0 ** -23, F16: 2.0 ** -10, BF16: 2.0 ** -7}


@pytest.fixture(autouse=True)
def _exact_reference_matmuls():
    """The reference's matmuls must accumulate in float32 (no TF32, no reduced-precision split-K
    reductions), or its own error would exceed the tolerances argued here."""
    m = torch.backends.cuda.matmul
    saved = (m.allow_tf32, m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction)
    m.allow_tf32 = m.allow_fp16_reduced_precision_reduction = m.allow_bf16_reduced_precision_reduction = False
    yield
    m.allow_tf32, m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = saved


def _has_cpp():
    return "cpp" in ops.available_backends()


def _cpu(kw):
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


# ---- markov_sample ----------------------------------------------------------------------------
MC = oc.MarkovCase
MARKOV_CASES = oc.MARKOV_CASES + [
    MC(6, 5, 32768, "vanilla", rank=256, d=128, conf="markov"),          # tensor cores (16-bit)
    MC(9, 4, 7001, "gated", rank=128, d=64, conf="plain", temps="greedy"),
    MC(70, 2, 3000, "vanilla", rank=32, d=32, temps="sampled"),         # two request groups
    MC(4, 3, 2048, "gated", rank=40, d=24, conf="markov"),              # rank % 32: CUDA cores
    MC(8, 5, 32768, "vanilla", rank=256, d=128, coupled="mixed"),       # coupled, tensor cores
    MC(70, 2, 3000, "gated", rank=32, d=32, temps="sampled", coupled="mixed"),  # two groups
    # three groups (44, 44, 43) in one sweep launch per step; tensor cores with 16-bit weights,
    # 4-wide logits rows
    MC(131, 3, 4100, "vanilla", rank=64, d=32, conf="markov", temps="mixed", coupled="mixed"),
    MC(5, 4, 3000, "rnn", rank=32, d=48, conf="markov"),                # routed to the reference
]


def _markov_inputs(case, dtype, key=0):
    kw = oc.markov_inputs(case, DEV, dtype, key=key)
    if case.V >= 2048:  # a masked vocabulary tail: -inf logits never win and add nothing to lse
        kw["logits"][..., -37:] = -math.inf
    return kw


def _markov(kw, backend):
    kw = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    z = kw.pop("logits")
    args = (z, kw.pop("hidden"), kw.pop("anchor"), kw.pop("head"))
    if backend == "reference":
        keys = ("w1", "w2", "gate_w", "gate_b", "joint_w", "joint_b", "conf_w", "conf_b",
                "temperature", "seed", "stream", "round_", "coupled", "top_k")
        out = reference.markov_sample(*args, *(kw.get(k) for k in keys))
    else:
        out = ops.markov_sample(*args, backend=backend, **kw)
    return (z, *out)


def _check_markov(case, dtype, kw, ref, got, where):
    z_r, tok_r, lp_r, lse_r, cf_r = (t.to(DEV) for t in ref)
    z_g, tok_g, lp_g, lse_g, cf_g = (t.to(DEV) for t in got)
    assert torch.equal(z_r.isnan(), z_g.isnan()) and torch.equal(z_r.isinf(), z_g.isinf()), where
    # z = round(U + round(bias)): the bias is a float32 sum in another order (~1e-6 relative), its
    # rounding to the dtype may land one step apart (EPS |bias|), then so may the sum's (EPS |z|).
    u = kw["logits"].double()
    fin = torch.isfinite(z_r)
    zr = z_r.double().where(fin, 0.0)
    bias = (zr - u.where(fin, 0.0)).abs()
    dz_all = (zr - z_g.double().where(fin, 0.0)).abs()
    bound = EPS[dtype] * (zr.abs() + bias) + 1e-5 * (1 + bias)
    wdt = kw["hidden"].dtype  # the weight dtype: dtype, or 16-bit under float32 logits
    if case.head == "gated" and wdt in (F16, BF16):
        # the gate's 16-bit roundings (pre-activation, sigmoid, g * e; with float32 logits only
        # the rounding of g * e to the weight dtype) may each land one step apart; a step in
        # (g * e)_j moves bias_v by EPS |w2[v, j]| |e_j| at most (|g| <= 1): allow two steps of
        # every component
        prev = torch.cat([kw["anchor"][:, None], tok_r[:, :-1]], 1)
        e = kw["w1"][prev].double().abs()
        bound = bound + 2 * EPS[wdt] * (e @ kw["w2"].double().abs().T)
    if case.head == "selector" and wdt in (F16, BF16):
        # u = (gate_w h) * e rounded to the weight dtype: the same one-step argument, with |g|
        # from the gate's own product
        prev = torch.cat([kw["anchor"][:, None], tok_r[:, :-1]], 1)
        g = (kw["hidden"].double() @ kw["gate_w"].double().T).abs()
        e = kw["w1"][prev].double().abs() * g
        bound = bound + 2 * EPS[wdt] * (e @ kw["w2"].double().abs().T)
    bad = dz_all > bound
    assert not bad.any(), f"z off by {float((dz_all - bound).max())} beyond tolerance: {where}"
    dz = dz_all.amax(-1).cpu()  # per step: how far the two z rows are apart
    temps = kw["temperature"].double().cpu()
    tok_r, tok_g, lp_r, lp_g = tok_r.cpu(), tok_g.cpu(), lp_r.cpu(), lp_g.cpu()
    lse_r, lse_g, cf_r, cf_g = lse_r.cpu(), lse_g.cpu(), cf_r.cpu(), cf_g.cpu()
    for r in range(case.R):
        t = float(temps[r])
        ts = t if t > 0 else 1.0
        for k in range(case.gamma):
            # lse is smooth in z / T: its error is the z error / T plus a float32 sum over V terms.
            tol = float(dz[r, k]) / ts + 4e-6 * max(1.0, abs(float(lse_r[r, k])))
            assert abs(float(lse_g[r, k]) - float(lse_r[r, k])) <= tol, f"lse[{r},{k}]: {where}"
            # conf = round(round(dot) + b): two roundings of the dtype plus a float32 dot.
            ctol = 2 * EPS[dtype] * (abs(float(cf_r[r, k])) + 1.0) + 1e-5
            assert abs(float(cf_g[r, k]) - float(cf_r[r, k])) <= ctol, f"conf[{r},{k}]: {where}"
            if tok_g[r, k] == tok_r[r, k]:
                assert abs(float(lp_g[r, k]) - float(lp_r[r, k])) <= 2 * tol, f"logprob[{r},{k}]: {where}"
                continue
            s = z_r[r, k].double().nan_to_num(nan=-math.inf)
            if t > 0:
                coupled = "coupled" in kw and bool(kw["coupled"][r])
                rnd, purpose, pos = philox.site(kw["round_"][r], coupled, philox.PURPOSE_DRAFT, k + 1)
                s = s / t + philox.gumbel(kw["seed"][r], kw["stream"][r], rnd, purpose, pos,
                                          torch.arange(case.V, device=DEV))
            gap = float(s.max() - s[int(tok_g[r, k])])
            assert gap <= 2 * float(dz[r, k]) / ts + 1e-12, \
                f"request {r} step {k}: token {int(tok_g[r, k])} is {gap:.3g} below the best, no tie: {where}"
            break  # later steps follow the other (tied) token


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MARKOV_CASES, ids=str)
def test_markov_sample(case, dtype):
    kw = _markov_inputs(case, dtype)
    where = oc.where(case)
    # The rnn head has no CUDA kernel: the door's default (backend None) routes it to the
    # reference on the GPU, which is what the runtime runs.
    got = _markov(kw, None if case.head == "rnn" else "cuda")
    _check_markov(case, dtype, kw, _markov(kw, "reference"), got, where)
    if dtype == F32 and _has_cpp():
        _check_markov(case, dtype, kw, _markov(_cpu(kw), "cpp"), got, where + " (vs cpp)")


WEIGHT_KEYS = ("hidden", "w1", "w2", "gate_w", "gate_b", "joint_w", "joint_b", "conf_w", "conf_b")


@pytest.mark.parametrize("wdt", [BF16, F16], ids=str)
@pytest.mark.parametrize("case", MARKOV_CASES, ids=str)
def test_markov_sample_16bit_weights(case, wdt):
    """The served configuration of a 16-bit model: 16-bit hidden and head weights (W2 through
    tensor cores where rank % 32 == 0), float32 logits; against the reference of the same
    dtypes and, for bf16, the C++ kernel."""
    kw = {k: v.to(wdt) if k in WEIGHT_KEYS and v is not None else v
          for k, v in _markov_inputs(case, F32).items()}
    where = oc.where(case) + f" weights {wdt}"
    got = _markov(kw, None if case.head == "rnn" else "cuda")
    _check_markov(case, F32, kw, _markov(kw, "reference"), got, where)
    if wdt == BF16 and _has_cpp():
        _check_markov(case, F32, kw, _markov(_cpu(kw), "cpp"), got, where + " (vs cpp)")


@pytest.mark.parametrize("case", MARKOV_CASES, ids=str)
def test_markov_sample_out_of_place(case):
    """U read from its own tensor and z written to out (the served bf16 path: the LM head's U as
    it is, no cast pass): every output bit-equal to the in-place run on U widened first, U kept;
    float32 U into a float32 out likewise."""
    for wdt in (BF16, F32):
        kw = _markov_inputs(case, F32)
        if wdt == BF16:
            kw = {k: v.to(wdt) if k in WEIGHT_KEYS and v is not None else v for k, v in kw.items()}
        U = kw["logits"].to(wdt)
        kw["logits"] = U.float()
        want = _markov(kw, None if case.head == "rnn" else "cuda")
        kept, run = U.clone(), {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        run.pop("logits")
        z = torch.full(U.shape, math.nan, device=DEV)
        got = ops.markov_sample(U, run.pop("hidden"), run.pop("anchor"), run.pop("head"), out=z,
                                backend=None if case.head == "rnn" else "cuda", **run)
        for a, b in zip(want, (z, *got)):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()), \
                oc.where(case) + f" U {wdt}"
        assert torch.equal(U, kept), oc.where(case)


@pytest.mark.parametrize("case", [MC(1, 7, 32768, "vanilla", rank=256, d=128, conf="markov"),
                                  MC(70, 3, 3000, "gated", rank=32, d=32, temps="sampled"),
                                  MC(131, 3, 4100, "vanilla", rank=64, d=32, temps="mixed")], ids=str)
def test_markov_sample_dependent_launches_change_nothing(case, monkeypatch):
    """The per-step kernels as programmatic dependent launches (sm_90+: each waits for its
    predecessor inside the kernel) give bit for bit the plain launches' outputs."""
    kw = {k: v.to(BF16) if k in WEIGHT_KEYS and v is not None else v
          for k, v in _markov_inputs(case, F32).items()}
    runs = []
    for pdl in ("0", "1"):
        monkeypatch.setenv("DSPARK_CUDA_PDL", pdl)
        runs.append(_markov(kw, "cuda"))
    for a, b in zip(*runs):
        assert torch.equal(a, b), oc.where(case)


def _misaligned(t):
    """t's values in a fresh buffer whose data starts one element past an allocation boundary
    (allocations are 256-byte aligned): no row start is 16-byte aligned for 16-bit types, nor
    for float32, so the kernels take their 4-element / scalar loads."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("case", [
    # R = 1: the head projection's one tile split over a whole block (d = 4096: 4 slabs a
    # warp), the confidence row alone and with the gate's 256 rows; the epilogue's 8 warps on
    # one request's chunks
    MC(1, 7, 151936, "vanilla", rank=256, d=4096, conf="markov", temps="sampled"),
    MC(1, 7, 32768, "gated", rank=256, d=4096, conf="plain", temps="greedy"),
    MC(1, 4, 5003, "gated", rank=64, d=4099, conf="markov", temps="sampled"),  # d % 4: scalar
    # 2 and 3 requests: two, one slot a request (8 // 3 = 2 warps each, two idle)
    MC(2, 3, 32768, "vanilla", rank=256, d=256, conf="markov", temps="mixed"),
    MC(3, 3, 4100, "gated", rank=64, d=64, conf="markov", temps="mixed", coupled="mixed"),
], ids=str)
def test_markov_sample_small_batches(case):
    """Small batches: the served 16-bit weights under float32 logits against the reference."""
    kw = {k: v.to(BF16) if k in WEIGHT_KEYS and v is not None else v
          for k, v in _markov_inputs(case, F32).items()}
    _check_markov(case, F32, kw, _markov(kw, "reference"), _markov(kw, "cuda"), oc.where(case))


@pytest.mark.parametrize("case", [MC(3, 3, 4100, "vanilla", rank=64, d=32, conf="markov", temps="mixed"),
                                  MC(2, 2, 5003, "gated", rank=32, d=24, temps="sampled")], ids=str)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_markov_sample_misaligned_logits(case, dtype):
    """Logits one element into their buffer (and V not a multiple of the vector width): the
    scalar paths give every output bit for bit as the aligned run."""
    kw = _markov_inputs(case, dtype)
    want = _markov(kw, "cuda")
    run = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    z = _misaligned(run.pop("logits"))  # not through _markov, whose clone would align it again
    assert z.data_ptr() % 16 != 0
    got = (z, *ops.markov_sample(z, run.pop("hidden"), run.pop("anchor"), run.pop("head"), backend="cuda", **run))
    for a, b in zip(want, got):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()), oc.where(case)


def test_markov_rnn_kernel_refuses():
    """An explicit backend="cuda" reaches the kernel, which has no rnn path and says so."""
    kw = _markov_inputs(oc.MarkovCase(2, 3, 100, "rnn", rank=8, d=16), F32)
    with pytest.raises(RuntimeError, match="unsupported"):
        _markov(kw, "cuda")


# ---- rejection_sample -------------------------------------------------------------------------
RC = oc.RejectionCase
REJECTION_CASES = oc.REJECTION_CASES + [
    RC(16, 7, 32000, "random", "sampled"), RC(8, 4, 20000, "random", "greedy"),
    RC(40, 3, 18992, "full", "mixed"), RC(3, 5, 151936, "random", "mixed"),
    RC(12, 7, 32000, "random", "mixed", coupled="mixed"), RC(3, 5, 151936, "full", "sampled", coupled="all"),
]


def _rejection(kw, backend):
    args = [kw[k] for k in ("target_logits", "cu_rows", "draft_tokens", "draft_logits", "draft_lse")]
    keys = {k: kw.get(k) for k in ("temperature", "seed", "stream", "round_", "coupled")}
    if backend == "reference":
        return reference.rejection_sample(*args, *keys.values())
    return ops.rejection_sample(*args, backend=backend, **keys)


@pytest.mark.gpu
def test_rejection_padding_rows_belong_to_no_request():
    """Rows past cu_rows[R] (an async verify batch's padding) are never read by the kernel."""
    kw = oc.rejection_inputs(oc.RejectionCase(5, 4, 40), DEV, F32, key=1)
    want = _rejection(kw, "cuda")
    pad = torch.full((3, 40), float("nan"), dtype=F32, device=DEV)
    got = _rejection({**kw, "target_logits": torch.cat([kw["target_logits"], pad])}, "cuda")
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(want, got))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", REJECTION_CASES, ids=str)
def test_rejection_sample(case, dtype):
    # Exact: the acceptance tests (u q < P) and the Gumbel argmaxes are decided in float64 on
    # both sides. Only inputs within ~1e-6 relative of a decision boundary could differ (the CUDA
    # lse sums float32 exponentials in float64), which random inputs essentially never produce.
    for key in range(2):
        kw = oc.rejection_inputs(case, DEV, dtype, key=key)
        where = oc.where(case, key)
        acc, out, failed = _rejection(kw, "cuda")
        racc, rout, rfailed = _rejection(kw, "reference")
        assert torch.equal(acc.cpu(), racc.cpu()), (acc, racc, where)
        assert torch.equal(out.cpu(), rout.cpu()), (out, rout, where)
        assert not failed.any() and not rfailed.any(), where
        if dtype == F32 and _has_cpp():
            cacc, cout, _ = _rejection(_cpu(kw), "cpp")
            assert torch.equal(cacc, acc.cpu()) and torch.equal(cout, out.cpu()), where


@pytest.mark.parametrize("case", [RC(5, 4, 8200, "random", "mixed"),  # a chunk tail not a multiple of 8
                                  RC(3, 5, 151936, "full", "sampled", coupled="mixed"),
                                  RC(4, 3, 20003, "random", "greedy"),
                                  RC(6, 6, 16384, "random", "mixed", "random")], ids=str)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_rejection_misaligned_rows(case, dtype):
    """Target or draft rows whose starts are not 16-byte aligned (one element into their
    buffer) take the narrow loads; V = 20003 has no 16-byte rows at all.
    Tokens and failed flags equal the aligned run's and the reference's."""
    kw = oc.rejection_inputs(case, DEV, dtype, key=3)
    want, ref = _rejection(kw, "cuda"), _rejection(kw, "reference")
    for a, b in zip(want, ref):
        assert torch.equal(a.cpu(), b.cpu()), oc.where(case, 3)
    for name in ("target_logits", "draft_logits"):
        got = _rejection({**kw, name: _misaligned(kw[name])}, "cuda")
        for a, b in zip(want, got):
            assert torch.equal(a.cpu(), b.cpu()), (name, oc.where(case, 3))


@pytest.mark.parametrize("case, dtype", [(c, torch.bfloat16) for c in REJECTION_CASES] +
                         [(c, torch.float16) for c in REJECTION_CASES if c.V <= 5003], ids=str)
def test_rejection_16bit_target_logits(case, dtype):
    """A 16-bit model's verify logits as they are, under float32 drafts: widened on load, the
    tokens are those of the widened copy and of the reference, exactly (one key: the lease's
    test budget; test_ops_cpu runs the C++ twin on three)."""
    for key in range(1):
        kw = oc.rejection_inputs(case, DEV, F32, key=key)
        half = {**kw, "target_logits": kw["target_logits"].to(dtype)}
        wide = {**kw, "target_logits": half["target_logits"].float()}
        got, cast, ref = _rejection(half, "cuda"), _rejection(wide, "cuda"), _rejection(half, "reference")
        for a, b, c in zip(got, cast, ref):
            assert torch.equal(a.cpu(), b.cpu()) and torch.equal(a.cpu(), c.cpu()), oc.where(case, key)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [RC(9, 3, 20000, "random", "mixed", "random", coupled="mixed"),
                                  RC(6, 7, 40000, "full", "sampled"), RC(5, 0, 9000, "zero", "greedy")],
                         ids=str)
def test_rejection_failed_rows(case, dtype):
    """failed[r] (NaN or +inf in one of r's rows; -inf is a masked entry) comes out of the row
    pass, over every chunk of a row; rows past cu_rows[R] belong to no request."""
    import random
    fails = oks = 0
    for key in range(2):
        kw = oc.rejection_inputs(case, DEV, F32, key=key)
        t = torch.cat([kw["target_logits"], torch.zeros(2, case.V, device=DEV)]).to(dtype)
        cu, rng = kw["cu_rows"].tolist(), random.Random(key)
        want = [False] * case.R
        for i in range(t.shape[0]):
            if rng.random() < 0.35:
                v = rng.choice([math.nan, math.inf, -math.inf])
                t[i, rng.randrange(case.V)] = v
                r = next((r for r in range(case.R) if cu[r] <= i < cu[r + 1]), None)
                if r is not None and v != -math.inf:
                    want[r] = True
        kw["target_logits"] = t
        fails, oks = fails + sum(want), oks + want.count(False)
        for backend in ("cuda", "reference"):
            failed = _rejection(kw, backend)[2]
            assert failed.cpu().tolist() == want, (backend, oc.where(case, key))
    assert fails and oks


@pytest.mark.parametrize("case", [c for c in REJECTION_CASES if c.drafts == "shifted"], ids=str)
def test_rejection_cold_residual(case):
    """T = 0.01-0.03 with the draft's maximum far above the target's: residuals of 1e-4 P that
    the float pre-filter must not prune (its exponents are differences of terms in the
    thousands). More keys than test_rejection_sample: emulated in float32, the old flat 1e-4
    margin lost the reference's token in about one residual sweep in ten."""
    for key in range(2, 14):
        kw = oc.rejection_inputs(case, DEV, F32, key=key)
        acc, out, _ = _rejection(kw, "cuda")
        racc, rout, _ = _rejection(kw, "reference")
        assert torch.equal(acc.cpu(), racc.cpu()) and torch.equal(out.cpu(), rout.cpu()), oc.where(case, key)


def test_posinf_logits():
    """A +inf logit: markov_sample's lse is +inf (torch.logsumexp), never NaN, its logprob NaN;
    rejection_sample emits the reference's tokens."""
    kw = _markov_inputs(MC(4, 3, 3000, "none", temps="mixed"), F32)
    kw["logits"][1, 0, 7] = kw["logits"][2, 2, 2500] = kw["logits"][3, 1, 0] = math.inf
    ref, got = _markov(kw, "reference"), _markov(kw, "cuda")
    assert torch.equal(got[1].cpu(), ref[1].cpu())
    for i in (2, 3):  # logprob, lse
        assert torch.equal(got[i].isnan().cpu(), ref[i].isnan().cpu()), i
        assert torch.equal(got[i].isposinf().cpu(), ref[i].isposinf().cpu()), i
    assert got[3][1, 0] == math.inf
    rk = oc.rejection_inputs(RC(9, 3, 20000, "random", "mixed", "random", coupled="mixed"), DEV, F32)
    rk["target_logits"][::2, 123] = math.inf
    rk["target_logits"][1::3, 19999] = math.inf
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(_rejection(rk, "cuda"), _rejection(rk, "reference")))


# ---- prefix_topk ------------------------------------------------------------------------------
PC = oc.PrefixTopkCase
PREFIX_TOPK_CASES = oc.PREFIX_TOPK_CASES + [PC(512, 8, "ties"), PC(3000, 5, "nan"), PC(1000, 7)]


@pytest.mark.parametrize("case", PREFIX_TOPK_CASES, ids=str)
def test_prefix_topk(case):
    survival, Ks = oc.prefix_topk_inputs(case)
    survival.view(-1)[:: 7] = -0.0  # signed zeros tie with +0.0
    for K in Ks:
        want = reference.prefix_topk(survival, K)
        got = ops.prefix_topk(survival.to(DEV), K, backend="cuda").cpu()
        assert torch.equal(got, want), (K, got, want, oc.where(case))


# ---- linear (row-invariant GEMM: DESIGN §6) -----------------------------------------------------
# (M, N, K): M spans decode (1, 7, 8, 9: around the 8/16-row edges) to prefill-sized (257, 300);
# N and K are tile-awkward (1, 17, 1000, 4099: not multiples of 16/32/128, odd K breaks 16-byte
# rows and takes the element-wise load path), plus K = 0 and multiples of every tile.
LINEAR_CASES = [(1, 1, 1), (1, 17, 4099), (7, 1000, 17), (8, 4099, 1000), (9, 17, 1000),
                (64, 1000, 4099), (257, 4099, 17), (300, 1, 4099), (1, 4096, 4096), (16, 4096, 4096),
                (64, 512, 1024), (257, 1000, 1000), (3, 5, 0), (33, 4099, 8), (5, 40000, 64)]


def _has_linear():
    return hasattr(ops, "linear")


def _linear_inputs(M, N, K, dtype, key=0):
    g = oc.generator(("linear", M, N, K), key)
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    w = torch.randn(N, K, generator=g, dtype=torch.float64) * max(K, 1) ** -0.5
    return x.to(DEV, dtype), w.to(DEV, dtype)


@pytest.mark.skipif(not _has_linear(), reason="ops.linear not in this tree yet")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K", LINEAR_CASES, ids=str)
def test_linear(M, N, K, dtype):
    x, w = _linear_inputs(M, N, K, dtype)
    got = ops.linear(x, w, backend="cuda")
    ref = ops.linear(x, w, backend="reference")
    assert got.dtype == dtype and got.shape == (M, N)
    # Both are float32 sums of the same K products (exact in float32 for 16-bit inputs; for
    # float32 each side rounds a product at most once, 2^-24 of it), rounded once to the dtype.
    # The sums differ by their order (cuBLAS blocks and splits, the kernel walks k in order): at
    # most (K + 1) 2^-24 sum_k |x_k w_k| each, so (2 K + 2) 2^-24 between them; the roundings of
    # two such sums may land one step apart (EPS |ref|, or float16's subnormal spacing 2^-24).
    mag = x.double().abs() @ w.double().abs().T
    floor = {F16: 2.0 ** -24, BF16: 2.0 ** -133, F32: 2.0 ** -149}[dtype]
    bound = EPS[dtype] * ref.double().abs() + (2 * K + 2) * 2.0 ** -24 * mag + floor
    err = (got.double() - ref.double()).abs()
    assert bool((err <= bound).all()), (M, N, K, dtype, float((err / bound).max()), oc.SEED)
    if K == 0:
        assert bool((got == 0).all())


@pytest.mark.skipif(not _has_linear(), reason="ops.linear not in this tree yet")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K", [(257, 1000, 4099), (64, 4099, 1000), (9, 17, 17), (300, 4096, 512),
                                   (40, 999, 64)], ids=str)
def test_linear_row_invariance(M, N, K, dtype):
    """A row's output is the same bits whatever rows share the call: all together, each row
    alone, random contiguous splits, a permutation, and the rows inside a batch of other rows."""
    x, w = _linear_inputs(M, N, K, dtype)
    full = ops.linear(x, w, backend="cuda")
    for i in range(M):  # x[i:i+1] is misaligned for odd K: the element-wise load path too
        assert torch.equal(ops.linear(x[i:i + 1], w, backend="cuda"), full[i:i + 1]), (i, M, N, K, dtype)
    g = oc.generator(("linear-split", M, N, K))
    for trial in range(4):
        cuts = sorted(torch.randperm(M - 1, generator=g)[:min(M - 1, 1 + trial * 3)].add(1).tolist())
        parts = [ops.linear(x[a:b], w, backend="cuda") for a, b in zip([0] + cuts, cuts + [M])]
        assert torch.equal(torch.cat(parts), full), (cuts, M, N, K, dtype)
    perm = torch.randperm(M, generator=g).to(DEV)
    assert torch.equal(ops.linear(x[perm], w, backend="cuda"), full[perm])
    others = torch.randn(37, K, generator=g).to(DEV, dtype)
    mixed = torch.cat([others[:20], x, others[20:]])
    assert torch.equal(ops.linear(mixed, w, backend="cuda")[20:20 + M], full)
    # a NaN row poisons its own outputs only
    poisoned = x.clone()
    poisoned[M // 2, K // 2] = math.nan
    got = ops.linear(poisoned, w, backend="cuda")
    keep = torch.arange(M, device=DEV) != M // 2
    assert got[M // 2].isnan().all() and torch.equal(got[keep], full[keep])


@pytest.mark.skipif(not _has_linear(), reason="ops.linear not in this tree yet")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_strided_rows_and_out(dtype):
    """Rows with a stride (a view of wider rows) and a caller's out give the contiguous bits."""
    M, N, K = 19, 300, 136
    x, w = _linear_inputs(M, N, K, dtype)
    want = ops.linear(x, w, backend="cuda")
    wide = torch.zeros(M, K + 9, dtype=dtype, device=DEV)
    wide[:, 3:3 + K] = x
    assert torch.equal(ops.linear(wide[:, 3:3 + K], w, backend="cuda"), want)
    out = torch.full((M, N), math.nan, dtype=dtype, device=DEV)
    res = ops.linear(x, w, out=out, backend="cuda")
    assert res.data_ptr() == out.data_ptr() and torch.equal(out, want)


# ---- verify_attention -------------------------------------------------------------------------
AC = oc.AttentionCase
ATTENTION_CASES = [(c, dt) for c in oc.ATTENTION_CASES for dt in DTYPES] + [
    (AC((1, 3, 0, 5), (16, 37, 9, 295), 8, 2, 128, 16), BF16),             # decode-like
    (AC((1, 3, 0, 5), (16, 37, 9, 295), 8, 2, 128, 16), F16),
    (AC((4, 2), (60, 63), 12, 4, 64, 7), BF16),                              # GQA 3, odd pages
    (AC((4, 2), (60, 63), 12, 4, 64, 7, causal=False), F16),
    (AC((2, 6, 1), (30, 26, 47), 4, 4, 128, 16), BF16),                      # group 1, page edges
    (AC((4, 1), (32764, 32768), 8, 1, 128, 64), BF16),                       # 32k: split-KV
    (AC((300,), (0,), 8, 2, 64, 32), BF16),                                  # prefill, 19 tiles
    (AC((8,) * 40, (4088,) * 40, 32, 8, 128, 16, extra_pages=0), BF16),     # fills the GPU
    (AC((8,) * 5, (4088,) * 5, 32, 8, 128, 16, extra_pages=0), BF16),       # 2 full waves of splits
    (AC((3, 7), (17, 63), 6, 2, 96, 16), BF16),                              # CUDA-core head_dim
    (AC((8, 3), (4000, 37), 8, 2, 128, 16, window=2048), BF16),              # window: split-KV
    (AC((16, 16), (8000, 5), 8, 2, 128, 64, causal=False, window=100), BF16),  # drafter block
    (AC((3, 7), (300, 63), 6, 2, 96, 16, window=33), F32),                   # window, CUDA cores
]


@pytest.mark.parametrize("case,dtype", ATTENTION_CASES, ids=lambda x: str(x))
def test_verify_attention(case, dtype):
    big = sum(case.ctx) * case.h_kv * case.head_dim > 2 ** 24
    kw = oc.attention_inputs(case, DEV, dtype, gen_device=DEV if big else "cpu")
    where = oc.where(case)
    args = [kw[k] for k in ("q", "cu_q", "k_cache", "v_cache", "block_tables", "kv_lens")]
    window = kw.get("window", 0)
    ref = reference.verify_attention(*args, kw["causal"], kw["scale"], window)
    got = ops.verify_attention(*args, causal=kw["causal"], scale=kw["scale"], window=window,
                               backend="cuda")
    assert not got.isnan().any(), where
    # out = sum_i p_i v_i / l: the tensor-core path rounds p to the dtype before P V (EPS/2
    # relative per term, so at most EPS/2 max|v|), rounds out once (EPS/2 |out|) and sums the
    # float32 softmax in another order (~1e-6). Twice that.
    vmax = float(kw["v_cache"].nan_to_num(0).abs().max())
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 * EPS[dtype],
                               atol=EPS[dtype] * vmax + 1e-5, msg=lambda m: f"{m}\n{where}")
    if dtype == F32 and _has_cpp():
        cpu = ops.verify_attention(*[a.cpu() for a in args], causal=kw["causal"], scale=kw["scale"],
                                   window=window, backend="cpp")
        torch.testing.assert_close(got.cpu(), cpu, rtol=1e-5, atol=1e-5 * vmax, msg=lambda m: f"{m}\n{where}")


def _attention_args(kw):
    return [kw[k] for k in ("q", "cu_q", "k_cache", "v_cache", "block_tables", "kv_lens")]


@pytest.mark.parametrize("case,dtype", ATTENTION_CASES, ids=lambda x: str(x))
def test_verify_attention_plan_reuse(case, dtype):
    """A plan made once (work partition and split partials) and reused by several calls gives
    bit for bit the result of per-call planning: same partition, same arithmetic."""
    big = sum(case.ctx) * case.h_kv * case.head_dim > 2 ** 24
    kw = oc.attention_inputs(case, DEV, dtype, gen_device=DEV if big else "cpu")
    args = _attention_args(kw)
    opts = dict(causal=kw["causal"], scale=kw["scale"], window=case.window)
    plan = ops.plan_verify_attention(kw["cu_q"], kw["kv_lens"], kw["block_tables"], kw["k_cache"],
                                     h_q=case.h_q, causal=case.causal, window=case.window)
    assert plan.backend == "cuda"
    want = ops.verify_attention(*args, **opts, backend="cuda")
    out = torch.empty_like(want)
    for _ in range(2):  # the plan's buffers are reused: a second layer must not see stale partials
        assert torch.equal(ops.verify_attention(*args, **opts, plan=plan), want), oc.where(case)
    assert torch.equal(ops.verify_attention(*args, **opts, plan=plan, out=out), want)


PLANNED = sorted({c for c, dt in ATTENTION_CASES if dt != F32 and c.head_dim in (64, 128) and not c.window},
                 key=str)


@pytest.mark.parametrize("case", PLANNED, ids=str)
def test_verify_attention_plan_splits_as_its_host_twin(case, monkeypatch):
    """The device planner's split of every request (the plan's split[]) is what the host twin
    of its search (_C.attn_split_chunk, tested on the CPU against the cost model) chooses for the
    same units and tiles: the block-wide search and reduction agree with the serial one."""
    from dspark_rt import _C
    monkeypatch.delenv("DSPARK_ATTN_BATCH_INVARIANT", raising=False)
    big = sum(case.ctx) * case.h_kv * case.head_dim > 2 ** 24
    kw = oc.attention_inputs(case, DEV, BF16, gen_device=DEV if big else "cpu")
    plan = ops.plan_verify_attention(kw["cu_q"], kw["kv_lens"], kw["block_tables"], kw["k_cache"],
                                     h_q=case.h_q, causal=case.causal)
    R, group, target = case.R, case.h_q // case.h_kv, plan.part_o.shape[0] // 2
    units = [case.h_kv * -(-n * group // 64) for n in case.n_q]
    tiles = [-(-L // 64) for L in kw["kv_lens"].tolist()]
    chunk = _C.attn_split_chunk(units, tiles, target)
    want = [1 if chunk == 0x7fffffff else max(1, -(-t // chunk)) for t in tiles]
    assert plan.work[R + 1: 2 * R + 1].tolist() == want, (chunk, target, oc.where(case))


@pytest.mark.parametrize("case,dtype", [(AC((3, 5), (4000, 37), 8, 2, 128, 16), BF16),  # split-KV
                                        (AC((3, 5), (60, 37), 8, 2, 64, 16), F16),     # unsplit
                                        (AC((3, 5), (60, 37), 6, 2, 96, 16), BF16),    # CUDA cores
                                        (AC((3, 5), (60, 37), 6, 2, 32, 16), F32)], ids=str)
def test_verify_attention_bad_pages(case, dtype, monkeypatch):
    """A page id outside the cache: NaN in every row of that request and nowhere else (the
    runner's NaN check fails it alone), as the reference; an OpError under DSPARK_CHECK_OPS=1."""
    kw = oc.attention_inputs(case, DEV, dtype)
    args, opts = _attention_args(kw), dict(causal=kw["causal"], scale=kw["scale"])
    good = ops.verify_attention(*args, **opts, backend="cuda")
    n0 = int(kw["cu_q"][1])
    for bad_page in (-1, kw["k_cache"].shape[0]):
        bt = kw["block_tables"].clone()
        bt[0, 1] = bad_page
        bad_args = args[:4] + [bt, args[5]]
        got = ops.verify_attention(*bad_args, **opts, backend="cuda")
        ref = reference.verify_attention(*bad_args, kw["causal"], kw["scale"])
        assert got[:n0].isnan().all() and ref[:n0].isnan().all(), bad_page
        assert torch.equal(got[n0:], good[n0:]), bad_page
        monkeypatch.setenv("DSPARK_CHECK_OPS", "1")
        with pytest.raises(ops.OpError, match="block_tables"):
            ops.verify_attention(*bad_args, **opts, backend="cuda")
        monkeypatch.delenv("DSPARK_CHECK_OPS")


def test_verify_attention_batch_invariant(monkeypatch):
    """DSPARK_ATTN_BATCH_INVARIANT=1: a row's result is bit-identical alone or in a batch, and
    as the first entry of a chain or a chain of one (what greedy equality needs); by default
    the split-KV factor follows the batch and may move it by an ulp."""
    monkeypatch.setenv("DSPARK_ATTN_BATCH_INVARIANT", "1")
    case = AC((3, 1, 5), (4000, 37, 295), 8, 2, 128, 16)
    kw = oc.attention_inputs(case, DEV, BF16)
    q, cu_q, kc, vc, bt, kv_lens = _attention_args(kw)
    full = ops.verify_attention(q, cu_q, kc, vc, bt, kv_lens, backend="cuda")
    alone = ops.verify_attention(q[:3], cu_q[:2], kc, vc, bt[:1], kv_lens[:1], backend="cuda")
    assert torch.equal(full[:3], alone)
    one = torch.tensor([0, 1], dtype=torch.int32, device=DEV)  # chain entry 0 alone, kv_len - 2
    first = ops.verify_attention(q[:1], one, kc, vc, bt[:1], kv_lens[:1] - 2, backend="cuda")
    assert torch.equal(full[:1], first)


# Row invariance under DSPARK_ATTN_BATCH_INVARIANT=1: (case, dtype). Contexts 0 .. ~5000 with
# page and tile edges (63, 64, 65); chains 1 .. 40 rows (40 x group 4 = 160 packed rows: three
# 64-row query tiles); tensor cores (head_dim 64 / 128), the CUDA-core path (float32, head_dim
# 96) and sliding windows.
ROW_INVARIANT_CASES = [
    (AC((8, 1, 3, 5, 8, 2), (0, 1, 63, 64, 65, 4990), 8, 2, 128, 16), BF16),
    (AC((8, 1, 3, 5, 8, 2), (0, 1, 63, 64, 65, 4990), 8, 2, 128, 16), F16),
    (AC((8, 1, 3, 5, 8, 2), (0, 1, 63, 64, 65, 4990), 8, 2, 128, 16), F32),
    (AC((40, 7, 1), (100, 2000, 5), 8, 2, 64, 32), BF16),
    (AC((40, 7, 1), (100, 2000, 5), 8, 2, 64, 32), F16),
    (AC((6, 4), (130, 3000), 6, 2, 96, 16), BF16),
    (AC((8, 3, 6), (1000, 37, 5), 8, 2, 128, 16, window=100), BF16),
    (AC((8, 3), (300, 63), 6, 2, 64, 16, window=33), F32),
]


def _sub_chain(args, r, a, b, cut, plan=False, **opts):
    """Rows a .. b-1 of request r's chain (local indices) as a request of their own, its kv_len
    cut by `cut` (the rows after b not yet in the cache), so row i keeps its position."""
    q, cu_q, kc, vc, bt, kv_lens = args
    lo = int(cu_q[r])
    cu = torch.tensor([0, b - a], dtype=torch.int32, device=DEV)
    L = kv_lens[r:r + 1] - cut
    extra = {}
    if plan:
        extra["plan"] = ops.plan_verify_attention(cu, L, bt[r:r + 1], kc, h_q=q.shape[1], **opts)
    return ops.verify_attention(q[lo + a:lo + b], cu, kc, vc, bt[r:r + 1], L, backend="cuda", **opts, **extra)


@pytest.mark.parametrize("case,dtype", ROW_INVARIANT_CASES, ids=lambda x: str(x))
def test_verify_attention_row_invariant(case, dtype, monkeypatch):
    """DSPARK_ATTN_BATCH_INVARIANT=1: a row's output is bit-identical in the batch, in its
    request's chain alone, as the last row of a shorter chain (verify width i + 1), as the first
    row of a later chain (the rows before it committed), alone as a 1-row chain with kv_len = its
    position + 1 (a plain decoding step), in a reordered batch and under a plan."""
    monkeypatch.setenv("DSPARK_ATTN_BATCH_INVARIANT", "1")
    kw = oc.attention_inputs(case, DEV, dtype)
    args = _attention_args(kw)
    q, cu_q, kc, vc, bt, kv_lens = args
    opts = dict(window=case.window) if case.window else {}
    where = oc.where(case)
    full = ops.verify_attention(*args, backend="cuda", **opts)
    assert not full.isnan().any(), where
    plan = ops.plan_verify_attention(cu_q, kv_lens, bt, kc, h_q=case.h_q, **opts)
    assert torch.equal(ops.verify_attention(*args, plan=plan, **opts), full), where
    for r in range(case.R):
        lo, n = int(cu_q[r]), int(cu_q[r + 1] - cu_q[r])
        assert torch.equal(_sub_chain(args, r, 0, n, 0, **opts), full[lo:lo + n]), (r, where)
        for i in range(n):
            cut = n - 1 - i  # kv_len = position of row i + 1
            head = _sub_chain(args, r, 0, i + 1, cut, **opts)
            tail = _sub_chain(args, r, i, n, 0, **opts)
            one = _sub_chain(args, r, i, i + 1, cut, plan=i % 2 == 1, **opts)
            assert torch.equal(head[i], full[lo + i]), (r, i, "last of a shorter chain", where)
            assert torch.equal(tail[0], full[lo + i]), (r, i, "first of a later chain", where)
            assert torch.equal(one[0], full[lo + i]), (r, i, "plain decoding step", where)
    # the requests in reverse order (and the batch without its first request)
    order = list(range(case.R))[::-1][:max(1, case.R - 1)]
    qs = torch.cat([q[int(cu_q[r]):int(cu_q[r + 1])] for r in order])
    cu = [0]
    for r in order:
        cu.append(cu[-1] + int(cu_q[r + 1] - cu_q[r]))
    got = ops.verify_attention(qs, torch.tensor(cu, dtype=torch.int32, device=DEV), kc, vc, bt[order],
                               kv_lens[order], backend="cuda", **opts)
    for j, r in enumerate(order):
        assert torch.equal(got[cu[j]:cu[j + 1]], full[int(cu_q[r]):int(cu_q[r + 1])]), (r, where)


def test_verify_attention_plan_in_cuda_graph():
    """Planned inside a captured forward (no host sync, no allocation outside torch's graph
    pool): replays follow new metadata values written into the captured buffers."""
    case = AC((1, 3, 0, 5), (16, 37, 9, 4000), 8, 2, 128, 16)  # a long context: split-KV
    kw = oc.attention_inputs(case, DEV, BF16)
    q, cu_q, kc, vc, bt, kv_lens = _attention_args(kw)

    def forward():
        plan = ops.plan_verify_attention(cu_q, kv_lens, bt, kc, h_q=case.h_q)
        return [ops.verify_attention(q, cu_q, kc, vc, bt, kv_lens, plan=plan) for _ in range(2)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # warm-up outside the capture (kernel attributes, allocator)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = forward()
    for shrink in (0, 8):
        kv_lens.copy_(torch.tensor([17, 40, 9, 4005], dtype=torch.int32, device=DEV) - shrink)
        graph.replay()
        want = ops.verify_attention(q, cu_q, kc, vc, bt, kv_lens, backend="cuda")
        assert all(torch.equal(o, want) for o in outs), shrink


# The fused split merge (the last split of a unit to finish merges, found by an atomic ticket):
# shapes whose plan splits, on every tile shape the kernel has: a tile's keys on 4 warps (<= 16
# rows), on 2 (<= 32), on 1 (more), both head dims, several requests split differently (and one
# not at all), a bidirectional block, a window, batch 1 up to 65k keys (41 splits of one unit).
FUSED_MERGE_CASES = [
    (AC((1,), (4096,), 32, 8, 128, 16, extra_pages=0), BF16),      # Qwen3-8B decode, 4 rows
    (AC((8,), (4096,), 32, 8, 128, 16, extra_pages=0), BF16),      # its verify: 32 rows
    (AC((8,), (32760,), 32, 8, 128, 16, extra_pages=0), BF16),     # batch 1, 32k
    (AC((8,), (4096,), 32, 8, 128, 16, extra_pages=0), F16),
    (AC((1,), (65000,), 8, 1, 128, 64, extra_pages=0), F16),       # one KV head: many splits
    (AC((12,), (6000,), 16, 4, 64, 16), F16),                      # 48 rows, head_dim 64
    (AC((5, 2, 9), (3000, 7000, 50), 8, 2, 64, 32), BF16),         # split 6 / 14 / not at all
    (AC((20,), (5000,), 8, 8, 128, 16), BF16),                     # group 1, 20 rows
    (AC((3,), (2000,), 6, 2, 128, 7, causal=False), BF16),         # drafter block, odd pages
    (AC((8,), (20000,), 8, 2, 128, 16, window=4096), BF16),        # sliding layer
    (AC((40,), (3000,), 4, 2, 128, 16), BF16),                     # tiles of 64 and 16 rows
    (AC((1, 1), (70000, 3), 4, 1, 64, 16), BF16),                  # 44 splits beside none
]


def _split_plan(case, kw):
    plan = ops.plan_verify_attention(kw["cu_q"], kw["kv_lens"], kw["block_tables"], kw["k_cache"],
                                     h_q=case.h_q, causal=case.causal, window=case.window)
    return plan, plan.work[case.R + 1: 2 * case.R + 1].tolist()


@pytest.mark.parametrize("case,dtype", FUSED_MERGE_CASES, ids=lambda x: str(x))
def test_verify_attention_fused_merge(case, dtype, monkeypatch):
    """Split items merge inside the attention kernel: the result matches the reference (the
    tolerance of test_verify_attention), the plan really splits, and planned and unplanned calls
    agree bit for bit (the merge sums splits in index order, whichever finishes last)."""
    monkeypatch.delenv("DSPARK_ATTN_BATCH_INVARIANT", raising=False)
    monkeypatch.delenv("DSPARK_EXACT", raising=False)
    big = sum(case.ctx) * case.h_kv * case.head_dim > 2 ** 24
    kw = oc.attention_inputs(case, DEV, dtype, gen_device=DEV if big else "cpu")
    args, where = _attention_args(kw), oc.where(case)
    opts = dict(causal=kw["causal"], scale=kw["scale"], window=case.window)
    plan, split = _split_plan(case, kw)
    assert max(split) > 1, (split, where)
    got = ops.verify_attention(*args, **opts, backend="cuda")
    ref = reference.verify_attention(*args, kw["causal"], kw["scale"], case.window)
    assert not got.isnan().any(), where
    vmax = float(kw["v_cache"].nan_to_num(0).abs().max())
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 * EPS[dtype],
                               atol=EPS[dtype] * vmax + 1e-5, msg=lambda m: f"{m}\n{where}")
    assert torch.equal(ops.verify_attention(*args, **opts, plan=plan), got), where


def _tickets(plan):
    """The merge tickets: 2 x target int32 (one per split slot) past the plan's 2 x target split
    slots of part_o (the rest of that slot is never written)."""
    target = plan.part_o.shape[0] // 2
    return plan.part_o[2 * target:].view(torch.int32).flatten()[:2 * target]


@pytest.mark.parametrize("case,dtype", [FUSED_MERGE_CASES[1], FUSED_MERGE_CASES[6]], ids=lambda x: str(x))
def test_verify_attention_merge_tickets_reset(case, dtype, monkeypatch):
    """Every layer of a forward reuses the plan's tickets: the block that merges a unit sets its
    ticket back to zero, so each call finds them as the plan left them (all zero) and leaves them
    so; ten calls on one plan, with fresh q each time, each equal an unplanned call."""
    monkeypatch.delenv("DSPARK_ATTN_BATCH_INVARIANT", raising=False)
    monkeypatch.delenv("DSPARK_EXACT", raising=False)
    kw = oc.attention_inputs(case, DEV, dtype)
    q, cu_q, kc, vc, bt, kv_lens = _attention_args(kw)
    opts = dict(causal=kw["causal"], scale=kw["scale"])
    plan, split = _split_plan(case, kw)
    assert max(split) > 1 and not _tickets(plan).any()
    for layer in range(10):
        q.copy_(torch.randn_like(q))
        got = ops.verify_attention(q, cu_q, kc, vc, bt, kv_lens, **opts, plan=plan)
        assert not _tickets(plan).any(), layer
        assert torch.equal(got, ops.verify_attention(q, cu_q, kc, vc, bt, kv_lens, **opts, backend="cuda")), layer


def test_verify_attention_merge_in_graph_replays(monkeypatch):
    """Layers captured in a CUDA graph with a plan made outside it (the tickets are not zeroed
    again between replays): every replay, on new q values, equals an eager call."""
    monkeypatch.delenv("DSPARK_ATTN_BATCH_INVARIANT", raising=False)
    monkeypatch.delenv("DSPARK_EXACT", raising=False)
    case = AC((8,), (4096,), 32, 8, 128, 16, extra_pages=0)
    kw = oc.attention_inputs(case, DEV, BF16)
    q, cu_q, kc, vc, bt, kv_lens = _attention_args(kw)
    plan, split = _split_plan(case, kw)
    assert max(split) > 1

    def layers():
        return [ops.verify_attention(q, cu_q, kc, vc, bt, kv_lens, plan=plan) for _ in range(3)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layers()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layers()
    for replay in range(4):
        q.copy_(torch.randn_like(q))
        graph.replay()
        want = ops.verify_attention(q, cu_q, kc, vc, bt, kv_lens, backend="cuda")
        assert all(torch.equal(o, want) for o in outs), replay
    torch.cuda.synchronize()
    assert not _tickets(plan).any()


# ---- append_kv (its binding arrives with the lead's CPU twin) ----------------------------------
@pytest.mark.skipif(not hasattr(getattr(ops, "_C", None), "append_kv"), reason="no append_kv binding yet")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h_kv,hd", [(3, 40), (2, 128), (1, 3)])  # 16-byte rows and odd rows
def test_append_kv(dtype, h_kv, hd):
    g = oc.generator(("append_kv", h_kv, hd))
    N, ps, pages = 37, 16, 9
    k, v = (torch.randn(N, h_kv, hd, generator=g).to(DEV, dtype) for _ in range(2))
    slots = torch.randperm(pages * ps, generator=g)[:N]
    slots[::5] = -1  # padding tokens are skipped
    kc = torch.full((pages, ps, h_kv, hd), 7.0, dtype=dtype, device=DEV)
    vc = kc.clone()
    C = ops._C
    p = C.AppendKvParams()
    p.N, p.h_kv, p.head_dim, p.page_size, p.num_pages = N, h_kv, hd, ps, pages
    p.dtype = {F32: 0, F16: 2, BF16: 3}[dtype]
    slots_d = slots.to(DEV)
    p.k, p.v, p.k_cache, p.v_cache, p.slot_mapping = (t.data_ptr() for t in (k, v, kc, vc, slots_d))
    C.append_kv(p, "cuda", torch.cuda.current_stream().cuda_stream)
    ok = slots >= 0
    want_k, want_v = torch.full_like(kc, 7.0), torch.full_like(vc, 7.0)
    want_k.view(-1, h_kv, hd)[slots[ok].to(DEV)] = k[ok.to(DEV)]
    want_v.view(-1, h_kv, hd)[slots[ok].to(DEV)] = v[ok.to(DEV)]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


# ---- CuPy arrays through the door (ops/arrays.py; tests/test_ops_arrays.py: the CPU stand-in) -----
class _InterfaceOnly:
    """A device array that offers only __cuda_array_interface__ (as Numba's do)."""

    def __init__(self, a):
        self.__cuda_array_interface__ = a.__cuda_array_interface__
        self.a = a  # keeps the memory alive


def test_cupy_arrays_in_and_out():
    """CuPy arrays allocated by CuPy, used on a CuPy stream of their own: the same results as
    torch tensors, in CuPy's type, z written into the caller's logits; torch arguments mix in;
    an __cuda_array_interface__-only array gets torch tensors back."""
    cp = pytest.importorskip("cupy")
    import numpy as np
    kw = oc.markov_inputs(MC(3, 4, 4100, "gated", rank=32, d=24, conf="markov", coupled="mixed"), DEV, F32)
    rest = [k for k in kw if k not in ("logits", "hidden", "anchor", "head")]
    want_z = kw["logits"].clone()
    want = ops.markov_sample(want_z, kw["hidden"], kw["anchor"], kw["head"], **{k: kw[k] for k in rest})
    rj = oc.rejection_inputs(oc.RejectionCase(6, 5, 9000, "random", "mixed", coupled="mixed"), DEV, F32)
    names = ("target_logits", "cu_rows", "draft_tokens", "draft_logits", "draft_lse")
    want_rj = ops.rejection_sample(*[rj[k] for k in names], **{k: v for k, v in rj.items() if k not in names})
    survival = torch.rand(40, 7, device=DEV)
    with cp.cuda.Stream(non_blocking=True) as s:
        f = {k: cp.asarray(v.cpu().numpy()) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        logits = f["logits"]
        got = ops.markov_sample(logits, f["hidden"], f["anchor"], f["head"], **{k: f[k] for k in rest})
        target = cp.asarray(rj["target_logits"].cpu().numpy())
        got_rj = ops.rejection_sample(target, *[rj[k] for k in names[1:]],
                                      **{k: v for k, v in rj.items() if k not in names})
        cai = _InterfaceOnly(cp.asarray(survival.cpu().numpy()))
        s.synchronize()  # the interface carries no stream exchange: the caller orders its own
        got_cai = ops.prefix_topk(cai, 100)
    assert all(isinstance(g, cp.ndarray) for g in (*got, *got_rj))
    for g, t in zip((*got, logits, *got_rj), (*want, want_z, *want_rj)):
        np.testing.assert_array_equal(cp.asnumpy(g), t.cpu().numpy())  # same kernel, same bits
    assert isinstance(got_cai, torch.Tensor) and torch.equal(got_cai, ops.prefix_topk(survival, 100))


# ---- compute-sanitizer ------------------------------------------------------------------------
_SANITIZE_SCRIPT = textwrap.dedent("""
    import torch
    from dspark_rt import ops
    from dspark_rt.testing import op_cases as oc
    WEIGHTS = ("hidden", "w1", "w2", "gate_w", "gate_b", "conf_w", "conf_b")
    for dt in (torch.bfloat16, torch.float32):
        for c in (oc.MarkovCase(3, 2, 1100, "gated", rank=32, d=24, conf="markov"),
                  oc.MarkovCase(2, 2, 700, "vanilla", rank=20, temps="sampled"),
                  oc.MarkovCase(3, 2, 700, "vanilla", rank=20, temps="sampled", coupled="mixed")):
            kw = oc.markov_inputs(c, "cuda", dt)
            runs = [kw]
            if dt == torch.float32:  # also bf16 hidden and weights under float32 logits (served)
                runs.append({k: v.bfloat16() if k in WEIGHTS and v is not None else v
                             for k, v in kw.items()})
            for a in runs:
                a = dict(a, logits=a["logits"].clone())
                ops.markov_sample(a.pop("logits"), a.pop("hidden"), a.pop("anchor"), a.pop("head"),
                                  backend="cuda", **a)
        for c in (oc.RejectionCase(4, 3, 9000, "random", "mixed"), oc.RejectionCase(3, 2, 1000, "full", "sampled"),
                  oc.RejectionCase(4, 3, 9000, "random", "mixed", coupled="mixed")):
            kw = oc.rejection_inputs(c, "cuda", dt)
            ops.rejection_sample(*[kw.pop(k) for k in ("target_logits", "cu_rows", "draft_tokens",
                                                       "draft_logits", "draft_lse")], backend="cuda", **kw)
            if dt == torch.float32:  # also bf16 target logits under float32 drafts (served)
                kw = oc.rejection_inputs(c, "cuda", dt)
                kw["target_logits"] = kw["target_logits"].bfloat16()
                ops.rejection_sample(*[kw.pop(k) for k in ("target_logits", "cu_rows", "draft_tokens",
                                                           "draft_logits", "draft_lse")], backend="cuda", **kw)
        for c in (oc.AttentionCase((2, 1), (300, 40), 8, 2, 128, 16), oc.AttentionCase((3,), (1100,), 4, 2, 64, 16),
                  oc.AttentionCase((2,), (30,), 4, 2, 32, 8)):
            kw = oc.attention_inputs(c, "cuda", dt)
            ops.verify_attention(*[kw.pop(k) for k in ("q", "cu_q", "k_cache", "v_cache", "block_tables",
                                                        "kv_lens")], backend="cuda", **kw)
    ops.prefix_topk(torch.rand(50, 7, device="cuda"), 100, backend="cuda")
    torch.cuda.synchronize()
    print("sanitize-ok")
""")


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer(tool, tmp_path):
    script = tmp_path / "exercise.py"
    script.write_text(_SANITIZE_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1",  # exact allocations: OOB is caught
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    cmd = ["compute-sanitizer", f"--tool={tool}", "--error-exitcode=3", sys.executable, str(script)]
    res = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=110)
    assert res.returncode == 0 and "sanitize-ok" in res.stdout, res.stdout[-4000:] + res.stderr[-4000:]
