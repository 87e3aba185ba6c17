// verify_attention's work partition (csrc/cuda/verify_attention.cu): the arguments every kernel
// of the tensor-core path shares, the requests' visible key ranges and the plan kernel, which
// reads cu_q / kv_lens / block tables on the device once per forward and writes the partition
// (item_off | split | slot_off | bad) every layer's attention kernel reads. Included by
// verify_attention.cu only.
#pragma once
#include <algorithm>

#include "attn_split.h"
#include "cuda/common.cuh"

namespace dspark::cuda {
namespace {

constexpr int kBlockM = 64;  // packed query rows per tile (16 per warp)
constexpr int kBlockN = 64;  // keys per KV tile
constexpr int kThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kPlanCache = 2048;  // requests the planner's search reads from shared memory
constexpr int kBadRun = 256;      // block-table entries one warp checks at a time (8 per lane)

struct AttnArgs {
  const void* q;
  const int32_t* cu_q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  const int32_t* kv_lens;
  void* out;
  float* part_o;    // [slots, kBlockM, head_dim]
  float* part_lse;  // [slots, kBlockM], log2 domain
  int* item_off;    // [R + 1] first work item of each request; [R] = total
  int* split;       // [R] KV splits of each (request, head, tile)
  int* slot_off;    // [R + 1] first partial slot of each request
  int* bad;         // [R + 1] 1: request r's metadata is bad (NaN rows); [R] unused
  int* tickets;     // [2 target] split arrivals per unit, at the slot of its split 0; zero
                    // between launches (the plan zeroes them, every merging block resets its own)
  int R, h_q, h_kv, group, head_dim, page_size, max_pages, num_pages;
  int window;  // > 0: sliding window (p.window clamped to int: a wider one masks nothing more)
  bool causal;
  bool batch_invariant;  // no split-KV: results independent of the rest of the batch
  float scale_log2;  // scale * log2(e)
};

// Everything a work item needs about its request.
struct ReqInfo {
  int q0, n, L, rows, mtiles;
};

__device__ __forceinline__ ReqInfo LoadReq(const AttnArgs& a, int r) {
  ReqInfo ri;
  ri.q0 = a.cu_q[r];
  ri.n = a.cu_q[r + 1] - ri.q0;
  ri.L = a.kv_lens[r];
  ri.rows = ri.n * a.group;
  ri.mtiles = ri.n > 0 ? (ri.rows + kBlockM - 1) / kBlockM : 0;
  return ri;
}

// Visible keys of the query at position pos: [KeyLo, KeyHi) (reference.verify_attention). Both are
// non-decreasing in pos, so a run of queries sees [KeyLo(first), KeyHi(last)). No overflow: pos
// - window + 1 only when pos >= window, pos + window only when it is below L.
__device__ __forceinline__ int KeyLo(const AttnArgs& a, int pos) {
  return a.window > 0 && pos >= a.window ? pos - a.window + 1 : 0;
}
__device__ __forceinline__ int KeyHi(const AttnArgs& a, int L, int pos) {
  if (a.causal) return min(L, pos + 1);
  return a.window > 0 && L - pos > a.window ? pos + a.window : L;
}

// KV tiles the plan prices for each (request, KV head, query tile) unit of request ri: those of
// the request's visible range [KeyLo(L - n), L); with a window, capped by what one query tile can
// span (at most ceil(63 / group) + 1 queries, each window keys back, also forward when
// bidirectional, plus a tile of misalignment). Only a work estimate: the run splits each item's
// own tile range into split[r] pieces, whatever this returns.
__device__ __forceinline__ int PlanTiles(const AttnArgs& a, const ReqInfo& ri) {
  const int lo = KeyLo(a, ri.L - ri.n);  // 0 without a window: ceil(L / 64) tiles, as ever
  long long tiles = (ri.L + kBlockN - 1ll) / kBlockN - lo / kBlockN;
  if (a.window > 0) {
    const long long span = (kBlockM - 2 + a.group) / a.group;  // query positions minus 1
    const long long keys = span + static_cast<long long>(a.causal ? 1 : 2) * a.window;
    tiles = std::min(tiles, (keys + kBlockN - 1) / kBlockN + 1);
  }
  return static_cast<int>(std::max(tiles, 0ll));
}

// Last r with off[r] <= x (off non-decreasing, off[0] = 0 <= x < off[R]).
__device__ __forceinline__ int FindOwner(const int* off, int R, int x) {
  int lo = 0, hi = R - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (off[mid] <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Exclusive block scan of one int per thread (blockDim.x = 1024); returns the block total.
__device__ __forceinline__ int BlockExclusiveScan(int v, int* excl, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int w = warp_sums[lane];
    int wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += y;
    }
    warp_sums[lane] = wi - w;  // exclusive prefix of warp totals
    if (lane == 31) warp_sums[32] = wi;
  }
  __syncthreads();
  *excl = warp_sums[warp] + incl - v;
  const int total = warp_sums[32];
  __syncthreads();
  return total;
}

// True in some thread iff request r's used block-table entries hold a page id outside the cache
// or its kv_len overruns the table row (combine with __syncthreads_or). The CUDA-core path's
// check (a block per request and head); the tensor-core path reads the plan's bad[] instead.
__device__ __forceinline__ bool ThreadSeesBadPage(const AttnArgs& a, int r, int L) {
  const int32_t* bt = a.block_tables + static_cast<int64_t>(r) * a.max_pages;
  const int used = (L + a.page_size - 1) / a.page_size;
  bool bad = used > a.max_pages;
  for (int i = threadIdx.x; i < min(used, a.max_pages); i += blockDim.x) {
    const int page = bt[i];
    bad |= page < 0 || page >= a.num_pages;
  }
  return bad;
}

// ---- the plan ----------------------------------------------------------------------------------
__global__ void __launch_bounds__(1024) AttnPlanKernel(AttnArgs a, int target_ctas) {
  __shared__ int warp_sums[33];
  __shared__ int run_off[1024], bad_s[1024];
  __shared__ long long red_u[32], red_w[32], red_score[32];
  __shared__ int red_t[32], red_c[32];
  __shared__ int chunk_s;
  __shared__ int units_s[kPlanCache], tiles_s[kPlanCache];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Units U = sum h_kv * mtiles, work W = sum of their KV tiles, the most tiles of one unit; the
  // (units, tiles) of the requests with query rows gathered into shared memory, where the search
  // below reads them (fewer than target of them whenever it runs).
  long long U = 0, W = 0;
  int t_max = 0, n_active = 0;
  for (int base = 0; base < a.R; base += 1024) {
    const int r = base + tid;
    int units = 0, tiles = 0;
    if (r < a.R) {
      const ReqInfo ri = LoadReq(a, r);
      if (ri.mtiles > 0) {
        units = a.h_kv * ri.mtiles;
        tiles = PlanTiles(a, ri);
        U += units;
        W += static_cast<long long>(units) * tiles;
        t_max = max(t_max, tiles);
      }
    }
    int at;
    const int count = BlockExclusiveScan(units > 0 ? 1 : 0, &at, warp_sums);
    if (units > 0 && n_active + at < kPlanCache) {
      units_s[n_active + at] = units;
      tiles_s[n_active + at] = tiles;
    }
    n_active += count;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    U += __shfl_xor_sync(0xffffffffu, U, o);
    W += __shfl_xor_sync(0xffffffffu, W, o);
    t_max = max(t_max, __shfl_xor_sync(0xffffffffu, t_max, o));
  }
  if (lane == 0) {
    red_u[warp] = U;
    red_w[warp] = W;
    red_t[warp] = t_max;
  }
  __syncthreads();
  U = W = 0;
  t_max = 0;
  for (int i = 0; i < 32; ++i) {
    U += red_u[i];
    W += red_w[i];
    t_max = max(t_max, red_t[i]);
  }
  // The split by wave efficiency (attn_split.h): thread s prices candidate s over every request.
  int chunk = kNoSplit;
  if (!a.batch_invariant && U < target_ctas && t_max > 0) {
    const int c = SplitCandidate(t_max, FillOnceChunk(W, target_ctas), tid);
    SplitPlanCost pc;
    if (n_active <= kPlanCache) {
      for (int i = 0; i < n_active; ++i) AddUnits(pc, units_s[i], tiles_s[i], c);
    } else {
      for (int r = 0; r < a.R; ++r) {
        const ReqInfo ri = LoadReq(a, r);
        if (ri.mtiles > 0) AddUnits(pc, static_cast<long long>(a.h_kv) * ri.mtiles, PlanTiles(a, ri), c);
      }
    }
    long long score = SplitScore(pc, U, target_ctas);
    int best = c;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const long long so = __shfl_xor_sync(0xffffffffu, score, o);
      const int co = __shfl_xor_sync(0xffffffffu, best, o);
      if (SplitBetter(so, co, score, best)) {
        score = so;
        best = co;
      }
    }
    if (lane == 0) {
      red_score[warp] = score;
      red_c[warp] = best;
    }
    __syncthreads();
    if (tid == 0) {
      for (int i = 1; i < 32; ++i) {
        if (SplitBetter(red_score[i], red_c[i], score, best)) {
          score = red_score[i];
          best = red_c[i];
        }
      }
      chunk_s = best;
    }
    __syncthreads();
    chunk = chunk_s;
  }
  int carry_items = 0, carry_slots = 0;
  for (int base = 0; base < a.R; base += 1024) {
    const int r = base + tid;
    int items = 0, slots = 0, S = 1, runs = 0;
    if (r < a.R) {
      const ReqInfo ri = LoadReq(a, r);
      const int tiles = PlanTiles(a, ri);
      if (chunk != kNoSplit) S = max(1, (tiles + chunk - 1) / chunk);
      items = a.h_kv * ri.mtiles * S;
      slots = S > 1 ? items : 0;
      a.split[r] = S;
      const int used = (ri.L + a.page_size - 1) / a.page_size;
      bad_s[tid] = used > a.max_pages;
      runs = (max(0, min(used, a.max_pages)) + kBadRun - 1) / kBadRun;
    }
    int e_items, e_slots, e_runs;
    const int t_items = BlockExclusiveScan(items, &e_items, warp_sums);
    const int t_slots = BlockExclusiveScan(slots, &e_slots, warp_sums);
    const int t_runs = BlockExclusiveScan(runs, &e_runs, warp_sums);
    if (r < a.R) {
      a.item_off[r] = carry_items + e_items;
      a.slot_off[r] = carry_slots + e_slots;
    }
    carry_items += t_items;
    carry_slots += t_slots;
    // Bad metadata, once per forward (not per work item): the used block-table entries of these
    // requests, cut into runs of kBadRun, spread over the warps; 8 independent loads per lane.
    run_off[tid] = e_runs;
    __syncthreads();
    const int n_here = min(1024, a.R - base);
    for (int run = warp; run < t_runs; run += 32) {
      const int i = FindOwner(run_off, n_here, run);
      const int rr = base + i;
      const int used = min((a.kv_lens[rr] + a.page_size - 1) / a.page_size, a.max_pages);
      const int32_t* bt = a.block_tables + static_cast<int64_t>(rr) * a.max_pages;
      const int first = (run - run_off[i]) * kBadRun + lane;
      bool bad = false;
#pragma unroll
      for (int k = 0; k < kBadRun / 32; ++k) {
        const int e = first + 32 * k;
        if (e < used) {
          const int page = __ldg(bt + e);
          bad |= page < 0 || page >= a.num_pages;
        }
      }
      if (__any_sync(0xffffffffu, bad) && lane == 0) bad_s[i] = 1;  // several runs may store 1
    }
    __syncthreads();
    if (r < a.R) a.bad[r] = bad_s[tid];
    __syncthreads();  // run_off and bad_s are rewritten for the next requests
  }
  if (tid == 0) {
    a.item_off[a.R] = carry_items;
    a.slot_off[a.R] = carry_slots;
  }
  // Every unit's ticket starts at zero (slots past the plan's are never touched).
  for (int i = tid; i < 2 * target_ctas; i += 1024) a.tickets[i] = 0;
}

}  // namespace
}  // namespace dspark::cuda
