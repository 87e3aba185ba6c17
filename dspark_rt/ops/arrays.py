"""Arrays of other libraries through the door, in and out without a copy.

Every op takes a CuPy array, or any object with __dlpack__ or __cuda_array_interface__, wherever
it takes a tensor, viewed as a torch tensor (_check.view: torch.from_dlpack, or torch.as_tensor
for __cuda_array_interface__; the caller's memory, so in-place writes land in the caller's array).

The type of the answer follows the op's leading tensor, the one it checks first (logits,
target_logits, survival, q, k_cache, x). When that one is foreign, the op sends its arguments
here (call): every foreign argument is viewed, the op runs on the views, and the tensors it
returns come back in the type of the first foreign argument, through the from_dlpack of its
library (cupy.from_dlpack, numpy.from_dlpack, ...): views again, no copy. When the leading tensor
is torch's, other foreign arguments are viewed where they are checked and the answer is torch's.
A torch caller pays nothing: the test for a foreign array sits where the op already refuses
what is not a tensor.

Torch tensors come back where nothing builds the caller's type without knowing its library: for
an array that offers only __cuda_array_interface__ (Numba's, ...), and for one whose library has
no from_dlpack on its module path. A torch CUDA tensor exposes both protocols itself, so such a
caller wraps it without a copy too.

Streams: DLPack's exchange orders them. torch.from_dlpack hands torch's current stream to the
producer, which makes it wait for the caller's pending work; handing an output back hands the
caller's stream to torch, which makes it wait for the op. An op that returns nothing (append_kv)
hands back its first foreign argument for that wait alone. __cuda_array_interface__ is read
without a stream: that caller orders its stream with torch's current stream itself.
"""
import inspect
import sys

import torch

from ._check import foreign, view

_PARAMS = {}       # op -> its parameter names
_FROM_DLPACK = {}  # array type -> its library's from_dlpack, or None


def call(fn, params: dict):
    """fn(**params) with every foreign argument viewed, its tensors handed back in the type of
    the first foreign one. params: the op's locals() (its arguments, maybe a few more names)."""
    if fn not in _PARAMS:
        _PARAMS[fn] = tuple(inspect.signature(fn).parameters)
    args, first = {}, None
    for name in _PARAMS[fn]:
        a = params[name]
        if foreign(a):
            t = view(fn.__name__, name, a)
            first = first or (a, t)
            a = t
        args[name] = a
    res = fn(**args)
    caller, t = first
    back = _from_dlpack(caller)
    if back is None:
        return res
    if res is None:
        if t.is_cuda:
            back(t)  # in place only: the caller's stream waits for the op (module docstring)
        return None
    return _convert(res, back)


def _from_dlpack(a):
    """The from_dlpack of a's library, the first on its type's module path from the top
    (cupy._core.core.ndarray: cupy.from_dlpack), or None (torch tensors come back)."""
    cls = type(a)
    if cls not in _FROM_DLPACK:
        found = None
        if hasattr(a, "__dlpack__"):
            parts = cls.__module__.split(".")
            for i in range(1, len(parts) + 1):
                f = getattr(sys.modules.get(".".join(parts[:i])), "from_dlpack", None)
                if callable(f):
                    found = f
                    break
        _FROM_DLPACK[cls] = found
    return _FROM_DLPACK[cls]


def _convert(res, back):
    if isinstance(res, torch.Tensor):
        return back(res)
    if isinstance(res, tuple):
        return tuple(_convert(r, back) for r in res)
    return res  # a plan: the door's own object stays as it is
