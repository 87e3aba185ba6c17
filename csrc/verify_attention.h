// verify_attention: tree-free ragged attention over a paged KV cache (DESIGN §5).
// Semantics are defined by dspark_rt/ops/reference.py::verify_attention.
#pragma once
#include "common.h"

namespace dspark {

struct VerifyAttentionParams {
  int64_t R = 0, h_q = 0, h_kv = 0, head_dim = 0;
  int64_t page_size = 0, num_pages = 0, max_pages = 0;  // max_pages: block table row length
  DType dtype = DType::kFloat32;  // q, caches and out
  bool causal = true;             // false: bidirectional within the chain (drafter block)
  double scale = 1.0;  // double so float64 attention matches the reference to the last ulp

  const void* q = nullptr;             // [N, h_q, head_dim]; request r owns rows cu_q[r] .. cu_q[r+1]-1
  const int32_t* cu_q = nullptr;       // [R + 1]
  const void* k_cache = nullptr;       // [num_pages, page_size, h_kv, head_dim]
  const void* v_cache = nullptr;       // [num_pages, page_size, h_kv, head_dim]
  const int32_t* block_tables = nullptr;  // [R, max_pages]
  const int32_t* kv_lens = nullptr;    // [R] keys of request r, its own chain included (>= n_q)
  void* out = nullptr;                 // [N, h_q, head_dim]
};

Status VerifyAttentionCpu(const VerifyAttentionParams& p);
Status VerifyAttentionCuda(const VerifyAttentionParams& p, void* stream);

}  // namespace dspark
