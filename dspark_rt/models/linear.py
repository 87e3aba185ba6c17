"""The target's projections: torch's GEMM, or under exact mode ops.linear, whose every output
element is summed in an order fixed by K alone (row-invariant: DESIGN §6), so a verify forward
of l + 1 rows gives each row the bits l + 1 plain decoding steps give it."""
import torch
import torch.nn.functional as F
from torch import nn

from .. import ops

__all__ = ["Linear", "project"]


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K].T in x's dtype (ops.exact_mode decides the kernel)."""
    if ops.exact_mode(x.device):
        return ops.linear(x, w)
    return F.linear(x, w)


class Linear(nn.Linear):
    """nn.Linear without bias whose product is project()."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return project(x, self.weight)
