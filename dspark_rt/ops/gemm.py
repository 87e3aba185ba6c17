"""linear: the row-invariant GEMM (out = x @ w.T) behind the door; every projection of the
target's forward crosses it, so its common case skips the params object."""
import math
import os

import torch

from . import arrays, door, reference
from .door import DTYPE_CODE, ext, ptr
from ._check import fail, foreign, tensor

_HAS_CPP = "cpp" in door.AVAILABLE


def linear(x, w, *, out=None, backend=None):
    """out = x @ w.T, row-invariant: x [..., K], w [N, K] (nn.Linear's weight), both of one
    float dtype; returns [..., N] in that dtype, accumulated in float32 (float64 for float64)
    and rounded once. On the cpp and cuda backends every output element is summed in one order
    fixed by K alone, so a row gives the same bits whatever other rows share the call (the
    reference, torch's own GEMM, does not promise that). out: a contiguous [..., N] tensor to
    write instead of a new one."""
    op = "linear"
    if backend is None and out is None and _HAS_CPP and isinstance(x, torch.Tensor) \
            and isinstance(w, torch.Tensor) and x.is_cpu and w.is_cpu and x.dtype == w.dtype \
            and w.dim() == 2 and x.dim() >= 1 and x.is_contiguous() and w.is_contiguous() \
            and "DSPARK_BACKEND" not in os.environ:
        N, K = w.shape
        code = DTYPE_CODE.get(x.dtype)
        if code is not None and x.shape[-1] == K:
            # every check of the full path below holds: launch without the params object (the
            # door is crossed for every projection of every forward)
            lead = x.shape[:-1]
            res = torch.empty((*lead, N), dtype=x.dtype)
            ext.linear_contiguous(x.data_ptr(), w.data_ptr(), res.data_ptr(), math.prod(lead), N,
                                 K, code, "cpp", 0)
            return res
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        if foreign(x):
            return arrays.call(linear, locals())
        fail(op, "x must be a [..., K] tensor")
    dev, fdt = x.device, x.dtype
    be = door.pick(op, dev, backend, fdt, "x", door.all_float_dtypes)
    w = tensor(op, "w", w, dtype=fdt, ndim=2, device=dev)
    N, K = w.shape
    if x.shape[-1] != K:
        fail(op, f"x must have K={K} columns (w is {tuple(w.shape)}), got shape {tuple(x.shape)}")
    lead = tuple(x.shape[:-1])
    if out is not None:
        out = tensor(op, "out", out, dtype=fdt, shape=(*lead, N), device=dev, written=True)
    if be == "reference":
        res = reference.linear(x, w)
        return res if out is None else out.copy_(res)
    x2 = x.reshape(math.prod(lead), K).contiguous()
    out = torch.empty((*lead, N), dtype=fdt, device=dev) if out is None else out
    p = ext.LinearParams()
    p.M, p.N, p.K = x2.shape[0], N, K
    p.ldx, p.ldw, p.ldo = K, K, N
    p.dtype = DTYPE_CODE[fdt]
    p.x, p.w, p.out = ptr(x2), ptr(w), ptr(out)
    door.run(op, p, be, dev)
    return out
