"""The single Python door to the kernels.

Each op checks its tensors once, by name (dtype, device, shape, contiguity, index ranges), picks
a backend and hands raw pointers, sizes and the current stream to the extension. Backends:
"reference" (reference.py, plain PyTorch, the ground truth), "cpp" (C++ CPU kernels) and "cuda";
the default follows the tensors' device, DSPARK_BACKEND=reference forces the reference. Every op
also takes CuPy arrays and other DLPack / __cuda_array_interface__ arrays without a copy, and
answers in the type of its leading tensor (arrays.py).

One module per op family:
  door.py       which backends this build has, which one a call takes, the launch
  _check.py     argument checks, by name          arrays.py   foreign arrays in and out
  markov.py     markov_sample (the sequential drafting stage)
  rejection.py  rejection_sample (lossless acceptance)
  schedule.py   prefix_topk (the scheduler's top-K admission)
  attention.py  plan_verify_attention, verify_attention (paged attention, plan/run)
  cache.py      append_kv (writes into the paged KV cache)
  gemm.py       linear (the row-invariant GEMM)     exact.py  exact_mode
  reference.py, philox.py: the semantics and the counter-based random numbers.

Callers use the names below through the package (ops.markov_sample(...)), so patching one of
them here reaches every caller. The backend choice and the launch are patched where they live:
door.available_backends, door.run.
"""
from . import door
from ._check import OpError
from .attention import VerifyAttentionPlan, plan_verify_attention, verify_attention
from .cache import append_kv
from .door import available_backends
from .exact import exact_mode
from .gemm import linear
from .markov import CUDA_SELECT_MAX_TOP_K as _CUDA_SELECT_MAX_TOP_K  # runner/graphs.py reads it
from .markov import HEADS, markov_sample
from .rejection import rejection_sample, takes_narrow_target
from .schedule import prefix_topk

_C = door.ext  # the extension, or None (tools/env_info.py, testing/bench.py read it)

__all__ = ["linear", "exact_mode", "markov_sample", "rejection_sample", "prefix_topk", "verify_attention", "append_kv",
           "plan_verify_attention", "VerifyAttentionPlan", "OpError",
           "available_backends", "HEADS"]
