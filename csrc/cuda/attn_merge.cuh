// verify_attention's split-KV merge, fused into the attention kernel (csrc/cuda/verify_attention.cu):
// the last split of a unit (request, KV head, 64-row query tile) to finish, found with an atomic
// ticket, merges the unit's S partials into the output, so no merge kernel is launched and no
// block waits for another. Included by verify_attention.cu only.
#pragma once
#include "cuda/attn_plan.cuh"

namespace dspark::cuda {
namespace {

// Shared memory the merge needs, in floats: row statistics, then the S x 64 weights (the group
// sums of the output pass reuse the weights' place).
constexpr int kMergeStats = 5 * kBlockM;  // max halves, sum halves, 1 / sum
constexpr int kMergeOuts = 4;             // float4 outputs per thread and pass
constexpr int kMergeSplitBatch = 4;       // splits whose partials a thread loads at once
constexpr int kMergeBatch = 8;            // lse loads a thread issues at once
constexpr int kMergeSmemFloats = kMergeStats + kMaxSplits * kBlockM;
static_assert(kThreads * kMergeOuts * 4 <= kMaxSplits * kBlockM, "group sums fit the weights' place");

// Called by every thread once this block has stored its split's partial: true (in every thread)
// in the block that arrived last among the unit's S splits, which then merges. `ticket` counts the
// unit's arrivals; the last arrival sets it back to zero, so the next launch (the next layer, a
// graph replay) finds it as the plan left it.
// NOTE: release: every thread fences its partial stores before the barrier that precedes the
// ticket; acquire: the ticket's thread fences after reading it, and the merge reads the partials
// through L2 (ld.global.cg), never through this SM's L1, which may hold lines of an earlier layer.
__device__ __forceinline__ bool LastSplit(int* ticket, int S, int* last_s) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(ticket, 1) == S - 1;
    if (last) {
      __threadfence();
      *ticket = 0;  // all S have arrived: nobody touches it again in this launch
    }
    *last_s = last;
  }
  __syncthreads();
  return *last_s;
}

// out row p = sum_s w_s(p) O_s(p) / sum_s w_s(p), w_s(p) = exp2(lse_s(p) - max_s lse_s(p)), for the
// unit's rows row0 .. row0 + rows_here - 1 (request ri, KV head h). Split s's partial is slot
// slot0 + s * stride. Splits are summed in the order 0 .. S-1 (and thread groups in a fixed
// order) whichever block merges: the result is deterministic. A split that saw none of a row's
// keys has lse -inf, weight 0 and O 0; a bad request has NaN partials and gets NaN rows.
// Every load is independent of every other (no load waits on a weight): lse first, 8 loads in
// flight a thread (S <= 16: one round trip), into shared memory; then the weights there; then
// the partials, kMergeOuts float4 a thread for each of kMergeSplitBatch splits: 16 loads of 16
// bytes in flight a thread, 32 KB a block.
// `smem`: kMergeSmemFloats floats no thread uses any more (after LastSplit).
template <class T, int HD>
__device__ __forceinline__ void MergeSplits(const AttnArgs& a, float* smem, const ReqInfo& ri, int h, int row0,
                                            int rows_here, int S, int64_t slot0, int stride, bool bad) {
  constexpr int kD4 = HD / 4;  // float4 columns of a row
  const int tid = threadIdx.x;
  float* red_m = smem;                 // [2][kBlockM]
  float* red_l = smem + 2 * kBlockM;   // [2][kBlockM]
  float* row_inv = smem + 4 * kBlockM; // [kBlockM]
  float* ws = smem + kMergeStats;      // [S][kBlockM]: lse, then weights
  // NOTE: loops over splits run in batches of predicated loads, not unrolled loops: an unrolled
  // loop of unknown trip count keeps an exit branch between its copies, and nvcc then issues
  // each copy's loads only after the previous copy's arithmetic.
  for (int i0 = tid; i0 < S * kBlockM; i0 += kMergeBatch * kThreads) {
    float x[kMergeBatch];
#pragma unroll
    for (int u = 0; u < kMergeBatch; ++u) {
      const int i = i0 + u * kThreads, s = i / kBlockM, p = i % kBlockM;
      x[u] = i < S * kBlockM && p < rows_here
                 ? __ldcg(a.part_lse + (slot0 + static_cast<int64_t>(s) * stride) * kBlockM + p)
                 : -kInfF;
    }
#pragma unroll
    for (int u = 0; u < kMergeBatch; ++u) {
      if (i0 + u * kThreads < S * kBlockM) ws[i0 + u * kThreads] = x[u];
    }
  }
  __syncthreads();
  // Per row p, two threads (halves of the splits): the max, then the weights and their sum.
  const int p = tid % kBlockM, half = tid / kBlockM;
  static_assert(kThreads == 2 * kBlockM, "two threads per row");
  float mx = -kInfF;
  for (int s = half; s < S; s += 2) mx = fmaxf(mx, ws[s * kBlockM + p]);
  red_m[half * kBlockM + p] = mx;
  __syncthreads();
  mx = fmaxf(red_m[p], red_m[kBlockM + p]);
  const float mu = mx == -kInfF ? 0.f : mx;  // a row no split saw: weights exp2(-inf) = 0, not NaN
  float sum = 0.f;
  for (int s = half; s < S; s += 2) {
    const float w = exp2f(ws[s * kBlockM + p] - mu);
    ws[s * kBlockM + p] = w;
    sum += w;
  }
  red_l[half * kBlockM + p] = sum;
  __syncthreads();
  if (half == 0) {
    const float total = red_l[p] + red_l[kBlockM + p];
    row_inv[p] = bad ? kNaNF : (total > 0.f ? 1.f / total : 0.f);
  }
  __syncthreads();

  // Output pass. `span` threads cover the outputs (a pass of span x kMergeOuts float4); when the
  // unit is small (few rows), the other threads form more groups that take every groups-th split,
  // and group 0 adds the groups' sums in order.
  const int outs = rows_here * kD4;
  int span = kThreads;
  while (span > 1 && (span / 2) * kMergeOuts >= outs) span /= 2;
  const int groups = kThreads / span, g = tid / span, i0 = tid % span;
  float4* red = reinterpret_cast<float4*>(ws);  // [kThreads][kMergeOuts], after the weights
  T* og = static_cast<T*>(a.out);
  for (int base = 0; base < outs; base += span * kMergeOuts) {  // one pass whenever groups > 1
    float4 acc[kMergeOuts];
#pragma unroll
    for (int j = 0; j < kMergeOuts; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    // Splits g, g + groups, ... in batches of kMergeSplitBatch: kMergeSplitBatch x kMergeOuts
    // loads in flight, then their multiply-adds in split order. NOTE: the loads are not
    // predicated (ptxas sinks a predicated load next to its use, one load in flight): past the
    // last split or output they read the last one again (written, finite unless the request is
    // bad, whose rows are NaN anyway) and weigh it 0.
    for (int s0 = g; s0 < S; s0 += kMergeSplitBatch * groups) {
      float4 v[kMergeSplitBatch][kMergeOuts];
#pragma unroll
      for (int u = 0; u < kMergeSplitBatch; ++u) {
        const int s = min(s0 + u * groups, S - 1);
        const float4* po = reinterpret_cast<const float4*>(a.part_o + (slot0 + static_cast<int64_t>(s) * stride) *
                                                                          (kBlockM * HD));
#pragma unroll
        for (int j = 0; j < kMergeOuts; ++j) v[u][j] = __ldcg(po + min(base + i0 + j * span, outs - 1));
      }
#pragma unroll
      for (int u = 0; u < kMergeSplitBatch; ++u) {
        const int s = s0 + u * groups;
#pragma unroll
        for (int j = 0; j < kMergeOuts; ++j) {
          const int idx = base + i0 + j * span;  // float4 idx in the unit's [rows][HD] partial
          const float w = s < S && idx < outs ? ws[s * kBlockM + idx / kD4] : 0.f;
          acc[j].x = fmaf(w, v[u][j].x, acc[j].x);
          acc[j].y = fmaf(w, v[u][j].y, acc[j].y);
          acc[j].z = fmaf(w, v[u][j].z, acc[j].z);
          acc[j].w = fmaf(w, v[u][j].w, acc[j].w);
        }
      }
    }
    if (groups > 1) {
      __syncthreads();  // every group is done with the weights, whose place `red` takes
#pragma unroll
      for (int j = 0; j < kMergeOuts; ++j) red[tid * kMergeOuts + j] = acc[j];
      __syncthreads();
      if (g == 0) {
        for (int k = 1; k < groups; ++k) {
#pragma unroll
          for (int j = 0; j < kMergeOuts; ++j) {
            const float4 v = red[(k * span + i0) * kMergeOuts + j];
            acc[j] = make_float4(acc[j].x + v.x, acc[j].y + v.y, acc[j].z + v.z, acc[j].w + v.w);
          }
        }
      }
    }
    if (g == 0) {
#pragma unroll
      for (int j = 0; j < kMergeOuts; ++j) {
        const int idx = base + i0 + j * span;
        if (idx < outs) {
          const int pp = idx / kD4, d = (idx % kD4) * 4;
          const int i = (row0 + pp) / a.group, gg = (row0 + pp) % a.group;
          const float inv = row_inv[pp];
          Store4(og + (static_cast<int64_t>(ri.q0 + i) * a.h_q + h * a.group + gg) * HD + d,
                 make_float4(acc[j].x * inv, acc[j].y * inv, acc[j].z * inv, acc[j].w * inv));
        }
      }
    }
  }
}

}  // namespace
}  // namespace dspark::cuda
