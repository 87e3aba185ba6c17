// linear: out = x w^T, a row-invariant GEMM (the target's projections and LM head).
// Semantics are defined by dspark_rt/ops/reference.py::linear.
//
// Row invariance (DESIGN §6): out[m, n] is the same bits whatever other rows share the call
// (how many, which, in what order). Every backend accumulates each output element in one fixed
// order that depends on K alone, never on M, on m's place in a tile or on the thread count: no
// split-K chosen by shape, no M-dependent kernel choice. Accumulation is in float32 (float64 for
// float64), rounded once to the output dtype (round to nearest even, as torch casts).
#pragma once
#include "common.h"

namespace dspark {

struct LinearParams {
  int64_t M = 0, N = 0, K = 0;    // x [M, K], w [N, K] (nn.Linear's layout), out [M, N]
  DType dtype = DType::kFloat32;  // x, w and out
  int64_t ldx = 0, ldw = 0, ldo = 0;  // row strides in elements (>= K, K, N); columns contiguous
  const void* x = nullptr;
  const void* w = nullptr;
  void* out = nullptr;
};

Status LinearCpu(const LinearParams& p);
Status LinearCuda(const LinearParams& p, void* stream);

}  // namespace dspark
