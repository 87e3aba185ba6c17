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
  int64_t window = 0;  // > 0: the query at position p sees keys at positions j with
                       // p - j < window (and j - p < window when bidirectional): sliding layers
  double scale = 1.0;  // double so float64 attention matches the reference to the last ulp

  const void* q = nullptr;             // [N, h_q, head_dim]; request r owns rows cu_q[r] .. cu_q[r+1]-1
  const int32_t* cu_q = nullptr;       // [R + 1]
  const void* k_cache = nullptr;       // [num_pages, page_size, h_kv, head_dim]
  const void* v_cache = nullptr;       // [num_pages, page_size, h_kv, head_dim]
  const int32_t* block_tables = nullptr;  // [R, max_pages]
  const int32_t* kv_lens = nullptr;    // [R] keys of request r, its own chain included (>= n_q)
  void* out = nullptr;                 // [N, h_q, head_dim]

  // Plan (FlashInfer's plan/run): the CUDA tensor-core path's work partition and split-KV
  // partials, made once per forward by VerifyAttentionPlanCuda from cu_q / kv_lens / block
  // tables and reused by every layer. Null work: the launcher plans into its own scratch on
  // every call.
  int32_t* work = nullptr;    // [4 (R + 1)]: item_off | split | slot_off | bad (1: NaN rows)
  float* part_o = nullptr;    // [plan_slots, 64, head_dim] split partials O / l; the slot(s)
                              // past the split slots hold the merge tickets (int32, zeroed by
                              // the plan, left zero by every call: graph replays reuse them)
  float* part_lse = nullptr;  // [plan_slots, 64] their log2-sum-exp
  int64_t plan_slots = 0;     // VerifyAttentionPlanSlots(p); 0: the path takes no plan
  // CUDA tensor-core path: true never splits the KV range and gives every 16 query rows a warp
  // of their own, so a row's result depends on neither its chain nor the rest of the batch;
  // false sizes splits for this batch and shares a short tile's keys between warps (a request's
  // 16-bit output may then move by an ulp when other requests join or its chain grows).
  bool batch_invariant = false;
};

Status VerifyAttentionCpu(const VerifyAttentionParams& p);
Status VerifyAttentionCuda(const VerifyAttentionParams& p, void* stream);

// Partial slots a plan for p's dtype, head_dim and the device of `stream` needs (0: the
// CUDA-core path, which takes no plan). Host only: no launch, no sync, safe in graph capture.
Status VerifyAttentionPlanSlots(const VerifyAttentionParams& p, void* stream, int64_t* slots);
// Writes p.work on `stream` from the device's cu_q / kv_lens (a no-op for a path without plan).
Status VerifyAttentionPlanCuda(const VerifyAttentionParams& p, void* stream);

}  // namespace dspark
