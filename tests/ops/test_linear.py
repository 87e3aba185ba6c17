"""ops.linear's C++ kernel against the reference (torch in float32 / float64) on fresh random
inputs, and the door's argument checks. Row invariance is tests/ops/test_row_invariance.py."""
import pytest
import torch

from dspark_rt import ops
from dspark_rt.ops import OpError

SHAPES = [(1, 1, 1), (1, 17, 9), (7, 5, 3), (8, 1000, 257), (33, 64, 1), (64, 96, 1000),
          (3, 2, 0), (0, 4, 8), (5, 0, 8)]


def _tolerance(x, w, dtype):
    """|kernel - reference| bound: both accumulate in float32 (float64) in different orders, so
    each may be off by ~K ulps of sum |x w|, plus one rounding of the output dtype."""
    mag = torch.nn.functional.linear(x.double().abs(), w.double().abs())
    acc_eps = 2.0 ** -52 if dtype == torch.float64 else 2.0 ** -23
    out_eps = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}.get(dtype, acc_eps)
    K = x.shape[-1]
    return (2 * K + 2) * acc_eps * mag + out_eps * mag + 1e-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_linear_matches_reference(dtype, M, N, K):
    gen = torch.Generator().manual_seed(M * 1009 + N * 31 + K)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = torch.randn(N, K, generator=gen).to(dtype)
    got = ops.linear(x, w)
    want = ops.linear(x, w, backend="reference")
    assert got.dtype == dtype and got.shape == (M, N)
    err = (got.double() - want.double()).abs()
    assert bool((err <= _tolerance(x, w, dtype)).all()), f"max error {err.max().item()}"


def test_linear_leading_dims_views_out_and_specials():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, generator=gen)
    w = torch.randn(24, 40, generator=gen)
    want = ops.linear(x.reshape(6, 40), w).reshape(2, 3, 24)
    assert torch.equal(ops.linear(x, w), want)
    xs = torch.randn(6, 80, generator=gen)[:, ::2]  # a strided view: copied by the door
    assert torch.equal(ops.linear(xs, w), ops.linear(xs.contiguous(), w))
    out = torch.full((2, 3, 24), float("nan"))
    assert ops.linear(x, w, out=out) is out and torch.equal(out, want)
    x[0, 0, 5] = float("nan")  # NaN and inf reach only their own row's outputs
    x[1, 2, 0] = float("inf")
    y = ops.linear(x, w)
    assert y[0, 0].isnan().all() and not y[0, 1:].isnan().any() and not y[1, :2].isnan().any()
    assert not torch.isfinite(y[1, 2]).any()


def test_linear_refuses_bad_arguments():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(OpError, match="linear: w must be torch.float32"):
        ops.linear(x, w.double())
    with pytest.raises(OpError, match="K=8 columns"):
        ops.linear(torch.randn(3, 7), w)
    with pytest.raises(OpError, match="w must have 2 dims"):
        ops.linear(x, w[None])
    with pytest.raises(OpError, match="out must have shape"):
        ops.linear(x, w, out=torch.empty(3, 4))
    with pytest.raises(OpError, match="out must be contiguous"):
        ops.linear(x, w, out=torch.empty(5, 3).t())
    with pytest.raises(OpError, match="x must be"):
        ops.linear(torch.tensor(1.0), w)
    with pytest.raises(OpError, match="backend"):
        ops.linear(x, w, backend="tpu")
