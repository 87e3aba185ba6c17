// prefix_topk: per-request verify lengths of the top-K draft candidates (DESIGN §4, async).
// Semantics are defined by dspark_rt/ops/reference.py::prefix_topk.
#pragma once
#include "common.h"

namespace dspark {

struct PrefixTopkParams {
  int64_t R = 0, gamma = 0;
  int64_t K = 0;                     // candidates to admit, 0 <= K (clamped to R * gamma)
  const float* survival = nullptr;   // [R, gamma] a_{r,j}
  int32_t* lengths = nullptr;        // [R] l_r
};

Status PrefixTopkCpu(const PrefixTopkParams& p);
Status PrefixTopkCuda(const PrefixTopkParams& p, void* stream);

}  // namespace dspark
