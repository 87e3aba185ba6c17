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

// A warp computes 4 weight rows x 8 hidden vectors, so each loaded element feeds 4 or 8 FMAs;
// warps stride over the tiles, so any grid covers them.
template <class W, int kThreads>
__global__ void __launch_bounds__(kThreads) HeadProjKernel(HeadProjArgs a) {
  const int lane = threadIdx.x & 31;
  const int nrows = a.rank_rows + (a.conf_w != nullptr ? 1 : 0);
  const int64_t row_tiles = (nrows + 3) / 4, vec_tiles = (a.N + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t w = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
       w < row_tiles * vec_tiles; w += stride) {
    const int rt = static_cast<int>(w % row_tiles);
    const int64_t vt = w / row_tiles;
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
    float acc[4][8] = {};
    RowDots4x8<W>(wp, hp, a.d, a.vec, lane, acc);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const float s = WarpSum(acc[i][q]);
        const int row = rt * 4 + i;
        const int64_t n = vt * 8 + q;
        if (lane == 0 && row < nrows && n < a.N) {
          if (row < a.rank_rows) {
            a.hg[n * a.rank_rows + row] = s;
          } else {
            a.hc[n] = s;
          }
        }
      }
    }
  }
}

// Fills hg / hc for a's rows on `stream` (d > 0: the caller handles an empty hidden state).
// Grid-stride, so a few waves of blocks cover any number of rows.
template <class W, int kThreads>
Status LaunchHeadProj(HeadProjArgs a, int sm_count, cudaStream_t stream) {
  constexpr size_t kVec = 4 * sizeof(W);
  a.vec = a.d % 4 == 0 && Aligned(a.hidden, kVec) &&
          (a.rank_rows == 0 || (a.ld_gate % 4 == 0 && Aligned(a.gate_w, kVec))) &&
          (a.conf_w == nullptr || Aligned(a.conf_w, kVec));
  const int nrows = a.rank_rows + (a.conf_w != nullptr ? 1 : 0);
  const int64_t warps = CeilDiv(nrows, 4) * CeilDiv(a.N, 8);
  const int64_t blocks = std::min<int64_t>(CeilDiv(warps, kThreads / 32), int64_t{sm_count} * 64);
  HeadProjKernel<W, kThreads><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return LaunchStatus();
}

}  // namespace dspark::cuda
