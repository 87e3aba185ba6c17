// append_kv on the GPU: a pure copy, k[n] / v[n] -> their cache slot (csrc/append_kv.h).
// Thread = one 16-byte chunk of one token's K and V rows (h_kv * head_dim contiguous elements
// on both sides), so the copy is coalesced and vectorised whatever the page size; rows whose
// byte size is not a multiple of 16 (or misaligned pointers) take the element-wise kernel.
#include "append_kv.h"

#include <algorithm>

#include "cuda/common.cuh"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 256;

template <class V>
__global__ void __launch_bounds__(kThreads) AppendKvKernel(const V* __restrict__ k, const V* __restrict__ v,
                                                           V* __restrict__ k_cache, V* __restrict__ v_cache,
                                                           const int64_t* __restrict__ slot_mapping, int64_t N,
                                                           int64_t row, int64_t num_slots) {
  // row: vectors of type V per token (h_kv * head_dim elements)
  const int64_t total = N * row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t n = i / row, c = i - n * row;
    const int64_t slot = __ldg(slot_mapping + n);
    if (slot < 0 || slot >= num_slots) continue;
    k_cache[slot * row + c] = k[i];
    v_cache[slot * row + c] = v[i];
  }
}

template <class V>
Status Launch(const AppendKvParams& p, int64_t row_bytes, cudaStream_t stream) {
  const int64_t row = row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t total = p.N * row;
  const int64_t blocks = std::min<int64_t>(CeilDiv(total, kThreads), 65535ll * 8);
  AppendKvKernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const V*>(p.k), static_cast<const V*>(p.v), static_cast<V*>(p.k_cache), static_cast<V*>(p.v_cache),
      p.slot_mapping, p.N, row, p.num_pages * p.page_size);
  return LaunchStatus();
}

}  // namespace
}  // namespace dspark::cuda

namespace dspark {

Status AppendKvCuda(const AppendKvParams& p, void* stream) {
  using namespace dspark::cuda;
  int64_t elem = 0;
  const Status st = CheckAppendKv(p, &elem);
  if (st != Status::kOk || elem == 0) return st;
  const int64_t row_bytes = p.h_kv * p.head_dim * elem;
  const cudaStream_t s = AsStream(stream);
  DeviceGuard guard(s);
  const bool v16 = row_bytes % 16 == 0 && Aligned(p.k, 16) && Aligned(p.v, 16) && Aligned(p.k_cache, 16) &&
                   Aligned(p.v_cache, 16);
  if (v16) return Launch<uint4>(p, row_bytes, s);
  switch (elem) {
    case 8: return Launch<uint64_t>(p, row_bytes, s);
    case 4: return Launch<uint32_t>(p, row_bytes, s);
    default: return Launch<uint16_t>(p, row_bytes, s);
  }
}

}  // namespace dspark
