// rejection_sample: lossless acceptance for a whole batch (DESIGN §2 step 6).
// Semantics are defined by dspark_rt/ops/reference.py::rejection_sample.
#pragma once
#include "common.h"

namespace dspark {

struct RejectionSampleParams {
  int64_t R = 0, gamma = 0, V = 0;  // gamma may be 0 (plain autoregressive sampling)
  DType dtype = DType::kFloat32;        // target_logits
  DType draft_dtype = DType::kFloat32;  // draft_logits: dtype, or float32 under 16-bit target
                                        // logits (a bf16 model's verify output, served as it
                                        // is: the kernels widen on load, exactly)
  DType lse_dtype = DType::kFloat32;    // draft_lse: float64 iff dtype is float64

  const void* target_logits = nullptr;  // [N, V]; request r owns rows cu_rows[r] .. cu_rows[r+1]-1
  const int32_t* cu_rows = nullptr;     // [R + 1]; l_r = cu_rows[r+1] - cu_rows[r] - 1 in [0, gamma]
  const int64_t* draft_tokens = nullptr;  // [R, gamma]
  const void* draft_logits = nullptr;     // [R, gamma, V] z (before temperature)
  const void* draft_lse = nullptr;        // [R, gamma] logsumexp(z / T)

  const float* temperature = nullptr;  // [R]; 0 means greedy
  const uint64_t* seed = nullptr;      // [R]
  const int64_t* stream = nullptr;     // [R]
  const int64_t* round = nullptr;      // [R] round counter (coupled: n0)
  const uint8_t* coupled = nullptr;    // [R] nonzero: Gumbel-coupled rule, round = n0 the
                                       // tokens emitted so far (philox.h); null: none
  const int32_t* token_bitmask = nullptr;  // [N, ceil(V / 32)] one row per target row: bit v % 32 of
                                           // word v / 32 set = token v allowed (a grammar; null:
                                           // none); forbidden logits read as -inf

  int32_t* num_accepted = nullptr;  // [R] a_r
  int64_t* out_tokens = nullptr;    // [R, gamma + 1] x_1..x_a, y, then -1
  uint8_t* failed = nullptr;        // [R] 1 where one of the request's rows holds NaN or +inf
                                    // (it fails alone; its tokens are meaningless), else 0
};

Status RejectionSampleCpu(const RejectionSampleParams& p);
Status RejectionSampleCuda(const RejectionSampleParams& p, void* stream);

}  // namespace dspark
