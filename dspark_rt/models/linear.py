"""The target's projections: torch's GEMM, or under exact mode ops.linear, whose every output
element is summed in an order fixed by K alone (row-invariant: DESIGN §6), so a verify forward
of l + 1 rows gives each row the bits l + 1 plain decoding steps give it."""
import os

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops

__all__ = ["Linear", "project"]


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K].T in x's dtype (ops.exact_mode decides the kernel; a product that
    autograd records is torch's)."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return F.linear(x, w)  # training (dspark_rt.train): the kernels have no backward
    env = os.environ.get("DSPARK_EXACT")
    if x.is_cpu and env in (None, "", "0", "1"):  # the common case, without a device object
        exact = env != "0"
    else:
        exact = ops.exact_mode(x.device)  # (and a bad value is refused there)
    return ops.linear(x, w) if exact else F.linear(x, w)


class Linear(nn.Linear):
    """nn.Linear without bias whose product is project()."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return project(x, self.weight)
