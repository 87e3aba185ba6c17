"""prefix_topk: the verify lengths of the top-K draft candidates (DESIGN §4, the async
scheduler's admission) behind the door."""
import torch

from . import arrays, door, reference
from .door import ext, ptr
from ._check import fail, foreign, tensor


def prefix_topk(survival, K: int, *, backend=None):
    """Verify lengths of the top-K candidates; see reference.prefix_topk. Returns [R] int32."""
    if foreign(survival):
        return arrays.call(prefix_topk, locals())
    op = "prefix_topk"
    survival = tensor(op, "survival", survival, dtype=torch.float32, ndim=2)
    if isinstance(K, bool) or not isinstance(K, int) or K < 0:
        fail(op, f"K must be a non-negative int, got {K!r}")
    K = min(K, survival.numel())  # more than every candidate admits every candidate
    dev = survival.device
    be = door.pick(op, dev, backend, None)
    if be == "reference":
        return reference.prefix_topk(survival, K)
    R, gamma = survival.shape
    lengths = torch.empty(R, dtype=torch.int32, device=dev)  # both kernels write every entry
    p = ext.PrefixTopkParams()
    p.R, p.gamma, p.K = R, gamma, K
    p.survival, p.lengths = ptr(survival), ptr(lengths)
    door.run("prefix_topk", p, be, dev)
    return lengths
