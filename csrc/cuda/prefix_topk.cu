// prefix_topk on the GPU: per-request verify lengths of the top-K draft candidates (DESIGN §4).
// Semantics: reference.prefix_topk.
//
// One block of 1024 threads. Candidates are ranked by a composite order: survival descending
// (NaN as -inf, -0 as +0), then j-major index j * R + r ascending (lower position, then lower
// request). Instead of sorting, a 4-pass radix select (8 bits per pass, shared-memory histogram)
// finds the K-th largest 32-bit order key t and how many candidates equal to t get in; those
// are the ones of lowest index (a ballot scan in index order). Each candidate left out then
// lowers its request's length with atomicMin(l_r, j): l_r = first non-admitted position.
#include "prefix_topk.h"

#include "cuda/common.cuh"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// Monotone map float -> uint32 (larger float, larger key), NaN as -inf, -0 as +0.
__device__ __forceinline__ uint32_t OrderKey(float f) {
  if (f != f) f = -kInfF;
  if (f == 0.f) f = 0.f;
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__global__ void __launch_bounds__(kThreads) PrefixTopkKernel(const float* __restrict__ survival, int R, int gamma,
                                                             int K, int32_t* __restrict__ lengths) {
  __shared__ unsigned hist[256];
  __shared__ unsigned warp_count[kWarps];
  __shared__ uint32_t prefix_s;
  __shared__ int krem_s, eq_s;
  const int n = R * gamma, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int init = K >= n ? gamma : (K <= 0 ? 0 : gamma);
  for (int r = tid; r < R; r += kThreads) lengths[r] = init;
  if (K <= 0 || K >= n) return;  // nothing or everything admitted
  auto key_of = [&](int i) {     // i = j * R + r
    const int j = i / R, r = i - j * R;
    return OrderKey(__ldg(survival + static_cast<int64_t>(r) * gamma + j));
  };

  // ---- radix select: t = K-th largest key, krem = how many keys equal to t are admitted ----
  uint32_t prefix = 0, mask = 0;
  if (tid == 0) krem_s = K;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += kThreads) hist[b] = 0;
    __syncthreads();
    // NOTE: survivals cluster in a few bins (the first passes see only the top exponent bits),
    // so lanes of a warp mostly hit the same counter: each group of lanes with equal bins adds
    // its population once (__match_any_sync) instead of serialising up to 32 shared atomics.
    for (int base = 0; base < n; base += kThreads) {  // warp-uniform trip count
      const int i = base + tid;
      const uint32_t k = i < n ? key_of(i) : 0u;
      const unsigned bin = i < n && (k & mask) == prefix ? (k >> shift) & 255u : 256u;
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      if (bin < 256u && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<unsigned>(__popc(peers)));
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l owns bins 255 - 8l down to 248 - 8l; scan from the top for the bin holding the
      // krem-th largest key.
      const int krem = krem_s;
      unsigned own = 0;
#pragma unroll
      for (int q = 0; q < 8; ++q) own += hist[255 - 8 * lane - q];
      unsigned incl = own;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      const unsigned excl = incl - own;
      const bool here = excl < static_cast<unsigned>(krem) && incl >= static_cast<unsigned>(krem);
      // Every lane read krem_s above and one lane overwrites it below: shuffles do not order
      // shared-memory accesses (a WAR race for the memory model and for racecheck).
      __syncwarp();
      if (here) {
        unsigned cum = excl;
        for (int q = 0; q < 8; ++q) {
          const int b = 255 - 8 * lane - q;
          if (cum + hist[b] >= static_cast<unsigned>(krem)) {
            prefix_s = prefix | (static_cast<uint32_t>(b) << shift);
            krem_s = krem - static_cast<int>(cum);
            eq_s = static_cast<int>(hist[b]);
            break;
          }
          cum += hist[b];
        }
      }
    }
    __syncthreads();
    prefix = prefix_s;
    mask |= 255u << shift;
  }
  const uint32_t t = prefix;
  const int krem = krem_s, eq = eq_s;  // eq: keys equal to t (the last pass's bin count)

  // ---- admitted: key > t, or key == t among the krem lowest indices ----
  int carry = 0;
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + tid;
    const uint32_t k = i < n ? key_of(i) : 0u;
    const bool tie = i < n && k == t;
    int rank = 0;
    if (eq != krem) {  // some keys equal to t stay out: rank them by index
      const unsigned ball = __ballot_sync(0xffffffffu, tie);
      if (lane == 0) warp_count[warp] = __popc(ball);
      __syncthreads();
      int before = 0;
      for (int w = 0; w < warp; ++w) before += warp_count[w];
      int total = before;
      for (int w = warp; w < kWarps; ++w) total += warp_count[w];
      rank = carry + before + __popc(ball & ((1u << lane) - 1u));
      carry += total;
      __syncthreads();  // warp_count is rewritten by the next tile
    }
    const bool admitted = k > t || (tie && rank < krem);
    if (i < n && !admitted) {
      const int j = i / R, r = i - j * R;
      atomicMin(&lengths[r], j);
    }
  }
}

}  // namespace
}  // namespace dspark::cuda

namespace dspark {

Status PrefixTopkCuda(const PrefixTopkParams& p, void* stream) {
  using namespace dspark::cuda;
  if (p.R < 0 || p.gamma < 0 || p.K < 0) return Status::kBadArgument;
  if (p.R == 0) return Status::kOk;
  if (!p.survival || !p.lengths) return Status::kBadArgument;
  if (p.R * p.gamma > (1ll << 30)) return Status::kBadArgument;
  const int64_t n = p.R * p.gamma;
  const int K = static_cast<int>(p.K < n ? p.K : n);
  const cudaStream_t s = AsStream(stream);
  DeviceGuard guard(s);
  PrefixTopkKernel<<<1, kThreads, 0, s>>>(p.survival, static_cast<int>(p.R), static_cast<int>(p.gamma), K,
                                          p.lengths);
  return LaunchStatus();
}

}  // namespace dspark
