"""Boundary checks for the ops door: every tensor is checked once, by name.

Value checks (index ranges, lengths) run on host tensors only: on device tensors they would
cost a synchronising copy per call. DSPARK_CHECK_OPS=1 (debugging) runs them on device tensors
too, through such a copy (skipped while a CUDA graph is being captured)."""
import os

import torch


class OpError(ValueError):
    """Bad input to an op; the message names the op and the argument."""


def fail(op: str, msg: str):
    raise OpError(f"{op}: {msg}")


def foreign(a) -> bool:
    """Whether a is another library's array the door views without a copy (ops/arrays.py)."""
    return not isinstance(a, torch.Tensor) and (hasattr(a, "__dlpack__") or
                                                hasattr(a, "__cuda_array_interface__"))


def view(op, name, a):
    """The torch view of argument `name`, a foreign array (the caller's memory, no copy), or an
    OpError naming it: not an array at all, or one its library will not export."""
    if not foreign(a):
        fail(op, f"{name} must be a torch.Tensor (or an array with __dlpack__ or "
                 f"__cuda_array_interface__), got {type(a).__name__}")
    try:
        return torch.from_dlpack(a) if hasattr(a, "__dlpack__") else torch.as_tensor(a)
    except Exception as e:  # the library's own refusal: a dtype DLPack lacks, a read-only array...
        fail(op, f"{name} ({type(a).__module__}.{type(a).__name__}) cannot be viewed as a "
                 f"tensor without a copy: {type(e).__name__}: {e}")


def tensor(op, name, t, *, dtype=None, dtypes=None, shape=None, ndim=None, device=None,
           written=False):
    """Checks a tensor argument (a foreign array is viewed first) and returns it contiguous; one
    the op writes (written=True) must be contiguous already, since a copy would take the write."""
    if not isinstance(t, torch.Tensor):
        t = view(op, name, t)
    if written and not t.is_contiguous():
        fail(op, f"{name} must be contiguous (it is written in place)")
    if dtype is not None and t.dtype != dtype:
        fail(op, f"{name} must be {dtype}, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(op, f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        fail(op, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != x for s, x in zip(shape, t.shape)):
            want = tuple("*" if s is None else s for s in shape)
            fail(op, f"{name} must have shape {want}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        fail(op, f"{name} must be on {device}, got {t.device}")
    return t.contiguous()


def values(t):
    """t on the host when its values may be checked (a host tensor, or any tensor under
    DSPARK_CHECK_OPS=1 outside CUDA-graph capture, where a copy cannot run), else None."""
    if t.device.type == "cpu":
        return t
    if os.environ.get("DSPARK_CHECK_OPS", "0") in ("", "0"):
        return None
    return None if torch.cuda.is_current_stream_capturing() else t.cpu()


def int_range(op, name, t, lo, hi):
    """Values of an integer tensor must lie in [lo, hi). Host tensors only (no device sync)
    unless DSPARK_CHECK_OPS=1."""
    t = values(t)
    if t is not None and t.numel():
        mn, mx = int(t.min()), int(t.max())
        if mn < lo or mx >= hi:
            fail(op, f"{name} values must lie in [{lo}, {hi}), got range [{mn}, {mx}]")


def temperatures(op, temperature, R, dev):
    """[R] float32, finite and >= 0 (0: greedy). Values are checked on host tensors only (a check
    on the device would synchronise), or under DSPARK_CHECK_OPS=1."""
    t = tensor(op, "temperature", temperature, dtype=torch.float32, shape=(R,), device=dev)
    h = values(t)
    if h is not None and h.numel() and not bool((torch.isfinite(h) & (h >= 0)).all()):
        fail(op, f"temperature values must be finite and >= 0, got {h.tolist()[:8]}")
    return t


def coupled_flags(op, coupled, R, dev):
    """The optional per-request coupled flags [R] (bool or uint8; None: all false)."""
    if coupled is None:
        return None
    return tensor(op, "coupled", coupled, dtypes=(torch.bool, torch.uint8), shape=(R,), device=dev)


def token_bitmask(op, mask, rows, V, dev):
    """A grammar's token bitmask [rows, ceil(V / 32)] int32 (bit v % 32 of word v // 32 set: token
    v allowed, xgrammar's layout); None stays None."""
    if mask is None:
        return None
    return tensor(op, "token_bitmask", mask, dtype=torch.int32, shape=(rows, (V + 31) // 32),
                  device=dev)
