"""Grammar masks inside the sampling ops: token_bitmask of rejection_sample (one row per target
row) and of markov_sample (draft position 1), on every backend against the reference, and the
reference against its definition: a forbidden entry is a -inf logit (DESIGN §6)."""
import math
import random

import pytest
import torch

from dspark_rt import ops
from dspark_rt.ops import reference
from dspark_rt.ops._check import OpError
from dspark_rt.testing import op_cases as oc

# a CUDA build runs its cases only where a device is (the gpu marker: tests/conftest.py)
BACKENDS = [b if b == "cpp" else pytest.param(b, marks=pytest.mark.gpu)
            for b in ("cpp", "cuda") if b in ops.available_backends()]
DEV = {"cpp": "cpu", "cuda": "cuda"}
REJECTION = [oc.RejectionCase(6, 4, 37, "random", "mixed"),
             oc.RejectionCase(5, 3, 1000, "full", "sampled", "random"),
             oc.RejectionCase(4, 5, 129, "random", "greedy"),
             oc.RejectionCase(6, 3, 517, "random", "mixed", coupled="mixed"),
             oc.RejectionCase(3, 0, 37, "zero", "mixed")]
MARKOV = [oc.MarkovCase(3, 4, 37, "vanilla", temps="mixed"),
          oc.MarkovCase(4, 3, 1000, "gated", rank=24, d=40, temps="sampled"),
          oc.MarkovCase(3, 3, 517, "none", temps="greedy", coupled="mixed"),
          oc.MarkovCase(3, 4, 1000, "selector", rank=16, d=32, top_k=40, temps="mixed")]


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [N, V] -> int32 bitmask [N, ceil(V / 32)] (bit v % 32 of word v // 32)."""
    N, V = allowed.shape
    W = (V + 31) // 32
    bits = torch.zeros(N, W * 32, dtype=torch.int64)
    bits[:, :V] = allowed.long()
    words = (bits.view(N, W, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def random_allowed(rng: random.Random, N, V, density=0.4) -> torch.Tensor:
    """A random bool mask with at least one allowed token a row; about a quarter of the rows
    allow exactly one (a token the grammar forces)."""
    g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    ok = torch.rand(N, V, generator=g) < density
    for i in range(N):
        if rng.random() < 0.25 or not ok[i].any():
            ok[i] = False
            ok[i, rng.randrange(V)] = True
    return ok


def _rejection(kw, backend, mask=None, device="cpu"):
    kw = {k: v.clone().to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return ops.rejection_sample(kw.pop("target_logits"), kw.pop("cu_rows"), kw.pop("draft_tokens"),
                                kw.pop("draft_logits"), kw.pop("draft_lse"), backend=backend,
                                token_bitmask=None if mask is None else mask.to(device), **kw)


def _rejection_case(case, key, dtype=torch.float32):
    """Inputs and a mask: random rows, single-token rows, and rows forbidding their draft."""
    kw = oc.rejection_inputs(case, dtype=dtype, key=key)
    rng = random.Random(f"{case}/{key}")
    N, V = kw["target_logits"].shape
    ok = random_allowed(rng, N, V)
    cu = kw["cu_rows"].tolist()
    for r in range(case.R):
        for k in range(cu[r + 1] - cu[r] - 1):
            x = int(kw["draft_tokens"][r, k])
            ok[cu[r] + k, x] = rng.random() < 0.5  # half the drafts forbidden by their row
            if not ok[cu[r] + k].any():
                ok[cu[r] + k, (x + 1) % V] = True
    return kw, ok


@pytest.mark.parametrize("case", REJECTION, ids=str)
def test_rejection_mask_is_minus_inf_logits(case):
    """The reference's definition: the mask equals writing -inf over the forbidden logits."""
    for key in range(3):
        kw, ok = _rejection_case(case, key, torch.float64)
        planted = {**kw, "target_logits": kw["target_logits"].masked_fill(~ok, -math.inf)}
        got, want = _rejection(kw, "reference", pack(ok)), _rejection(planted, "reference")
        for a, b in zip(got, want):
            assert torch.equal(a, b), oc.where(case, key)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", REJECTION, ids=str)
def test_rejection_mask_backends(case, backend):
    """Every backend's tokens, counts and flags equal the reference's, exactly."""
    for key in range(3):
        kw, ok = _rejection_case(case, key)
        mask = pack(ok)
        got = _rejection(kw, backend, mask, DEV[backend])
        want = _rejection(kw, "reference", mask)
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b), (backend, oc.where(case, key))
        acc, out, failed = want
        assert not failed.any()
        cu = kw["cu_rows"]
        for r in range(case.R):  # structure: every emitted token is allowed by its row
            for j in range(int(acc[r]) + 1):
                assert ok[int(cu[r]) + j, int(out[r, j])], (oc.where(case, key), r, j)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_rejection_forced_rows_and_forbidden_drafts(backend):
    """Rows that allow one token emit it whatever the logits; a draft its row forbids is never
    accepted; a row that allows nothing fails its request alone."""
    case = oc.RejectionCase(6, 4, 300, "full", "mixed", "random")
    kw = oc.rejection_inputs(case, key=7)
    N, V = kw["target_logits"].shape
    ok = torch.ones(N, V, dtype=torch.bool)
    forced = [(r * 5 + k, (17 * r + 31 * k) % V) for r in (0, 1) for k in range(5)]
    for row, t in forced:  # requests 0 and 1: every row forces a token
        ok[row] = False
        ok[row, t] = True
    kw["draft_tokens"][0] = torch.tensor([t for row, t in forced[:4]])  # request 0 drafts them
    for k in range(4):  # request 2: its rows forbid its drafts
        ok[10 + k, int(kw["draft_tokens"][2, k])] = False
    ok[15 + 2] = False  # request 3's third row allows nothing
    acc, out, failed = (t.cpu() for t in _rejection(kw, backend, pack(ok), DEV.get(backend, "cpu")))
    assert int(acc[0]) == 4 and out[0].tolist() == [t for _, t in forced[:5]]
    assert out[1, int(acc[1])] == forced[5 + int(acc[1])][1]
    assert int(acc[2]) == 0
    assert failed.tolist() == [False, False, False, True, False, False]


def _markov(kw, backend, mask=None, device="cpu"):
    kw = {k: v.clone().to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    logits = kw.pop("logits")
    out = ops.markov_sample(logits, kw.pop("hidden"), kw.pop("anchor"), kw.pop("head"),
                            backend=backend, token_bitmask=None if mask is None else mask.to(device),
                            **kw)
    return (logits, *out)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("case", MARKOV, ids=str)
def test_markov_mask_first_position(case, backend):
    """Position 1 under the mask: z is -inf where forbidden and the unmasked z elsewhere, x_1 is
    allowed, and lse / logprob describe the masked proposal; on the reference, greedy x_1 is the
    masked argmax."""
    dtype = torch.float64 if backend != "cuda" else torch.float32
    for key in range(2):
        kw = oc.markov_inputs(case, dtype=dtype, key=key)
        ok = random_allowed(random.Random(f"{case}/{key}"), case.R, case.V)
        z, tok, lp, lse, _ = (t.cpu() for t in _markov(kw, backend, pack(ok), DEV.get(backend, "cpu")))
        z0 = _markov(kw, backend, None, DEV.get(backend, "cpu"))[0].cpu()
        assert torch.equal(torch.isinf(z[:, 0]) & ~ok, ~ok), oc.where(case, key)
        assert torch.equal(z[:, 0][ok], z0[:, 0][ok]), oc.where(case, key)
        # the selector's candidates are U's top_k before the mask: none may be allowed
        empty = torch.isinf(z[:, 0]).all(-1)
        assert (ok.gather(1, tok[:, :1])[:, 0] | empty).all(), oc.where(case, key)
        assert case.head == "selector" or not empty.any()
        T = kw["temperature"].double()
        T = torch.where(T == 0, 1.0, T)
        want_lse = torch.logsumexp(z[:, 0].double() / T[:, None], -1)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert torch.allclose(lse[:, 0].double(), want_lse, rtol=tol, atol=tol)
        want_lp = z[:, 0].double().gather(1, tok[:, :1])[:, 0] / T - want_lse
        assert torch.allclose(lp[~empty, 0].double(), want_lp[~empty], rtol=tol, atol=tol)
        greedy = kw["temperature"] == 0
        if greedy.any():
            masked = z0[:, 0].double().masked_fill(~ok, -math.inf)
            assert torch.equal(tok[greedy & ~empty, 0], reference._first_argmax(masked)[greedy & ~empty])


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "cpp"])
@pytest.mark.parametrize("case", MARKOV, ids=str)
def test_markov_mask_backends(case, backend):
    """The whole masked drafting stage against the reference in float64 (both compute in
    double): tokens exactly, floats to 1e-12. CUDA (float32 only, where a float tie can flip a
    later step's token) is held to the structural test above, which pins step 1 exactly."""
    dtype = torch.float64
    tol = 1e-12
    for key in range(2):
        kw = oc.markov_inputs(case, dtype=dtype, key=key)
        mask = pack(random_allowed(random.Random(f"{case}/{key}"), case.R, case.V))
        got = [t.cpu() for t in _markov(kw, backend, mask, DEV[backend])]
        want = _markov(kw, "reference", mask)
        assert torch.equal(got[1], want[1]), (backend, oc.where(case, key))
        for a, b in zip((got[0], got[2], got[3]), (want[0], want[2], want[3])):
            fin = torch.isfinite(b)
            assert torch.equal(fin, torch.isfinite(a)), (backend, oc.where(case, key))
            assert torch.allclose(a[fin].double(), b[fin].double(), rtol=tol, atol=tol)


def test_bitmask_checks_name_the_argument():
    kw = oc.rejection_inputs(REJECTION[0])
    N, V = kw["target_logits"].shape
    for bad, what in ((torch.zeros(N, (V + 31) // 32, dtype=torch.int64), "int32"),
                      (torch.zeros(N + 1, (V + 31) // 32, dtype=torch.int32), "shape"),
                      (torch.zeros(N, V // 32, dtype=torch.int32), "shape")):
        with pytest.raises(OpError, match=f"token_bitmask.*{what}"):
            _rejection(kw, "reference", bad)
    mk = oc.markov_inputs(MARKOV[0])
    with pytest.raises(OpError, match="token_bitmask.*shape"):
        _markov(mk, "reference", torch.zeros(MARKOV[0].R, 1 + (MARKOV[0].V + 31) // 32, dtype=torch.int32))
