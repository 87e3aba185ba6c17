"""markov_sample: the sequential drafting stage (DESIGN §2 step 2) behind the door, and which
backend takes which (logits, weights) dtype pair.

One op/argument pair has no kernel: the rnn head on CUDA tensors runs the reference by default
(_markov_backend, the only such routing); so does a (logits, weights) dtype pair a kernel lacks.
"""
import torch

from . import arrays, door, reference
from .door import DTYPE_CODE, ext, ptr
from ._check import coupled_flags, fail, foreign, int_range, temperatures, tensor
from ._check import token_bitmask as _token_bitmask

HEADS = reference.HEADS
CUDA_SELECT_MAX_TOP_K = 256  # csrc/cuda/markov_select.cuh kSelectMaxTopK


# markov_sample's weight dtype (hidden and head weights) may be narrower than its logits dtype:
# (logits, weights) pairs each backend takes besides equal dtypes.
_MARKOV_MIXED = {
    "reference": {(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                  (torch.float64, torch.bfloat16), (torch.float64, torch.float16)},
    "cpp": {(torch.float32, torch.bfloat16)},
    "cuda": {(torch.float32, torch.bfloat16), (torch.float32, torch.float16)},
}


def _markov_backend(device: torch.device, backend, dtype, head, weight_dtype=None, arg="logits"):
    """markov_sample's backend: door.pick's for the logits dtype, falling back by default to the
    reference where the kernel does not take the (logits, weights) dtype pair, and routing by
    default the rnn head on CUDA tensors to the reference. The CUDA kernel has no rnn path (its
    state update is a 3r x (2r + d) matvec per step and request, left to the reference's GEMMs);
    the reference is the semantics itself, on the same device, so the output does not change,
    only its speed (and it reads the device, so CUDA graphs keep rnn drafts eager: graphs.py).
    An explicit backend="cuda" still reaches the kernel, which refuses the rnn head."""
    op = "markov_sample"
    wdt = dtype if weight_dtype is None else weight_dtype
    be = door.pick(op, device, backend, dtype, arg)
    takes = lambda b: wdt == dtype or (dtype, wdt) in _MARKOV_MIXED[b]
    if not takes("reference"):
        fail(op, f"hidden and head weights ({wdt}) cannot serve {dtype} logits: the weight "
                 f"dtype must be the logits dtype or a 16-bit type under float32/float64 logits")
    chosen = backend is not None or door.forced()
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
    out = tensor(op, "out", out, shape=tuple(logits.shape), device=logits.device, written=True)
    if out.data_ptr() == logits.data_ptr() and out.dtype == logits.dtype:
        return logits
    lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    ulo, uhi = logits.data_ptr(), logits.data_ptr() + logits.numel() * logits.element_size()
    if lo < uhi and ulo < hi:
        fail(op, "out must not overlap logits (pass out=logits, or None, to work in place)")
    return out


def markov_sample(logits, hidden, anchor, head, *, w1=None, w2=None, gate_w=None, gate_b=None,
                  joint_w=None, joint_b=None, conf_w=None, conf_b=None, temperature, seed,
                  stream, round_, coupled=None, top_k=None, out=None, token_bitmask=None,
                  backend=None):
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
    is in place. token_bitmask [R, ceil(V / 32)] int32 (None: no grammar): the tokens a grammar
    allows at draft position 1 (xgrammar's layout); z_1 is -inf elsewhere, so x_1, its logprob
    and lse describe the masked proposal. Returns (tokens [R, gamma] int64, logprob, lse, conf_logit [R, gamma]).
    """
    op = "markov_sample"
    if head not in HEADS:
        fail(op, f"head must be one of {HEADS}, got {head!r}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        if foreign(logits):
            return arrays.call(markov_sample, locals())
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
        if be == "cuda" and backend is None and top_k > CUDA_SELECT_MAX_TOP_K:
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
    temperature = temperatures(op, temperature, R, dev)
    seed = tensor(op, "seed", seed, dtype=torch.int64, shape=(R,), device=dev)
    stream = tensor(op, "stream", stream, dtype=torch.int64, shape=(R,), device=dev)
    round_ = tensor(op, "round_", round_, dtype=torch.int64, shape=(R,), device=dev)
    coupled = coupled_flags(op, coupled, R, dev)
    mask = _token_bitmask(op, token_bitmask, R, V, dev)
    if be == "reference":
        if z is not logits:
            z.copy_(logits)  # exact: a 16-bit U widens without rounding
        return reference.markov_sample(z, hidden, anchor, head, w1, w2, gate_w, gate_b,
                                       joint_w, joint_b, conf_w, conf_b, temperature, seed,
                                       stream, round_, coupled, top_k, mask)
    out_dt = torch.float64 if fdt == torch.float64 else torch.float32
    tokens = torch.empty(R, gamma, dtype=torch.int64, device=dev)
    logprob, lse = torch.empty(R, gamma, dtype=out_dt, device=dev), torch.empty(R, gamma, dtype=out_dt, device=dev)
    # conf_logit without a confidence head is 0: the cpp kernel writes the zeros itself, the CUDA
    # kernels write conf_logit only for a head (every row then), so that case alone is filled.
    conf = (torch.zeros if be == "cuda" and conf_w is None else torch.empty)(
        R, gamma, dtype=out_dt, device=dev)
    p = ext.MarkovSampleParams()
    p.R, p.gamma, p.V, p.rank, p.d = R, gamma, V, rank, d
    p.head, p.top_k = HEADS.index(head), top_k or 0
    p.confidence, p.confidence_markov = conf_w is not None, conf_markov
    p.dtype, p.weight_dtype, p.out_dtype = DTYPE_CODE[fdt], DTYPE_CODE[wdt], DTYPE_CODE[out_dt]
    p.logits, p.hidden, p.anchor = ptr(z), ptr(hidden), ptr(anchor)
    if z is not logits:
        p.u, p.u_dtype = ptr(logits), DTYPE_CODE[logits.dtype]
    p.w1, p.w2, p.gate_w, p.gate_b = ptr(w1), ptr(w2), ptr(gate_w), ptr(gate_b)
    p.joint_w, p.joint_b, p.conf_w, p.conf_b = ptr(joint_w), ptr(joint_b), ptr(conf_w), ptr(conf_b)
    p.temperature, p.seed, p.stream, p.round = ptr(temperature), ptr(seed), ptr(stream), ptr(round_)
    p.coupled, p.token_bitmask = ptr(coupled), ptr(mask)
    p.tokens, p.logprob, p.lse, p.conf_logit = ptr(tokens), ptr(logprob), ptr(lse), ptr(conf)
    door.run("markov_sample", p, be, dev)
    return tokens, logprob, lse, conf
