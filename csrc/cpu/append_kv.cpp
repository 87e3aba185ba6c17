// append_kv on the CPU: the twin of csrc/cuda/append_kv.cu (semantics in csrc/append_kv.h).
#include "append_kv.h"

#include <cstring>

namespace dspark {

Status AppendKvCpu(const AppendKvParams& p) {
  int64_t elem = 0;
  const Status s = CheckAppendKv(p, &elem);
  if (s != Status::kOk || elem == 0) return s;
  // One token's K (or V) row is h_kv * head_dim contiguous elements on both sides.
  const int64_t row = p.h_kv * p.head_dim * elem, num_slots = p.num_pages * p.page_size;
  const auto* k = static_cast<const char*>(p.k);
  const auto* v = static_cast<const char*>(p.v);
  auto* kc = static_cast<char*>(p.k_cache);
  auto* vc = static_cast<char*>(p.v_cache);
  for (int64_t n = 0; n < p.N; ++n) {
    const int64_t slot = p.slot_mapping[n];
    if (slot < 0 || slot >= num_slots) continue;  // padding (the door rejects other bad slots)
    std::memcpy(kc + slot * row, k + n * row, static_cast<size_t>(row));
    std::memcpy(vc + slot * row, v + n * row, static_cast<size_t>(row));
  }
  return Status::kOk;
}

}  // namespace dspark
