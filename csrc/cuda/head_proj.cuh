// The hidden-state halves of a sequential head's small products, for every (request, step) row
// at once (they do not depend on the sampled tokens): markov_sample's gated gate, the selector's
// gate and the confidence head's h part (markov_sample.cu, markov_select.cu).
#pragma once
#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"

namespace dspark::cuda {

// out[n][i] = W[i][:d] . hidden[n]: rows 0..rank_rows-1 are gate_w's (row stride ld_gate), row
// rank_rows (when conf_w) the confidence head's, into hg [N, rank_rows] and hc [N].
struct HeadProjArgs {
  const void* hidden;  // [N, d]
  const void* gate_w;  // [rank_rows, ld_gate] or null
  const void* conf_w;  // [d (+ rank)] or null
  float* hg;
  float* hc;
  int64_t N;
  int d, rank_rows, ld_gate;
  bool vec;  // set by LaunchHeadProj: every row 16-byte aligned, d % 4 == 0
};

// acc[i * 8 + q] += w_i . h_q over this warp's share of d: slabs of 128 elements (4 a lane, vec: 16-byte
// aligned rows) or 32 (scalar), slab s going to warp s % nwarps. The loads of a slab are issued
// together (4 weight + 8 hidden vectors a lane) and a warp walks only d / (nwarps * 128) slabs,
// so a block finishes a tile in a few round trips, not d / 128 (at d = 4096: 4, not 32).
template <class W>
__device__ __forceinline__ void SplitDots4x8(const W* const wp[4], const W* const hp[8], int d, bool vec,
                                             int lane, int warp, int nwarps, float (&acc)[32]) {
  if (vec) {
    for (int j = (warp * 32 + lane) * 4; j < d; j += nwarps * 128) {
      float4 w[4], h[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = Load4(wp[i] + j);
#pragma unroll
      for (int q = 0; q < 8; ++q) h[q] = Load4(hp[q] + j);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[i * 8 + q] = fmaf(w[i].x, h[q].x, fmaf(w[i].y, h[q].y, fmaf(w[i].z, h[q].z, fmaf(w[i].w, h[q].w, acc[i * 8 + q]))));
        }
      }
    }
  } else {
    for (int j = warp * 32 + lane; j < d; j += nwarps * 32) {
      float w[4], h[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = ToFloat(wp[i][j]);
#pragma unroll
      for (int q = 0; q < 8; ++q) h[q] = ToFloat(hp[q][j]);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i * 8 + q] = fmaf(w[i], h[q], acc[i * 8 + q]);
      }
    }
  }
}

// Sums each of the 32 values v[0..31] over the warp, lane L keeping the total of v[L]: a
// reduce-scatter of 31 shuffles (32 WarpSums would take 160). The order of the additions is
// fixed, so the result does not depend on the launch.
template <int O>
__device__ __forceinline__ void ReduceScatterStep(float (&v)[32], bool upper) {
#pragma unroll
  for (int i = 0; i < O; ++i) {
    const float send = upper ? v[i] : v[i + O];
    const float keep = upper ? v[i + O] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
  }
}
__device__ __forceinline__ float WarpReduceScatter32(float (&v)[32], int lane) {
  ReduceScatterStep<16>(v, lane & 16);
  ReduceScatterStep<8>(v, lane & 8);
  ReduceScatterStep<4>(v, lane & 4);
  ReduceScatterStep<2>(v, lane & 2);
  ReduceScatterStep<1>(v, lane & 1);
  return v[0];
}

// A block computes one tile of 4 weight rows x 8 hidden vectors at a time, its warps splitting
// d (SplitDots4x8); each warp reduces its 32 sums over its lanes at once and warp 0 adds the
// warps' sums in a fixed order. Blocks stride over the tiles, so any grid covers them. At R = 1
// (one tile for the confidence head alone) the whole block works on it.
template <class W, int kThreads>
__global__ void __launch_bounds__(kThreads) HeadProjKernel(HeadProjArgs a) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float part[kWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nrows = a.rank_rows + (a.conf_w != nullptr ? 1 : 0);
  const int64_t row_tiles = (nrows + 3) / 4, vec_tiles = (a.N + 7) / 8;
  for (int64_t t = blockIdx.x; t < row_tiles * vec_tiles; t += gridDim.x) {
    const int rt = static_cast<int>(t % row_tiles);
    const int64_t vt = t / row_tiles;
    const W* wp[4];
    const W* hp[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = min(rt * 4 + i, nrows - 1);  // clamped duplicates are computed, not stored
      wp[i] = row < a.rank_rows ? static_cast<const W*>(a.gate_w) + static_cast<int64_t>(row) * a.ld_gate
                                : static_cast<const W*>(a.conf_w);
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      hp[q] = static_cast<const W*>(a.hidden) + min(vt * 8 + q, a.N - 1) * a.d;
    }
    float acc[32] = {};
    SplitDots4x8<W>(wp, hp, a.d, a.vec, lane, warp, kWarps, acc);
    part[warp][lane] = WarpReduceScatter32(acc, lane);  // lane = i * 8 + q
    __syncthreads();
    if (warp == 0) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += part[w][lane];
      const int row = rt * 4 + lane / 8;
      const int64_t n = vt * 8 + lane % 8;
      if (row < nrows && n < a.N) {
        if (row < a.rank_rows) {
          a.hg[n * a.rank_rows + row] = s;
        } else {
          a.hc[n] = s;
        }
      }
    }
    __syncthreads();  // part is reused by the next tile
  }
}

// Fills hg / hc for a's rows on `stream` (d > 0: the caller handles an empty hidden state).
// One block a tile, grid-stride beyond a few waves.
template <class W, int kThreads>
Status LaunchHeadProj(HeadProjArgs a, int sm_count, cudaStream_t stream) {
  constexpr size_t kVec = 4 * sizeof(W);
  a.vec = a.d % 4 == 0 && Aligned(a.hidden, kVec) &&
          (a.rank_rows == 0 || (a.ld_gate % 4 == 0 && Aligned(a.gate_w, kVec))) &&
          (a.conf_w == nullptr || Aligned(a.conf_w, kVec));
  const int nrows = a.rank_rows + (a.conf_w != nullptr ? 1 : 0);
  const int64_t tiles = CeilDiv(nrows, 4) * CeilDiv(a.N, 8);
  const int64_t blocks = std::min<int64_t>(tiles, int64_t{sm_count} * 16);
  HeadProjKernel<W, kThreads><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return LaunchStatus();
}

}  // namespace dspark::cuda
