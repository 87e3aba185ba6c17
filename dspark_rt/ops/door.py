"""Which backend an op call takes, and the launch.

Backends: "reference" (ops/reference.py, plain PyTorch, the ground truth), "cpp" (C++ CPU
kernels) and "cuda". The default follows the tensors' device and dtype; DSPARK_BACKEND=reference
forces the reference. Every op module calls pick() and run() through this module's attributes,
so a test patches them here (door.available_backends, door.run) and every op sees it.
"""
import os

import torch

from ._check import fail

try:
    import dspark_rt._C as ext  # the extension module (a shared library beside the package)
except ImportError:  # the package can be imported (and tested) without the extension
    ext = None

DTYPE_CODE = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
CPU_DTYPES = (torch.float32, torch.float64)
CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _available() -> tuple:
    """The backends this build has (fixed at import: every op call asks)."""
    out = ["reference"]
    if ext is not None:
        out.append("cpp")
        if ext.build_info().get("cuda"):
            out.append("cuda")
    return tuple(out)


AVAILABLE = _available()


def available_backends():
    return list(AVAILABLE)


def float_dtypes(backend):
    """The float dtypes most kernels take: float32/float64 on the CPU (a bf16 call of those runs
    the reference), 32- and 16-bit on CUDA, all four on the reference."""
    if backend == "reference":
        return (*CPU_DTYPES, torch.float16, torch.bfloat16)
    return CUDA_DTYPES if backend == "cuda" else CPU_DTYPES


def all_float_dtypes(backend):
    """The dtypes of ops whose C++ kernel also takes 16-bit inputs (linear, verify_attention)."""
    return CUDA_DTYPES if backend == "cuda" else (*CPU_DTYPES, torch.float16, torch.bfloat16)


def pick(op, device: torch.device, backend, dtype, arg="dtype", dtypes=None):
    """The requested backend, or by default the fastest one that takes this device and dtype.
    dtypes: the op's backend -> float dtypes map, when it is not float_dtypes."""
    dtypes = dtypes or float_dtypes
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


def forced() -> bool:
    """Whether DSPARK_BACKEND chooses the backend (a default fallback must then be an error)."""
    return bool(os.environ.get("DSPARK_BACKEND"))


def run(op_name, params, backend, device):
    """Launches the extension's op on the current stream (CUDA) or the calling thread (cpp)."""
    stream = torch.cuda.current_stream(device).cuda_stream if backend == "cuda" else 0
    getattr(ext, op_name)(params, backend, stream)


def ptr(t):
    return 0 if t is None else t.data_ptr()
