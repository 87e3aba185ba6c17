// append_kv: writes the K/V of new tokens into their pages of the paged cache (the layout
// verify_attention reads). Token n goes to slot slot_mapping[n] = page * page_size + offset,
// i.e. k_cache[page, offset] = k[n] (and likewise v); a negative slot skips the token (padding).
// PyTorch semantics:
//   ok = slot_mapping >= 0
//   k_cache.view(-1, h_kv, head_dim)[slot_mapping[ok]] = k[ok]   (same for v)
#pragma once
#include "common.h"

namespace dspark {

struct AppendKvParams {
  int64_t N = 0;           // new tokens
  int64_t h_kv = 0, head_dim = 0;
  int64_t page_size = 0, num_pages = 0;  // slots >= num_pages * page_size are skipped too
  DType dtype = DType::kFloat32;         // k, v and both caches

  const void* k = nullptr;               // [N, h_kv, head_dim]
  const void* v = nullptr;               // [N, h_kv, head_dim]
  void* k_cache = nullptr;               // [num_pages, page_size, h_kv, head_dim]
  void* v_cache = nullptr;               // [num_pages, page_size, h_kv, head_dim]
  const int64_t* slot_mapping = nullptr; // [N]
};

// Shared by both launchers: kOk with *elem_bytes set when there is work, kOk with
// *elem_bytes = 0 when there is nothing to copy, kBadArgument otherwise.
inline Status CheckAppendKv(const AppendKvParams& p, int64_t* elem_bytes) {
  *elem_bytes = 0;
  if (p.N < 0 || p.h_kv < 1 || p.head_dim < 1 || p.page_size < 1 || p.num_pages < 0) {
    return Status::kBadArgument;
  }
  if (p.N == 0 || p.num_pages == 0) return Status::kOk;
  if (!p.k || !p.v || !p.k_cache || !p.v_cache || !p.slot_mapping) return Status::kBadArgument;
  switch (p.dtype) {
    case DType::kFloat64: *elem_bytes = 8; break;
    case DType::kFloat32: *elem_bytes = 4; break;
    case DType::kFloat16:
    case DType::kBFloat16: *elem_bytes = 2; break;
    default: return Status::kBadArgument;
  }
  return Status::kOk;
}

Status AppendKvCpu(const AppendKvParams& p);
Status AppendKvCuda(const AppendKvParams& p, void* stream);

}  // namespace dspark
