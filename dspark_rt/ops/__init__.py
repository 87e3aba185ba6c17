"""The single Python door to the kernels.

Each op checks its tensors once, by name (dtype, device, shape, contiguity, index ranges), picks
a backend and hands raw pointers, sizes and the current stream to the extension. Backends:
"reference" (ops/reference.py, plain PyTorch, the ground truth), "cpp" (C++ CPU kernels) and
"cuda". The default follows the tensors' device; DSPARK_BACKEND=reference forces the reference.
One op/argument pair has no kernel: markov_sample with head "rnn" on CUDA tensors runs the
reference by default (_markov_backend, the only such routing); so does a (logits, weights) dtype
pair a kernel lacks, as any dtype a kernel lacks does.
verify_attention follows FlashInfer's plan/run: plan_verify_attention once per forward, then
every layer's verify_attention(..., plan=plan).
"""
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from . import reference
from ._check import OpError, fail, int_range, tensor, values

try:
    from .. import _C  # type: ignore[attr-defined]
except ImportError:  # the package can be imported (and tested) without the extension
    _C = None

__all__ = ["linear", "exact_mode", "markov_sample", "rejection_sample", "prefix_topk", "verify_attention", "append_kv",
           "plan_verify_attention", "VerifyAttentionPlan", "OpError",
           "available_backends", "HEADS"]

HEADS = reference.HEADS
_DTYPE_CODE = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_CPU_DTYPES = (torch.float32, torch.float64)
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def available_backends():
    return list(_AVAILABLE)


def _available() -> tuple:
    """The backends this build has (fixed at import: every op call asks)."""
    out = ["reference"]
    if _C is not None:
        out.append("cpp")
        if _C.build_info().get("cuda"):
            out.append("cuda")
    return tuple(out)


_AVAILABLE = _available()


def _backend(op, device: torch.device, backend, dtype, arg="dtype", dtypes=None):
    """The requested backend, or by default the fastest one that takes this device and dtype
    (most C++ kernels take float32/float64 only: a bf16 call of those runs the reference).
    dtypes: the op's backend -> float dtypes map, when it is not _float_dtypes."""
    dtypes = dtypes or _float_dtypes
    if backend is None:
        forced = os.environ.get("DSPARK_BACKEND")
        if forced:
            backend = forced
        else:
            backend = "cuda" if device.type == "cuda" else "cpp"
            if backend not in available_backends() or (dtype is not None and
                                                        dtype not in dtypes(backend)):
                backend = "reference"
    if backend not in ("reference", "cpp", "cuda"):
        fail(op, f"backend must be 'reference', 'cpp' or 'cuda', got {backend!r}")
    if backend != "reference" and backend not in available_backends():
        fail(op, f"backend {backend!r} is not available in this build ({available_backends()})")
    if backend != "reference" and (backend == "cuda") != (device.type == "cuda"):
        fail(op, f"backend {backend!r} cannot run tensors on {device}")
    if dtype is not None and dtype not in dtypes(backend):
        fail(op, f"{arg} dtype {dtype} is not supported by backend {backend!r} "
                 f"(it takes {[str(d) for d in dtypes(backend)]})")
    return backend


# markov_sample's weight dtype (hidden and head weights) may be narrower than its logits dtype:
# (logits, weights) pairs each backend takes besides equal dtypes.
_MARKOV_MIXED = {
    "reference": {(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                  (torch.float64, torch.bfloat16), (torch.float64, torch.float16)},
    "cpp": {(torch.float32, torch.bfloat16)},
    "cuda": {(torch.float32, torch.bfloat16), (torch.float32, torch.float16)},
}


def _markov_backend(device: torch.device, backend, dtype, head, weight_dtype=None, arg="logits"):
    """markov_sample's backend: _backend's for the logits dtype, falling back by default to the
    reference where the kernel does not take the (logits, weights) dtype pair, and routing by
    default the rnn head on CUDA tensors to the reference. The CUDA kernel has no rnn path (its
    state update is a 3r x (2r + d) matvec per step and request, left to the reference's GEMMs);
    the reference is the semantics itself, on the same device, so the output does not change,
    only its speed (and it reads the device, so CUDA graphs keep rnn drafts eager: graphs.py).
    An explicit backend="cuda" still reaches the kernel, which refuses the rnn head."""
    op = "markov_sample"
    wdt = dtype if weight_dtype is None else weight_dtype
    be = _backend(op, device, backend, dtype, arg)
    takes = lambda b: wdt == dtype or (dtype, wdt) in _MARKOV_MIXED[b]
    if not takes("reference"):
        fail(op, f"hidden and head weights ({wdt}) cannot serve {dtype} logits: the weight "
                 f"dtype must be the logits dtype or a 16-bit type under float32/float64 logits")
    chosen = backend is not None or bool(os.environ.get("DSPARK_BACKEND"))
    if not takes(be):
        if chosen:
            fail(op, f"backend {be!r} does not take {wdt} hidden and weights with {dtype} logits "
                     f"(it takes equal dtypes and {sorted(str(w) for c, w in _MARKOV_MIXED[be] if c == dtype)})")
        be = "reference"
    if backend is None and head == "rnn" and be == "cuda":
        return "reference"
    return be


def _markov_out(op, logits, out):
    """The tensor markov_sample writes z into: logits itself (out None, or out is logits), or
    out, checked: contiguous, logits' shape and device, no overlap with logits."""
    if out is None:
        return logits
    if isinstance(out, torch.Tensor) and not out.is_contiguous():
        fail(op, "out must be contiguous (z is written into it)")
    out = tensor(op, "out", out, shape=tuple(logits.shape), device=logits.device)
    if out.data_ptr() == logits.data_ptr() and out.dtype == logits.dtype:
        return logits
    lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    ulo, uhi = logits.data_ptr(), logits.data_ptr() + logits.numel() * logits.element_size()
    if lo < uhi and ulo < hi:
        fail(op, "out must not overlap logits (pass out=logits, or None, to work in place)")
    return out


_CUDA_SELECT_MAX_TOP_K = 256  # csrc/cuda/markov_select.cuh kSelectMaxTopK


def _coupled(op, coupled, R, dev):
    """The optional per-request coupled flags [R] (bool or uint8; None: all false)."""
    if coupled is None:
        return None
    return tensor(op, "coupled", coupled, dtypes=(torch.bool, torch.uint8), shape=(R,), device=dev)


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
    no drafts, the target dtype alone): _backend's, falling back by default to the reference
    where the kernel does not take the pair."""
    op = "rejection_sample"
    takes = lambda b: ((ddt in (None, tdt) and tdt in _float_dtypes(b))
                       or (tdt, ddt or torch.float32) in _REJECTION_MIXED[b])
    if not takes("reference"):
        fail(op, f"draft_logits dtype {ddt} cannot serve {tdt} target logits: it must be the "
                 f"target's dtype, or float32 under 16-bit target logits")
    be = _backend(op, device, backend, None)
    if not takes(be):
        if backend is not None or os.environ.get("DSPARK_BACKEND"):
            fail(op, f"backend {be!r} does not take target_logits dtype {tdt} with draft_logits "
                     f"dtype {ddt} (it takes {[str(d) for d in _float_dtypes(be)]} with equal "
                     f"draft dtypes and {sorted(f'{t} with {d}' for t, d in _REJECTION_MIXED[be])})")
        be = "reference"
    return be


def takes_narrow_target(device, dtype) -> bool:
    """Whether rejection_sample's default backend for `device` takes target logits of the 16-bit
    `dtype` under float32 drafts in its kernel (else a caller had better widen them first: the
    fallback is the reference)."""
    be = _backend("rejection_sample", torch.device(device), None, None)
    return be != "reference" and (dtype, torch.float32) in _REJECTION_MIXED[be]


def _float_dtypes(backend):
    if backend == "reference":
        return (*_CPU_DTYPES, torch.float16, torch.bfloat16)
    return _CUDA_DTYPES if backend == "cuda" else _CPU_DTYPES


def _all_float_dtypes(backend):
    """The dtypes of ops whose C++ kernel also takes 16-bit inputs (linear, verify_attention)."""
    return _CUDA_DTYPES if backend == "cuda" else (*_CPU_DTYPES, torch.float16, torch.bfloat16)


def _run(op_name, params, backend, device):
    stream = torch.cuda.current_stream(device).cuda_stream if backend == "cuda" else 0
    getattr(_C, op_name)(params, backend, stream)


def _temperatures(op, temperature, R, dev):
    """[R] float32, finite and >= 0 (0: greedy). Values are checked on host tensors only (a check
    on the device would synchronise), or under DSPARK_CHECK_OPS=1."""
    t = tensor(op, "temperature", temperature, dtype=torch.float32, shape=(R,), device=dev)
    h = values(t)
    if h is not None and h.numel() and not bool((torch.isfinite(h) & (h >= 0)).all()):
        fail(op, f"temperature values must be finite and >= 0, got {h.tolist()[:8]}")
    return t


def _ptr(t):
    return 0 if t is None else t.data_ptr()


def markov_sample(logits, hidden, anchor, head, *, w1=None, w2=None, gate_w=None, gate_b=None,
                  joint_w=None, joint_b=None, conf_w=None, conf_b=None, temperature, seed,
                  stream, round_, coupled=None, top_k=None, out=None, backend=None):
    """Sequential drafting stage; see reference.markov_sample for the semantics.

    head "selector" (DFlash2's candidate selector) takes gate_w [rank, d] (no gate_b) and top_k,
    an int in [1, V].

    Dtypes: logits (float32, float64, or 16-bit on CUDA) set the compute dtype; hidden and every
    head weight share the weight dtype, the logits' or a 16-bit type under float32 logits (a
    bf16 model: bf16 hidden and weights, float32 logits; the CUDA kernel takes its tensor-core
    path). A weight of another dtype than hidden is an error naming it.

    coupled [R] bool or uint8 (None: all false): Gumbel-coupled requests, whose round_ holds the
    number of tokens they emitted so far (DESIGN §2, coupled sampling).

    logits [R, gamma, V] is overwritten with the corrected logits z = U + bias (pass a clone to
    keep U), or, given out [R, gamma, V], only read: z is written into out, whose dtype is then
    the compute dtype, and logits may also be in the 16-bit weight dtype under float32 out (a
    16-bit model's LM head output as it is, widened exactly on load: no cast pass). out=logits
    is in place. Returns (tokens [R, gamma] int64, logprob, lse, conf_logit [R, gamma]).
    """
    op = "markov_sample"
    if head not in HEADS:
        fail(op, f"head must be one of {HEADS}, got {head!r}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        fail(op, f"logits must be a [R, gamma, V] tensor, got "
                 f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)}")
    R, gamma, V = logits.shape
    if V < 1:
        fail(op, f"logits must have a vocabulary of V >= 1, got shape {tuple(logits.shape)}")
    dev = logits.device
    z = _markov_out(op, logits, out)
    if not logits.is_contiguous():
        fail(op, "logits must be contiguous" + (" (it is written in place)" if z is logits else ""))
    fdt = z.dtype  # the compute dtype
    hidden = tensor(op, "hidden", hidden, ndim=3, device=dev)
    wdt = hidden.dtype  # the weight dtype: hidden's, shared by every head weight
    if logits.dtype not in (fdt, wdt):
        fail(op, f"logits ({logits.dtype}) must be in out's dtype ({fdt}) or, a 16-bit model's, "
                 f"in the weight dtype ({wdt})")
    be = _markov_backend(dev, backend, fdt, head, wdt, "logits" if z is logits else "out")
    d = hidden.shape[2]
    tensor(op, "hidden", hidden, shape=(R, gamma, d))
    anchor = tensor(op, "anchor", anchor, dtype=torch.int64, shape=(R,), device=dev)
    int_range(op, "anchor", anchor, 0, V)
    rank = 0
    if head != "none" or (conf_w is not None and w1 is not None):
        if w1 is None or w2 is None:
            fail(op, f"head {head!r} needs w1 and w2")
        w1 = tensor(op, "w1", w1, dtype=wdt, ndim=2, device=dev)
        rank = w1.shape[1]
        if rank < 1:
            fail(op, f"w1 must have a Markov rank >= 1 (shape [V, rank]), got {tuple(w1.shape)}")
        w1 = tensor(op, "w1", w1, shape=(V, rank))
        w2 = tensor(op, "w2", w2, dtype=wdt, shape=(V, rank), device=dev)
    if head == "selector":
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= V:
            fail(op, f"head 'selector' needs top_k, an int in [1, V={V}], got {top_k!r}")
        gate_w = tensor(op, "gate_w", gate_w, dtype=wdt, shape=(rank, d), device=dev)
        if be == "cuda" and backend is None and top_k > _CUDA_SELECT_MAX_TOP_K:
            be = "reference"  # the kernel keeps its candidate lists in registers
    elif top_k is not None:
        fail(op, f"top_k is only for head 'selector', got top_k={top_k!r} with head {head!r}")
    if head == "gated":
        gate_w = tensor(op, "gate_w", gate_w, dtype=wdt, shape=(rank, d + rank), device=dev)
        gate_b = tensor(op, "gate_b", gate_b, dtype=wdt, shape=(rank,), device=dev)
    if head == "rnn":
        joint_w = tensor(op, "joint_w", joint_w, dtype=wdt, shape=(3 * rank, 2 * rank + d),
                         device=dev)
        joint_b = tensor(op, "joint_b", joint_b, dtype=wdt, shape=(3 * rank,), device=dev)
    conf_markov = False
    if conf_w is not None:
        conf_w = tensor(op, "conf_w", conf_w, dtype=wdt, ndim=1, device=dev)
        conf_markov = conf_w.shape[0] != d
        if conf_markov and (rank == 0 or conf_w.shape[0] != d + rank):
            fail(op, f"conf_w must have {d} entries (or {d} + rank with w1), got {conf_w.shape[0]}")
        conf_b = tensor(op, "conf_b", conf_b, dtype=wdt, shape=(1,), device=dev)
    temperature = _temperatures(op, temperature, R, dev)
    seed = tensor(op, "seed", seed, dtype=torch.int64, shape=(R,), device=dev)
    stream = tensor(op, "stream", stream, dtype=torch.int64, shape=(R,), device=dev)
    round_ = tensor(op, "round_", round_, dtype=torch.int64, shape=(R,), device=dev)
    coupled = _coupled(op, coupled, R, dev)
    if be == "reference":
        if z is not logits:
            z.copy_(logits)  # exact: a 16-bit U widens without rounding
        return reference.markov_sample(z, hidden, anchor, head, w1, w2, gate_w, gate_b,
                                       joint_w, joint_b, conf_w, conf_b, temperature, seed,
                                       stream, round_, coupled, top_k)
    out_dt = torch.float64 if fdt == torch.float64 else torch.float32
    tokens = torch.empty(R, gamma, dtype=torch.int64, device=dev)
    logprob, lse = torch.empty(R, gamma, dtype=out_dt, device=dev), torch.empty(R, gamma, dtype=out_dt, device=dev)
    conf = torch.zeros(R, gamma, dtype=out_dt, device=dev)
    p = _C.MarkovSampleParams()
    p.R, p.gamma, p.V, p.rank, p.d = R, gamma, V, rank, d
    p.head, p.top_k = HEADS.index(head), top_k or 0
    p.confidence, p.confidence_markov = conf_w is not None, conf_markov
    p.dtype, p.weight_dtype, p.out_dtype = _DTYPE_CODE[fdt], _DTYPE_CODE[wdt], _DTYPE_CODE[out_dt]
    p.logits, p.hidden, p.anchor = _ptr(z), _ptr(hidden), _ptr(anchor)
    if z is not logits:
        p.u, p.u_dtype = _ptr(logits), _DTYPE_CODE[logits.dtype]
    p.w1, p.w2, p.gate_w, p.gate_b = _ptr(w1), _ptr(w2), _ptr(gate_w), _ptr(gate_b)
    p.joint_w, p.joint_b, p.conf_w, p.conf_b = _ptr(joint_w), _ptr(joint_b), _ptr(conf_w), _ptr(conf_b)
    p.temperature, p.seed, p.stream, p.round = _ptr(temperature), _ptr(seed), _ptr(stream), _ptr(round_)
    p.coupled = _ptr(coupled)
    p.tokens, p.logprob, p.lse, p.conf_logit = _ptr(tokens), _ptr(logprob), _ptr(lse), _ptr(conf)
    _run("markov_sample", p, be, dev)
    return tokens, logprob, lse, conf


def rejection_sample(target_logits, cu_rows, draft_tokens, draft_logits, draft_lse, *,
                     temperature, seed, stream, round_, coupled=None, backend=None):
    """Lossless acceptance; see reference.rejection_sample for the semantics.

    target_logits [N, V]; cu_rows [R + 1] int32 (rows past cu_rows[R] belong to no request: the
    padding of a verify batch whose lengths stayed on the device); draft_tokens [R, gamma] int64 (gamma may be 0,
    then draft_logits / draft_lse may be None); draft_logits [R, gamma, V]; draft_lse [R, gamma].
    coupled [R] bool or uint8 (None: all false): requests accepted by the Gumbel-coupled rule,
    whose round_ holds the number of tokens they emitted so far.
    target_logits may be 16-bit under float32 draft_logits (a 16-bit model's verify output as it
    is: the kernels widen it on load, exactly as a cast would, and read half the bytes).
    Returns (num_accepted [R] int32, out_tokens [R, gamma + 1] int64, -1 padded, failed [R] bool:
    one of the request's rows holds NaN or +inf, so its tokens mean nothing and it fails alone).
    """
    op = "rejection_sample"
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 2:
        fail(op, "target_logits must be a [N, V] tensor")
    dev = target_logits.device
    fdt = target_logits.dtype
    if fdt not in _float_dtypes("reference"):
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
    temperature = _temperatures(op, temperature, R, dev)
    seed = tensor(op, "seed", seed, dtype=torch.int64, shape=(R,), device=dev)
    stream = tensor(op, "stream", stream, dtype=torch.int64, shape=(R,), device=dev)
    round_ = tensor(op, "round_", round_, dtype=torch.int64, shape=(R,), device=dev)
    coupled = _coupled(op, coupled, R, dev)
    if be == "reference":
        return reference.rejection_sample(target_logits, cu_rows, draft_tokens, draft_logits,
                                          draft_lse, temperature, seed, stream, round_, coupled)
    num_acc = torch.zeros(R, dtype=torch.int32, device=dev)
    out = torch.full((R, gamma + 1), -1, dtype=torch.int64, device=dev)
    failed = torch.empty(R, dtype=torch.bool, device=dev)
    p = _C.RejectionSampleParams()
    p.R, p.gamma, p.V = R, gamma, V
    p.dtype = _DTYPE_CODE[fdt]
    p.draft_dtype = _DTYPE_CODE[ddt]
    p.lse_dtype = _DTYPE_CODE[lse_dt]
    p.target_logits, p.cu_rows, p.draft_tokens = _ptr(target_logits), _ptr(cu_rows), _ptr(draft_tokens)
    p.draft_logits = _ptr(draft_logits) if gamma else 0
    p.draft_lse = _ptr(draft_lse) if gamma else 0
    p.temperature, p.seed, p.stream, p.round = _ptr(temperature), _ptr(seed), _ptr(stream), _ptr(round_)
    p.coupled = _ptr(coupled)
    p.num_accepted, p.out_tokens, p.failed = _ptr(num_acc), _ptr(out), _ptr(failed)
    _run("rejection_sample", p, be, dev)
    return num_acc, out, failed


def prefix_topk(survival, K: int, *, backend=None):
    """Verify lengths of the top-K candidates; see reference.prefix_topk. Returns [R] int32."""
    op = "prefix_topk"
    survival = tensor(op, "survival", survival, dtype=torch.float32, ndim=2)
    if isinstance(K, bool) or not isinstance(K, int) or K < 0:
        fail(op, f"K must be a non-negative int, got {K!r}")
    K = min(K, survival.numel())  # more than every candidate admits every candidate
    dev = survival.device
    be = _backend(op, dev, backend, None)
    if be == "reference":
        return reference.prefix_topk(survival, K)
    R, gamma = survival.shape
    lengths = torch.zeros(R, dtype=torch.int32, device=dev)
    p = _C.PrefixTopkParams()
    p.R, p.gamma, p.K = R, gamma, K
    p.survival, p.lengths = _ptr(survival), _ptr(lengths)
    _run("prefix_topk", p, be, dev)
    return lengths


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
    work: torch.Tensor | None = None      # int32 [4 (R + 1)] item_off | split | slot_off | merge_off
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
    p = _C.VerifyAttentionParams()
    p.R, p.h_q, p.h_kv, p.head_dim = R, h_q, h_kv, hd
    p.page_size, p.num_pages = page_size, num_pages
    p.dtype, p.causal, p.window = _DTYPE_CODE[dtype], bool(causal), window
    p.batch_invariant = (_batch_invariant(k_cache.device) if batch_invariant is None
                         else batch_invariant)
    return p


def exact_mode(device) -> bool:
    """Whether the target's forward on `device` runs row-invariant (DESIGN §6): ops.linear for
    every projection and verify_attention without batch-dependent splits, so speculative greedy
    output equals plain greedy output bit for bit in every dtype. DSPARK_EXACT=1 / 0 forces it;
    by default on for the CPU (where it is measured no slower) and off on CUDA until a GPU run
    has measured its cost (README, "Exactness")."""
    env = os.environ.get("DSPARK_EXACT")
    if env is None or env == "":
        return device.type == "cpu" if isinstance(device, torch.device) \
            else torch.device(device).type == "cpu"
    if env not in ("0", "1"):
        raise ValueError(f"DSPARK_EXACT must be 0 or 1, got {env!r}")
    return env == "1"


def _batch_invariant(device):
    """verify_attention never splits the KV range on CUDA, so a request's result is
    bit-identical whatever else is in the batch and however many rows its chain has: under
    exact mode, or DSPARK_ATTN_BATCH_INVARIANT=1."""
    return (os.environ.get("DSPARK_ATTN_BATCH_INVARIANT", "0") not in ("", "0")
            or exact_mode(device))


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
        fail(op, "k_cache must be a [num_pages, page_size, h_kv, head_dim] tensor")
    dev, fdt = k_cache.device, k_cache.dtype
    be = _backend(op, dev, backend, fdt, "k_cache", _all_float_dtypes)
    h_kv = k_cache.shape[2]
    if not isinstance(h_q, int) or h_kv == 0 or h_q < 1 or h_q % h_kv:
        fail(op, f"h_q={h_q!r} must be a positive multiple of h_kv={h_kv}")
    window = _window(op, window)
    cu_q, kv_lens, block_tables = _attention_meta(op, cu_q, kv_lens, block_tables, k_cache, None, dev)
    invariant = _batch_invariant(dev)
    plan = dict(backend=be, cu_q=cu_q, kv_lens=kv_lens, block_tables=block_tables, h_q=h_q,
                k_shape=tuple(k_cache.shape), dtype=fdt, causal=bool(causal), window=window,
                batch_invariant=invariant)
    if be == "cuda":
        R, hd = cu_q.shape[0] - 1, k_cache.shape[3]
        p = _attention_params(R, h_q, k_cache, fdt, causal, window, invariant)
        p.max_pages = block_tables.shape[1]
        p.cu_q, p.kv_lens = _ptr(cu_q), _ptr(kv_lens)
        stream = torch.cuda.current_stream(dev).cuda_stream
        slots = _C.verify_attention_plan_slots(p, stream)
        if slots and R > 0:  # the tensor-core path: partition and partials for every layer
            work = torch.empty(4 * (R + 1), dtype=torch.int32, device=dev)
            part_o = torch.empty(slots, 64, hd, dtype=torch.float32, device=dev)
            part_lse = torch.empty(slots, 64, dtype=torch.float32, device=dev)
            p.work, p.part_o, p.part_lse, p.plan_slots = _ptr(work), _ptr(part_o), _ptr(part_lse), slots
            _C.verify_attention_plan(p, stream)
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
    if plan.batch_invariant != _batch_invariant(k_cache.device):
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
        fail(op, "q must be a [N, h_q, head_dim] tensor")
    dev = q.device
    fdt = q.dtype
    be = plan.backend if isinstance(plan, VerifyAttentionPlan) and backend is None else backend
    be = _backend(op, dev, be, fdt, "q", _all_float_dtypes)
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
        if isinstance(out, torch.Tensor) and not out.is_contiguous():
            fail(op, "out must be contiguous (it is written in place)")
        out = tensor(op, "out", out, dtype=fdt, shape=(N, h_q, hd), device=dev)
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
    p.q, p.cu_q, p.k_cache, p.v_cache = _ptr(q), _ptr(cu_q), _ptr(k_cache), _ptr(v_cache)
    p.block_tables, p.kv_lens, p.out = _ptr(block_tables), _ptr(kv_lens), _ptr(out)
    if plan is not None and plan.work is not None:
        p.work, p.part_o, p.part_lse = _ptr(plan.work), _ptr(plan.part_o), _ptr(plan.part_lse)
        p.plan_slots = plan.part_o.shape[0]
    _run("verify_attention", p, be, dev)
    return out


_HAS_CPP = "cpp" in _AVAILABLE


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
        code = _DTYPE_CODE.get(x.dtype)
        if code is not None and x.shape[-1] == K:
            # every check of the full path below holds: launch without the params object (the
            # door is crossed for every projection of every forward)
            lead = x.shape[:-1]
            res = torch.empty((*lead, N), dtype=x.dtype)
            _C.linear_contiguous(x.data_ptr(), w.data_ptr(), res.data_ptr(), math.prod(lead), N,
                                 K, code, "cpp", 0)
            return res
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        fail(op, "x must be a [..., K] tensor")
    dev, fdt = x.device, x.dtype
    be = _backend(op, dev, backend, fdt, "x", _all_float_dtypes)
    w = tensor(op, "w", w, dtype=fdt, ndim=2, device=dev)
    N, K = w.shape
    if x.shape[-1] != K:
        fail(op, f"x must have K={K} columns (w is {tuple(w.shape)}), got shape {tuple(x.shape)}")
    lead = tuple(x.shape[:-1])
    if out is not None:
        if isinstance(out, torch.Tensor) and not out.is_contiguous():
            fail(op, "out must be contiguous (it is written in place)")
        out = tensor(op, "out", out, dtype=fdt, shape=(*lead, N), device=dev)
    if be == "reference":
        res = reference.linear(x, w)
        return res if out is None else out.copy_(res)
    x2 = x.reshape(math.prod(lead), K).contiguous()
    out = torch.empty((*lead, N), dtype=fdt, device=dev) if out is None else out
    p = _C.LinearParams()
    p.M, p.N, p.K = x2.shape[0], N, K
    p.ldx, p.ldw, p.ldo = K, K, N
    p.dtype = _DTYPE_CODE[fdt]
    p.x, p.w, p.out = _ptr(x2), _ptr(w), _ptr(out)
    _run(op, p, be, dev)
    return out


def append_kv(k, v, k_cache, v_cache, slot_mapping, *, backend=None):
    """Writes k, v [N, h_kv, head_dim] into k_cache, v_cache [num_pages, page_size, h_kv,
    head_dim] at slot_mapping [N] int64 (page * page_size + offset; -1 = padding, not written),
    in place; see reference.append_kv. The caches must be contiguous (they are written)."""
    op = "append_kv"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4 or not c.is_contiguous():
            fail(op, f"{name} must be a contiguous [num_pages, page_size, h_kv, head_dim] tensor")
    dev, fdt = k_cache.device, k_cache.dtype
    be = _backend(op, dev, backend, None)
    num_pages, page_size, h_kv, hd = k_cache.shape
    tensor(op, "v_cache", v_cache, dtype=fdt, shape=tuple(k_cache.shape), device=dev)
    slot_mapping = tensor(op, "slot_mapping", slot_mapping, dtype=torch.int64, ndim=1, device=dev)
    N = slot_mapping.shape[0]
    k = tensor(op, "k", k, shape=(N, h_kv, hd), device=dev).to(fdt)
    v = tensor(op, "v", v, shape=(N, h_kv, hd), device=dev).to(fdt)
    int_range(op, "slot_mapping", slot_mapping, -1, num_pages * page_size)
    if be == "reference":
        return reference.append_kv(k, v, k_cache, v_cache, slot_mapping)
    p = _C.AppendKvParams()
    p.N, p.h_kv, p.head_dim, p.page_size, p.num_pages = N, h_kv, hd, page_size, num_pages
    p.dtype = _DTYPE_CODE[fdt]
    p.k, p.v, p.k_cache, p.v_cache = _ptr(k), _ptr(v), _ptr(k_cache), _ptr(v_cache)
    p.slot_mapping = _ptr(slot_mapping)
    _run("append_kv", p, be, dev)
