"""verify_attention: tree-free ragged attention over the paged KV cache (DESIGN §5), split like
FlashInfer's plan/run: plan_verify_attention once per forward, then every layer's
verify_attention(..., plan=plan)."""
from dataclasses import dataclass

import numpy as np
import torch

from . import arrays, door, exact, reference
from .door import DTYPE_CODE, ext, ptr
from ._check import fail, foreign, tensor, values


@dataclass(frozen=True, eq=False)
class VerifyAttentionPlan:
    """verify_attention's plan for one forward (FlashInfer's plan/run), from
    plan_verify_attention: the batch metadata it was made for, checked once, and on the CUDA
    tensor-core path the work partition and split-KV partial buffers every layer reuses."""
    backend: str
    cu_q: torch.Tensor
    kv_lens: torch.Tensor
    block_tables: torch.Tensor
    h_q: int
    k_shape: tuple   # k_cache.shape: num_pages, page_size, h_kv, head_dim
    dtype: torch.dtype
    causal: bool
    window: int = 0
    batch_invariant: bool = False  # the split mode it was planned in (CUDA)
    work: torch.Tensor | None = None      # int32 [4 (R + 1)] item_off | split | slot_off | bad
    part_o: torch.Tensor | None = None    # float32 [slots, 64, head_dim]
    part_lse: torch.Tensor | None = None  # float32 [slots, 64]


def _attention_meta(op, cu_q, kv_lens, block_tables, k_cache, N, dev):
    """Checks the batch metadata of verify_attention (host tensors also by value: no sync)."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    cu_q = tensor(op, "cu_q", cu_q, dtype=torch.int32, ndim=1, device=dev)
    R = cu_q.shape[0] - 1
    block_tables = tensor(op, "block_tables", block_tables, dtype=torch.int32, ndim=2, device=dev)
    if block_tables.shape[0] != R:
        fail(op, f"block_tables must have R={R} rows, got {block_tables.shape[0]}")
    kv_lens = tensor(op, "kv_lens", kv_lens, dtype=torch.int32, shape=(R,), device=dev)
    max_pages = block_tables.shape[1]
    # Device metadata is checked only under DSPARK_CHECK_OPS=1; otherwise a request with page
    # ids outside the cache gets NaN rows from the kernels (reference.verify_attention).
    h_cu, h_lens, h_tables = values(cu_q), values(kv_lens), values(block_tables)
    if h_cu is not None and R > 0:  # in numpy: a forward plans once, torch ops cost ~10 us each
        cu, lens, tables = h_cu.numpy(), h_lens.numpy(), h_tables.numpy()
        n = cu[1:] - cu[:-1]
        if cu[0] != 0 or (N is not None and cu[-1] > N) or n.min() < 0:
            fail(op, f"cu_q must be non-decreasing from 0 to at most N={N}, got {cu.tolist()}")
        if (lens < n).any() or lens.max() > max_pages * page_size:
            fail(op, f"kv_lens must lie in [n_q, max_pages * page_size = {max_pages * page_size}], "
                     f"got {lens.tolist()} for n_q {n.tolist()}")
        used = tables[np.arange(max_pages)[None, :] * page_size < lens[:, None]]
        if used.size and (used.min() < 0 or used.max() >= num_pages):
            fail(op, f"block_tables (used entries) values must lie in [0, {num_pages}), got range "
                     f"[{used.min()}, {used.max()}]")
    return cu_q, kv_lens, block_tables


def _window(op, window) -> int:
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        fail(op, f"window must be an int >= 0 (0: no sliding window), got {window!r}")
    return window


def _attention_params(R, h_q, k_cache, dtype, causal, window=0, batch_invariant=None):
    num_pages, page_size, h_kv, hd = k_cache.shape
    p = ext.VerifyAttentionParams()
    p.R, p.h_q, p.h_kv, p.head_dim = R, h_q, h_kv, hd
    p.page_size, p.num_pages = page_size, num_pages
    p.dtype, p.causal, p.window = DTYPE_CODE[dtype], bool(causal), window
    p.batch_invariant = (exact.batch_invariant(k_cache.device) if batch_invariant is None
                         else batch_invariant)
    return p


def plan_verify_attention(cu_q, kv_lens, block_tables, k_cache, *, h_q, causal=True, window=0,
                          backend=None):
    """Plans verify_attention for a batch once per forward; pass the plan to every layer's
    verify_attention(..., plan=plan). cu_q [R + 1], kv_lens [R], block_tables [R, max_pages]
    int32 as for verify_attention; k_cache [num_pages, page_size, h_kv, head_dim] any layer's
    (it gives the dtype, device and cache geometry every layer shares); h_q query heads.
    CUDA: allocates the work partition and split partials (torch tensors) and writes the
    partition on the current stream from the device metadata, with no host sync and no
    cudaMalloc, so it can be captured in a CUDA graph. CPU: the metadata checks, done once."""
    op = "plan_verify_attention"
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        if foreign(k_cache):
            return arrays.call(plan_verify_attention, locals())
        fail(op, "k_cache must be a [num_pages, page_size, h_kv, head_dim] tensor")
    dev, fdt = k_cache.device, k_cache.dtype
    be = door.pick(op, dev, backend, fdt, "k_cache", door.all_float_dtypes)
    h_kv = k_cache.shape[2]
    if not isinstance(h_q, int) or h_kv == 0 or h_q < 1 or h_q % h_kv:
        fail(op, f"h_q={h_q!r} must be a positive multiple of h_kv={h_kv}")
    window = _window(op, window)
    cu_q, kv_lens, block_tables = _attention_meta(op, cu_q, kv_lens, block_tables, k_cache, None, dev)
    invariant = exact.batch_invariant(dev)
    plan = dict(backend=be, cu_q=cu_q, kv_lens=kv_lens, block_tables=block_tables, h_q=h_q,
                k_shape=tuple(k_cache.shape), dtype=fdt, causal=bool(causal), window=window,
                batch_invariant=invariant)
    if be == "cuda":
        R, hd = cu_q.shape[0] - 1, k_cache.shape[3]
        p = _attention_params(R, h_q, k_cache, fdt, causal, window, invariant)
        p.max_pages = block_tables.shape[1]
        p.cu_q, p.kv_lens = ptr(cu_q), ptr(kv_lens)
        stream = torch.cuda.current_stream(dev).cuda_stream
        slots = ext.verify_attention_plan_slots(p, stream)
        if slots and R > 0:  # the tensor-core path: partition and partials for every layer
            work = torch.empty(4 * (R + 1), dtype=torch.int32, device=dev)
            part_o = torch.empty(slots, 64, hd, dtype=torch.float32, device=dev)
            part_lse = torch.empty(slots, 64, dtype=torch.float32, device=dev)
            p.work, p.part_o, p.part_lse, p.plan_slots = ptr(work), ptr(part_o), ptr(part_lse), slots
            ext.verify_attention_plan(p, stream)
            plan.update(work=work, part_o=part_o, part_lse=part_lse)
    return VerifyAttentionPlan(**plan)


def _check_plan(op, plan, be, cu_q, kv_lens, block_tables, h_q, k_cache, causal, window):
    if not isinstance(plan, VerifyAttentionPlan):
        fail(op, f"plan must come from plan_verify_attention, got {type(plan).__name__}")
    same = lambda a, b: a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.device == b.device
    for name, a, b in (("cu_q", plan.cu_q, cu_q), ("kv_lens", plan.kv_lens, kv_lens),
                       ("block_tables", plan.block_tables, block_tables)):
        if not same(a, b):
            fail(op, f"plan was made for another {name} tensor (plan once per forward, from the "
                     f"metadata every layer passes)")
    got = (be, h_q, tuple(k_cache.shape), k_cache.dtype, bool(causal), window)
    want = (plan.backend, plan.h_q, plan.k_shape, plan.dtype, plan.causal, plan.window)
    if got != want:
        fail(op, f"plan was made for (backend, h_q, k_cache shape, dtype, causal, window) = {want}, "
                 f"this call has {got}")
    if plan.batch_invariant != exact.batch_invariant(k_cache.device):
        fail(op, f"plan was made with batch_invariant={plan.batch_invariant}, but DSPARK_EXACT / "
                 f"DSPARK_ATTN_BATCH_INVARIANT now say {not plan.batch_invariant}: plan again")


def verify_attention(q, cu_q, k_cache, v_cache, block_tables, kv_lens, *, causal=True,
                     window=0, scale=None, plan=None, out=None, backend=None):
    """Ragged paged attention; see reference.verify_attention. Returns [N, h_q, head_dim].
    Rows cu_q[R] .. N-1 belong to no request (the padding of a CUDA-graph bucket): no backend
    reads them, and their output is unspecified (the reference writes zeros, the kernels leave
    it unwritten).
    Bad metadata: on host tensors an OpError (block-table entries outside the cache included);
    on device tensors an OpError under DSPARK_CHECK_OPS=1, else NaN rows for the bad request.
    Row invariance: the cpp kernel gives a row the same bits whatever else shares the call (its
    chain's other rows, other requests). On CUDA the split-KV factor is chosen for the whole
    batch (to fill the GPU), so a 16-bit row may move by an ulp with its company; under
    exact_mode() or DSPARK_ATTN_BATCH_INVARIANT=1 it never splits and is row-invariant too
    (slower for long contexts at small batch). The reference is not (torch's float32 einsum).
    plan: plan_verify_attention's for this batch (None: the call plans itself; same result).
    out: a contiguous [N, h_q, head_dim] tensor of q's dtype to write (and return) instead of a
    new one. window > 0: a sliding layer's window (see the reference)."""
    op = "verify_attention"
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        if foreign(q):
            return arrays.call(verify_attention, locals())
        fail(op, "q must be a [N, h_q, head_dim] tensor")
    dev = q.device
    fdt = q.dtype
    be = plan.backend if isinstance(plan, VerifyAttentionPlan) and backend is None else backend
    be = door.pick(op, dev, be, fdt, "q", door.all_float_dtypes)
    window = _window(op, window)
    q = q.contiguous()
    N, h_q, hd = q.shape
    if hd < 1:
        fail(op, f"q must have head_dim >= 1, got shape {tuple(q.shape)}")
    k_cache = tensor(op, "k_cache", k_cache, dtype=fdt, ndim=4, device=dev)
    num_pages, page_size, h_kv, _ = k_cache.shape
    tensor(op, "k_cache", k_cache, shape=(num_pages, page_size, h_kv, hd))
    v_cache = tensor(op, "v_cache", v_cache, dtype=fdt, shape=tuple(k_cache.shape), device=dev)
    if h_kv == 0 or h_q % h_kv:
        fail(op, f"h_q={h_q} must be a multiple of h_kv={h_kv}")
    if plan is None:
        cu_q, kv_lens, block_tables = _attention_meta(op, cu_q, kv_lens, block_tables, k_cache, N, dev)
    else:  # checked when planned
        _check_plan(op, plan, be, cu_q, kv_lens, block_tables, h_q, k_cache, causal, window)
        cu_q, kv_lens, block_tables = plan.cu_q, plan.kv_lens, plan.block_tables
        if dev.type == "cpu" and cu_q.shape[0] > 1 and int(cu_q[-1]) > N:
            fail(op, f"cu_q must end at most at N={N}, got {int(cu_q[-1])}")
    if out is not None:
        out = tensor(op, "out", out, dtype=fdt, shape=(N, h_q, hd), device=dev, written=True)
        if out.numel() and out.data_ptr() == q.data_ptr():
            fail(op, "out must not be q")
    R, max_pages = cu_q.shape[0] - 1, block_tables.shape[1]
    scale = float(hd ** -0.5 if scale is None else scale)
    if be == "reference":
        res = reference.verify_attention(q, cu_q, k_cache, v_cache, block_tables, kv_lens,
                                         causal, scale, window)
        return res if out is None else out.copy_(res)
    out = torch.empty_like(q) if out is None else out
    p = _attention_params(R, h_q, k_cache, fdt, causal, window)
    p.max_pages, p.scale = max_pages, scale
    p.q, p.cu_q, p.k_cache, p.v_cache = ptr(q), ptr(cu_q), ptr(k_cache), ptr(v_cache)
    p.block_tables, p.kv_lens, p.out = ptr(block_tables), ptr(kv_lens), ptr(out)
    if plan is not None and plan.work is not None:
        p.work, p.part_o, p.part_lse = ptr(plan.work), ptr(plan.part_o), ptr(plan.part_lse)
        p.plan_slots = plan.part_o.shape[0]
    door.run("verify_attention", p, be, dev)
    return out
