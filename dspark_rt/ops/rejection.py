"""rejection_sample: lossless acceptance for the whole batch (DESIGN §2 step 6) behind the door,
and which backend takes which (target, draft) dtype pair."""
import torch

from . import arrays, door, reference
from .door import DTYPE_CODE, ext, ptr
from ._check import coupled_flags, fail, foreign, int_range, temperatures, tensor, values
from ._check import token_bitmask as _token_bitmask


# rejection_sample's target logits may be 16-bit under float32 draft logits (a 16-bit model's
# verify output served as it is, widened exactly on load): (target, draft) pairs each backend
# takes besides equal dtypes.
_REJECTION_MIXED = {
    "reference": {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)},
    "cpp": {(torch.bfloat16, torch.float32)},
    "cuda": {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)},
}


def _rejection_backend(device: torch.device, backend, tdt, ddt):
    """rejection_sample's backend for target logits of dtype tdt and draft logits of ddt (None:
    no drafts, the target dtype alone): door.pick's, falling back by default to the reference
    where the kernel does not take the pair."""
    op = "rejection_sample"
    takes = lambda b: ((ddt in (None, tdt) and tdt in door.float_dtypes(b))
                       or (tdt, ddt or torch.float32) in _REJECTION_MIXED[b])
    if not takes("reference"):
        fail(op, f"draft_logits dtype {ddt} cannot serve {tdt} target logits: it must be the "
                 f"target's dtype, or float32 under 16-bit target logits")
    be = door.pick(op, device, backend, None)
    if not takes(be):
        if backend is not None or door.forced():
            fail(op, f"backend {be!r} does not take target_logits dtype {tdt} with draft_logits "
                     f"dtype {ddt} (it takes {[str(d) for d in door.float_dtypes(be)]} with equal "
                     f"draft dtypes and {sorted(f'{t} with {d}' for t, d in _REJECTION_MIXED[be])})")
        be = "reference"
    return be


def takes_narrow_target(device, dtype) -> bool:
    """Whether rejection_sample's default backend for `device` takes target logits of the 16-bit
    `dtype` under float32 drafts in its kernel (else a caller had better widen them first: the
    fallback is the reference)."""
    be = door.pick("rejection_sample", torch.device(device), None, None)
    return be != "reference" and (dtype, torch.float32) in _REJECTION_MIXED[be]


def rejection_sample(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, *,
                     temperature, seed, stream, round_, coupled=None, token_bitmask=None,
                     backend=None):
    """Lossless acceptance; see reference.rejection_sample for the semantics.

    target_logits [N, V]; cu_rows [R + 1] int32 (rows past cu_rows[R] belong to no request: the
    padding of a verify batch whose lengths stayed on the device); draft_tokens [R, gamma] int64 (gamma may be 0,
    then draft_logits / draft_lse may be None); draft_logits [R, gamma, V]; draft_lse [R, gamma].
    coupled [R] bool or uint8 (None: all false): requests accepted by the Gumbel-coupled rule,
    whose round_ holds the number of tokens they emitted so far.
    target_logits may be 16-bit under float32 draft_logits (a 16-bit model's verify output as it
    is: the kernels widen it on load, exactly as a cast would, and read half the bytes).
    token_bitmask [N, ceil(V / 32)] int32 (None: no grammar): the tokens allowed at each target
    row (bit v % 32 of word v // 32, xgrammar's layout), applied as the rows are read: the
    acceptance, residual and bonus all use P' = P * mask / Z; a row with no allowed token fails.
    Returns (num_accepted [R] int32, out_tokens [R, gamma + 1] int64, -1 padded, failed [R] bool:
    one of the request's rows holds NaN or +inf, so its tokens mean nothing and it fails alone).
    """
    op = "rejection_sample"
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 2:
        if foreign(target_logits):
            return arrays.call(rejection_sample, locals())
        fail(op, "target_logits must be a [N, V] tensor")
    dev = target_logits.device
    fdt = target_logits.dtype
    if fdt not in door.float_dtypes("reference"):
        fail(op, f"target_logits must be a float tensor, got {fdt}")
    target_logits = target_logits.contiguous()
    N, V = target_logits.shape
    cu_rows = tensor(op, "cu_rows", cu_rows, dtype=torch.int32, ndim=1, device=dev)
    R = cu_rows.shape[0] - 1
    if R < 0:
        fail(op, "cu_rows must have R + 1 >= 1 entries")
    if draft_tokens is None:
        draft_tokens = torch.empty(R, 0, dtype=torch.int64, device=dev)
    draft_tokens = tensor(op, "draft_tokens", draft_tokens, dtype=torch.int64, ndim=2, device=dev)
    gamma = draft_tokens.shape[1]
    tensor(op, "draft_tokens", draft_tokens, shape=(R, gamma))
    int_range(op, "draft_tokens", draft_tokens, 0, V)
    ddt = None
    if gamma:
        draft_logits = tensor(op, "draft_logits", draft_logits, shape=(R, gamma, V), device=dev)
        ddt = draft_logits.dtype
    be = _rejection_backend(dev, backend, fdt, ddt)
    ddt = ddt or (torch.float32 if fdt.itemsize == 2 else fdt)  # what drafts would be
    lse_dt = torch.float64 if ddt == torch.float64 else torch.float32
    if gamma:
        draft_lse = tensor(op, "draft_lse", draft_lse, dtype=lse_dt, shape=(R, gamma), device=dev)
    h_cu = values(cu_rows)
    if h_cu is not None and R > 0:
        n = h_cu[1:] - h_cu[:-1]
        if int(h_cu[0]) != 0 or int(h_cu[-1]) > N or int(n.min()) < 1 or int(n.max()) > gamma + 1:
            fail(op, f"cu_rows must start at 0, end at most at N={N} and give each request "
                     f"1..gamma+1={gamma + 1} rows, got {h_cu.tolist()}")
    temperature = temperatures(op, temperature, R, dev)
    seed = tensor(op, "seed", seed, dtype=torch.int64, shape=(R,), device=dev)
    stream = tensor(op, "stream", stream, dtype=torch.int64, shape=(R,), device=dev)
    round_ = tensor(op, "round_", round_, dtype=torch.int64, shape=(R,), device=dev)
    coupled = coupled_flags(op, coupled, R, dev)
    mask = _token_bitmask(op, token_bitmask, N, V, dev)
    if be == "reference":
        return reference.rejection_sample(target_logits, cu_rows, draft_tokens, draft_logits,
                                          draft_lse, temperature, seed, stream, round_, coupled,
                                          mask)
    # No fills: both kernels write every element of all three for every request, -1 padding
    # included (cpp: RequestImpl; cuda: DecideKernel's block 0, malformed rows too, then
    # FinishKernel's residual token); an error raises before anything is returned.
    num_acc = torch.empty(R, dtype=torch.int32, device=dev)
    out = torch.empty(R, gamma + 1, dtype=torch.int64, device=dev)
    failed = torch.empty(R, dtype=torch.bool, device=dev)
    p = ext.RejectionSampleParams()
    p.R, p.gamma, p.V = R, gamma, V
    p.dtype = DTYPE_CODE[fdt]
    p.draft_dtype = DTYPE_CODE[ddt]
    p.lse_dtype = DTYPE_CODE[lse_dt]
    p.target_logits, p.cu_rows, p.draft_tokens = ptr(target_logits), ptr(cu_rows), ptr(draft_tokens)
    p.draft_logits = ptr(draft_logits) if gamma else 0
    p.draft_lse = ptr(draft_lse) if gamma else 0
    p.temperature, p.seed, p.stream, p.round = ptr(temperature), ptr(seed), ptr(stream), ptr(round_)
    p.coupled, p.token_bitmask = ptr(coupled), ptr(mask)
    p.num_accepted, p.out_tokens, p.failed = ptr(num_acc), ptr(out), ptr(failed)
    door.run("rejection_sample", p, be, dev)
    return num_acc, out, failed
