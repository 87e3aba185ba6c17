// markov_sample on the GPU: the whole sequential drafting stage (DESIGN §2 steps 2-3) for R
// requests and gamma steps, with no return to the host. Semantics: reference.markov_sample.
//
// Shape of the work. Every step k needs x_{k-1} of every request, i.e. a finished argmax over
// the whole vocabulary, so a step is a grid-wide sweep followed by a grid-wide reduction:
//   * MarkovSweepKernel (many blocks): tiles the vocabulary; each block streams its tile of W2
//     rows from HBM ONCE for all requests of the group (bias = W2_tile @ e_eff^T, tensor cores
//     for 16-bit weights), adds the bias into the logits in place (z), and folds z / T, the
//     Gumbel score (Philox) and the log-sum-exp into one partial per (block, request).
//   * MarkovStepKernel (one block per request): merges the partials in a fixed order into x_k,
//     lse_k, logprob_k, then prepares step k + 1: e = W1[x_k], the gated head's gate, the
//     confidence logit.
// The gamma steps are 2 gamma stream-ordered launches (plus one prologue) whatever the batch
// size. A persistent cooperative kernel with a grid barrier would remove the launch gaps, but
// needs every block co-resident and a barrier about as costly; two launches per step keep each
// kernel's resources independent, and on sm_90+ they are programmatic dependent launches (each
// kernel's blocks start while its predecessor drains), which removes most of the gap and stays
// capturable in a CUDA graph. Per step the floor is
// W2's bytes (77.8 MB in bf16 for V = 151936, r = 256: ~18 us at 4.3 TB/s) plus the logits.
//
// Types: T is the logits' (z and every rounding of the head's arithmetic, as the reference
// rounds it), W the weights' and hidden's (W = T, or 16-bit under float logits: a bf16 model's
// head streams 2-byte W2 through tensor cores and still forms z in float32). Out of place
// (p.u), U is read from p.u and z written over p.logits; U may then be in W under float T (a
// 16-bit model's LM head output as it is: 2 bytes read per entry instead of a 6-byte cast pass
// before the call and 4 bytes read in it).
//
// Requests are processed in groups of up to 64 (the bias tile and e_eff of a group live in
// shared memory); all groups share one sweep launch per step, their blocks co-resident and
// walking the same tiles in step, so W2 streams from HBM once per step for the whole batch and
// each further group reads the tile from L2 (H200: 50 MB of L2 against ~1-2 MB of tiles in
// flight per group per wave). The RNN head returns kUnsupported: its state update needs a
// (3r x (2r + d)) matvec per step and request, and the ops door (dspark_rt/ops/markov.py,
// _markov_backend) routes rnn on CUDA tensors to the reference.
// The selector head (top-k candidates, no vocabulary-wide W2 sweep) lives in markov_select.cu.
// A grammar's token bitmask (p.token_bitmask, null: none) masks step 1 in the sweep's epilogue,
// right after z = U + bias: forbidden entries are written as -inf and enter the partials as
// such, so x_1, lse_1 and the z read back by the acceptance describe the masked proposal.
//
// Epilogue cost. Per 128-entry item a warp spends ~190 instructions at T > 0 (Philox and float
// Gumbels where the pre-filter lets them through, the z arithmetic, one exp per entry): the
// argmax and log-sum-exp state stays in each lane, in registers within a tile and in shared
// memory between tiles, and is reduced once per request and block at the end of the sweep (it
// was reduced through warp shuffles of doubles for every item, ~1,000-1,500 instructions).
// U is prefetched into L2 while the bias tile computes, read and z written with evict-first
// hints, so that W2 keeps its L2 lines for the other request groups.
//
// NOTE: a one-pass Hopper design (not implemented; bench/paper_model.py prices today's).
//   * Persistent sweep: one CTA an SM owns a contiguous vocabulary range for all gamma steps; a
//     producer warp feeds W2 tiles (64 rows x r) by TMA into a 4-stage shared-memory ring
//     (mbarrier), two consumer warpgroups run wgmma m64nNk16 with N = the group's requests
//     (A = the W2 tile, B = e_eff^T in shared memory), stage the accumulators (stmatrix) and run
//     this file's per-lane epilogue on them; U arrives by TMA too (evict-first), z leaves by
//     TMA stores.
//   * Per step, instead of two launches: each CTA writes its partials and takes a ticket per
//     request group; the last one merges the partials, writes x_k, e_eff (and the gate) and
//     releases a flag the others spin on (acquire loads): ~3 L2 round trips plus the W1 row,
//     ~1.5 us, against ~3.8 us of dependent launches, ramps and the step kernel today.
//   * Estimate (the model's constants, bf16 head, V 151936, r 256): R = 1, gamma = 7: 18.1 us of
//     W2 + 1.5 us a step, ~144 us a call against a 128 us floor (89%; the two-launch design
//     after this change: ~164 us, 78%). R = 256: wgmma at ~800 TFLOP/s (20 GFLOP a step: 25 us)
//     stays under the 72 us byte floor either way; the gain is the serial tail, 7 x 2.3 us, ~98%
//     of floor against ~94%. Worth its ~600 lines at R = 1 only, and only once a lease confirms
//     the two-launch design's serial tail at the size modelled.
#include "markov_sample.h"

#include <algorithm>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/head_proj.cuh"
#include "cuda/markov_select.cuh"
#include "cuda/mma.cuh"
#include "cuda/sampling.cuh"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxGroup = 64;   // requests sharing one W2 sweep
constexpr int kItem = 128;      // vocabulary entries per epilogue item: 32 lanes x 4
constexpr int kMaxRank = 1024;  // e lives in a static shared array of the step kernel
constexpr int kPrefetch = 32 * 1024;      // W2 bytes a sweep block prefetches before its wait
constexpr int kPrefetchNext = 64 * 1024;  // ... and of its next tile while it computes one

// One block's summary of one request over the vocabulary it swept.
struct Partial {
  double best;  // exact score of the winner
  int idx;      // its vocabulary index
  float m;      // log-sum-exp state (sampling.cuh)
  double s;
};

struct SweepArgs {
  void* logits;           // [R, gamma, V] z (and U when in place)
  const void* u;          // [R, gamma, V] U: logits itself, or another buffer (out of place)
  const void* w2;         // [V, rank]
  const void* e_eff;      // [R, rank] in the weight dtype: e, or g * e for the gated head
  const float* temperature;
  const uint64_t* seed;
  const int64_t* stream;
  const int64_t* round;
  const uint8_t* coupled;  // [R] or null: Gumbel-coupled noise (philox.h SiteOf)
  const int32_t* mask;    // [R, words] or null: the grammar's token bitmask of step 1
  int words;              // ceil(V / 32)
  Partial* partials;      // [groups, gblocks, G]
  int R, G, gblocks;      // requests, group size (the last group may be smaller), blocks per group
  int gamma, V, rank, k, tv;
  int es_stride;          // row stride of e in shared memory (elements)
  int wpr;                // epilogue warps per request (slots per request)
  int off_bias, off_slot_m, off_slot_idx, off_es;  // shared-memory layout (bytes)
  bool has_bias;
  bool vec;               // logits rows allow 4-element vector access
  bool w2_vec;            // W2 rows allow 4-element vector access (FFMA path)
};

// ---- bias tile: tensor cores ------------------------------------------------------------------
// Warp w computes m-tiles of 16 vocabulary rows (M) x 8 requests (N) with K = rank. A = W2 rows
// straight from global memory, B = e from shared memory.
// NOTE: the K order inside each 32-column chunk is permuted so that one 16-byte load per row
// feeds two mma k-steps: thread t holds columns 8t..8t+7 and uses (8t, 8t+1 | 8t+2, 8t+3) as
// logical k (2t, 2t+1 | 2t+8, 2t+9) of the first k-step and 8t+4..8t+7 for the second. A dot
// product does not care about the order of k as long as A and B agree, and they do.
template <class W>
__device__ __forceinline__ void BiasTileMma(const SweepArgs& a, int G, const W* es, float* bias, int v0) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int bs = a.tv + 4, rank = a.rank, V = a.V;
  const int nt_count = (G + 7) >> 3;
  const W* w2 = static_cast<const W*>(a.w2);
  for (int mt = warp; mt < a.tv / 16; mt += kWarps) {
    if (v0 + mt * 16 >= V) break;
    const int r0 = v0 + mt * 16 + g, r1 = r0 + 8;
    float acc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    for (int kb = 0; kb < rank; kb += 128) {
      uint4 a0[4], a1[4];
      // NOTE: all eight 16-byte loads of the slab are issued before the first mma so each warp
      // keeps 4 KB of W2 in flight.
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int col = kb + c * 32 + t * 8;
        const bool ok = kb + c * 32 < rank;
        a0[c] = (ok && r0 < V) ? LdgStream(w2 + static_cast<int64_t>(r0) * rank + col) : make_uint4(0, 0, 0, 0);
        a1[c] = (ok && r1 < V) ? LdgStream(w2 + static_cast<int64_t>(r1) * rank + col) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (kb + c * 32 < rank) {
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            if (nt < nt_count) {
              const uint4 b = *reinterpret_cast<const uint4*>(es + (nt * 8 + g) * a.es_stride + kb + c * 32 + t * 8);
              Mma16816<W>(acc[nt], a0[c].x, a1[c].x, a0[c].y, a1[c].y, b.x, b.y);
              Mma16816<W>(acc[nt], a0[c].z, a1[c].z, a0[c].w, a1[c].w, b.z, b.w);
            }
          }
        }
      }
    }
    // C fragment -> bias[request][vocab]; bs = tv + 4 makes these stores conflict-free.
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt < nt_count) {
        const int req = nt * 8 + 2 * t, row = mt * 16 + g;
        bias[req * bs + row] = acc[nt][0];
        bias[(req + 1) * bs + row] = acc[nt][1];
        bias[req * bs + row + 8] = acc[nt][2];
        bias[(req + 1) * bs + row + 8] = acc[nt][3];
      }
    }
  }
}

// ---- bias tile: CUDA cores (float32, or ranks the tensor-core path cannot take) ---------------
// Thread = (vocabulary row, group of 8 requests); e is read from shared memory as a broadcast.
template <class W>
__device__ __forceinline__ void BiasTileFfma(const SweepArgs& a, int G, const float* es, float* bias, int v0) {
  const int bs = a.tv + 4, rank = a.rank, ngrp = (G + 7) >> 3;
  const W* w2 = static_cast<const W*>(a.w2);
  for (int i = threadIdx.x; i < a.tv * ngrp; i += kThreads) {
    const int vl = i % a.tv, grp = i / a.tv, row = v0 + vl;
    if (row >= a.V) continue;
    const W* wr = w2 + static_cast<int64_t>(row) * rank;
    const float* eb = es + grp * 8 * a.es_stride;
    float acc[8] = {};
    if (a.w2_vec) {
      for (int j = 0; j < rank; j += 4) {
        const float4 w = Load4(wr + j);
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const float4 e = *reinterpret_cast<const float4*>(eb + q * a.es_stride + j);
          acc[q] = fmaf(w.x, e.x, fmaf(w.y, e.y, fmaf(w.z, e.z, fmaf(w.w, e.w, acc[q]))));
        }
      }
    } else {
      for (int j = 0; j < rank; ++j) {
        const float w = ToFloat(wr[j]);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = fmaf(w, eb[q * a.es_stride + j], acc[q]);
      }
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      if (grp * 8 + q < G) bias[(grp * 8 + q) * bs + vl] = acc[q];
    }
  }
}

// Up to `cap` bytes of W2 tile `tile` into L2 (a hint: W2 is an input no kernel here writes).
template <class W>
__device__ __forceinline__ void PrefetchTile(const SweepArgs& a, int tile, int64_t cap) {
  const int64_t v0 = static_cast<int64_t>(tile) * a.tv;
  if (v0 >= a.V) return;
  const char* w2 = reinterpret_cast<const char*>(static_cast<const W*>(a.w2) + v0 * a.rank);
  const int64_t bytes = std::min<int64_t>(cap, std::min<int64_t>(a.tv, a.V - v0) * a.rank * sizeof(W));
  for (int64_t off = threadIdx.x * 128ll; off < bytes; off += kThreads * 128ll) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(__cvta_generic_to_global(w2 + off)));
  }
}

// The head of every U row of a tile into L2 (a hint; the clamp keeps each address inside its row).
template <class U>
__device__ __forceinline__ void PrefetchU(const U* ulogits, int G, int gamma, int k, int V, int v0, int tv) {
  const int64_t bytes = static_cast<int64_t>(min(tv, V - v0)) * sizeof(U);
  const int lines = static_cast<int>((bytes + 127) / 128) + 1;  // + 1: rows need not start on a line
  for (int i = threadIdx.x; i < G * lines; i += kThreads) {
    const int rq = i / lines, l = i - rq * lines;
    const char* p = reinterpret_cast<const char*>(ulogits + (static_cast<int64_t>(rq) * gamma + k) * V + v0);
    const int64_t off = l * 128ll < bytes ? l * 128ll : bytes - 1;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(__cvta_generic_to_global(p + off)));
  }
}

// Four U entries (16 or 8 bytes, vector-aligned) as floats, evict-first and coherent (in place,
// the sweep writes z over them).
__device__ __forceinline__ float4 LoadU4(const float* p, uint64_t pol) {
  const uint4 u = LdStream16Coherent(p, pol);
  return make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z), __uint_as_float(u.w));
}
template <class H>
__device__ __forceinline__ float4 LoadU4(const H* p, uint64_t pol) {
  const uint2 u = LdStream8Coherent(p, pol);
  return make_float4(ToFloat(Bits16<H>(u.x)), ToFloat(Bits16<H>(u.x >> 16)), ToFloat(Bits16<H>(u.y)),
                     ToFloat(Bits16<H>(u.y >> 16)));
}
// Four z entries, streaming (evict-first; the acceptance reads z once, a round later).
__device__ __forceinline__ void StoreZ4(float* p, float4 v, uint64_t pol) {
  StStream16(p, make_uint4(__float_as_uint(v.x), __float_as_uint(v.y), __float_as_uint(v.z), __float_as_uint(v.w)), pol);
}
template <class H>
__device__ __forceinline__ void StoreZ4(H* p, float4 v, uint64_t pol) {
  const uint32_t lo = Pack16(FromFloat<H>(v.x)) | (Pack16(FromFloat<H>(v.y)) << 16);
  const uint32_t hi = Pack16(FromFloat<H>(v.z)) | (Pack16(FromFloat<H>(v.w)) << 16);
  StStream8(p, make_uint2(lo, hi), pol);
}

// ---- the sweep --------------------------------------------------------------------------------
template <class T, class W, bool kMma, class U>
__global__ void __launch_bounds__(kThreads) MarkovSweepKernel(SweepArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  // Block = (request group, tile cursor): the groups' blocks are co-resident and walk the same
  // tiles in the same order, so each W2 tile streams from HBM once and every other group finds
  // it in L2.
  const int group = blockIdx.x / a.gblocks, bx = blockIdx.x - group * a.gblocks;
  const int r0 = group * a.G, G = min(a.G, a.R - r0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  T* const logits = static_cast<T*>(a.logits) + static_cast<int64_t>(r0) * a.gamma * a.V;
  const U* const ulogits = static_cast<const U*>(a.u) + static_cast<int64_t>(r0) * a.gamma * a.V;
  const bool masked = a.mask && a.k == 0;  // this step reads the grammar's mask
  // no head in place and no mask: z is U already
  const bool write_z = a.has_bias || a.u != a.logits || masked;
  const float* const temperature = a.temperature + r0;
  const int gpad = (G + 7) & ~7, bs = a.tv + 4;
  // Per-lane running statistics of every slot (request, sub) between tiles: [G * wpr][32]; a
  // lane only touches its own entries, so they need no barrier. NOTE: the sum is kept in float
  // here (one rounding per tile a lane carries it over, ~6e-8 relative each) and in double in
  // registers: 20 bytes a lane, so that a 64-request group still fits two blocks an SM.
  const int nlane = a.G * a.wpr * 32;
  double* lane_best = reinterpret_cast<double*>(smem);
  float* bias = reinterpret_cast<float*>(smem + a.off_bias);  // [gpad][tv + 4]
  float* lane_m = reinterpret_cast<float*>(smem + a.off_slot_m);
  float* lane_s = lane_m + nlane;
  int* lane_idx = reinterpret_cast<int*>(smem + a.off_slot_idx);

  for (int i = threadIdx.x; i < nlane; i += kThreads) {
    lane_best[i] = -kInfD;
    lane_idx[i] = 0x7fffffff;
    lane_m[i] = -kInfF;
    lane_s[i] = 0.f;
  }
  // While the previous step kernel finishes (dependent launch): the head of this block's first
  // W2 tile into L2.
  if (a.has_bias) PrefetchTile<W>(a, bx, kPrefetch);
  GridDependencyWait();  // e_eff and the partials' previous readers: the step kernel
  GridDependentsMayLaunch();
  if (a.has_bias) {
    // e_eff of every request (zero rows pad the group to a multiple of 8 for the mma N tiles).
    const W* eg = static_cast<const W*>(a.e_eff) + static_cast<int64_t>(r0) * a.rank;
    for (int i = threadIdx.x; i < gpad * a.es_stride; i += kThreads) {
      const int row = i / a.es_stride, j = i - row * a.es_stride;
      const W val = (row < G && j < a.rank) ? eg[row * a.rank + j] : FromFloat<W>(0.f);
      if constexpr (kMma) {
        reinterpret_cast<W*>(smem + a.off_es)[i] = val;
      } else {
        reinterpret_cast<float*>(smem + a.off_es)[i] = ToFloat(val);
      }
    }
  }
  __syncthreads();

  const int chunks = a.tv / kItem;
  const int ntiles = (a.V + a.tv - 1) / a.tv;
  const uint64_t pol = EvictFirstPolicy();
  for (int tile = bx; tile < ntiles; tile += a.gblocks) {
    const int v0 = tile * a.tv;
    // This tile's U rows into L2 while the bias tile computes: the epilogue's loads then wait on
    // L2, not HBM.
    PrefetchU<U>(ulogits, G, a.gamma, a.k, a.V, v0, a.tv);
    if (a.has_bias) {
      if constexpr (kMma) {
        BiasTileMma<W>(a, G, reinterpret_cast<const W*>(smem + a.off_es), bias, v0);
      } else {
        BiasTileFfma<W>(a, G, reinterpret_cast<const float*>(smem + a.off_es), bias, v0);
      }
    }
    __syncthreads();
    // The next tile's W2 streams into L2 while this one's epilogue computes.
    if (a.has_bias && tile + a.gblocks < ntiles) PrefetchTile<W>(a, tile + a.gblocks, kPrefetchNext);

    // Epilogue. Slot = (request, sub): a warp takes a slot's chunks sub, sub + wpr, ... of the
    // tile (item = 128 entries, lane = 4 consecutive entries: one Philox call), with the lane's
    // running statistics in registers; they live in shared memory between tiles, and the block
    // reduces them once per request at the end. Per entry that leaves the z arithmetic, the exp
    // of the log-sum-exp, and (sampled) Philox and a float Gumbel where the pre-filter lets it.
    for (int slot = warp; slot < G * a.wpr; slot += kWarps) {
      const int rq = slot / a.wpr, sub = slot - rq * a.wpr, ls = slot * 32 + lane;
      const int64_t ro = (static_cast<int64_t>(rq) * a.gamma + a.k) * a.V;
      T* row = logits + ro;
      const U* urow = ulogits + ro;
      const float tf = temperature[rq];
      const bool greedy = tf == 0.f;
      const float inv_t = greedy ? 1.f : 1.f / tf;
      const double td = greedy ? 1.0 : static_cast<double>(tf);
      const int rg = r0 + rq;  // the request's index in the batch
      const NoiseSite site = SiteOf(
          PhiloxKey{a.seed[rg], static_cast<uint32_t>(a.stream[rg]), static_cast<uint32_t>(a.round[rg])},
          a.coupled && a.coupled[rg], kPurposeDraft, a.k + 1);
      ArgMax am{lane_best[ls], lane_idx[ls]};
      LogSumExp lse{lane_m[ls], lane_s[ls]};
      // the warp's best score so far (sampled): a float that never lies below an exact score
      // by more than ScoreMargin; -inf until this block has seen the request
      float best_f = WarpMax(static_cast<float>(am.best));
      float gbest = static_cast<float>(am.best);  // greedy: am in float (exact: scores are floats)
      int gidx = am.idx;
      for (int c = sub; c < chunks; c += a.wpr) {
        const int vb = v0 + c * kItem;
        if (vb >= a.V) break;  // warp-uniform
        const int v = vb + lane * 4;
        const int nvalid = max(0, min(4, a.V - v));
        float4 x = make_float4(-kInfF, -kInfF, -kInfF, -kInfF);
        if (nvalid == 4 && a.vec) {
          // a coherent load: in place, this kernel writes the row back below (z = U + bias), and a
          // read-only (.nc) load of memory the same kernel writes is only safe by accident
          x = LoadU4(urow + v, pol);
        } else {
          if (nvalid > 0) x.x = ToFloat(urow[v]);
          if (nvalid > 1) x.y = ToFloat(urow[v + 1]);
          if (nvalid > 2) x.z = ToFloat(urow[v + 2]);
          if (nvalid > 3) x.w = ToFloat(urow[v + 3]);
        }
        if (a.has_bias) {
          // z = U + bias with the reference's roundings: bias rounded to T, then the sum.
          const float4 b = *reinterpret_cast<const float4*>(bias + rq * bs + c * kItem + lane * 4);
          x.x = RoundTo<T>(x.x + RoundTo<T>(b.x));
          x.y = RoundTo<T>(x.y + RoundTo<T>(b.y));
          x.z = RoundTo<T>(x.z + RoundTo<T>(b.z));
          x.w = RoundTo<T>(x.w + RoundTo<T>(b.w));
        }
        // NOTE: v is a multiple of 4 (one mask word holds the quad); past V nothing is read.
        if (masked && nvalid > 0) x = MaskQuad(x, a.mask + static_cast<int64_t>(rg) * a.words, v);
        if (write_z) {  // U widened from the 16-bit weight dtype is exact in T
          if (nvalid == 4 && a.vec) {
            StoreZ4(row + v, x, pol);  // streaming: z is read back once, by the acceptance
          } else {
            if (nvalid > 0) row[v] = FromFloat<T>(x.x);
            if (nvalid > 1) row[v + 1] = FromFloat<T>(x.y);
            if (nvalid > 2) row[v + 2] = FromFloat<T>(x.z);
            if (nvalid > 3) row[v + 3] = FromFloat<T>(x.w);
          }
        }
        if (nvalid < 4) {  // invalid entries take no part in the max, the sum or the argmax
          if (nvalid < 1) x.x = -kInfF;
          if (nvalid < 2) x.y = -kInfF;
          if (nvalid < 3) x.z = -kInfF;
          x.w = -kInfF;
        }
        lse.Add4Pairwise(x, inv_t);
        if (greedy) {
          OfferMax4(gbest, gidx, x, v, nvalid);
          continue;
        }
        if (best_f == -kInfF) {
          // First item of the request in this block (warp-uniform): seed the pre-filter with the
          // exact score of the item's largest logit, so that entries more than ~17.5 T below it
          // skip Philox from the start.
          const float xmax = WarpMax(fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w)));
          if (xmax > -kInfF && xmax < kInfF) {
            const float xs[4] = {x.x, x.y, x.z, x.w};
            int jm = 4;
#pragma unroll
            for (int j = 3; j >= 0; --j) {
              if (xs[j] == xmax) jm = j;
            }
            const unsigned ball = __ballot_sync(0xffffffffu, jm < 4);
            const int src = __ffs(ball) - 1;
            double sc = 0.0;
            if (lane == src) {
              const uint4 w = PhiloxQuad(site.key, site.purpose, site.position, static_cast<uint32_t>(v) >> 2);
              const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
              uint32_t word = ws[0];
#pragma unroll
              for (int j = 1; j < 4; ++j) {
                if (j == jm) word = ws[j];
              }
              sc = static_cast<double>(xmax) / td + GumbelExact(word);
              am.Offer(sc, v + jm);
            }
            best_f = static_cast<float>(__shfl_sync(0xffffffffu, sc, src));
          }
        }
        OfferGumbel4(am, best_f, x, v, nvalid, inv_t, td, site.key, site.purpose, site.position);
        best_f = WarpMax(best_f);  // every lane prunes against the warp's best
      }
      if (greedy) am = ArgMax{static_cast<double>(gbest), gidx};
      lane_best[ls] = am.best;
      lane_idx[ls] = am.idx;
      lane_m[ls] = lse.m;
      lane_s[ls] = static_cast<float>(lse.s);
    }
    __syncthreads();  // the next tile overwrites the bias tile
  }

  // One reduction per request: its slots' lanes in a fixed order, then the warp.
  for (int rq = warp; rq < G; rq += kWarps) {
    const float tf = temperature[rq];
    const float inv_t = tf == 0.f ? 1.f : 1.f / tf;
    ArgMax am;
    am.Init();
    LogSumExp lse;
    lse.Init();
    for (int sub = 0; sub < a.wpr; ++sub) {
      const int ls = (rq * a.wpr + sub) * 32 + lane;
      am.Merge(ArgMax{lane_best[ls], lane_idx[ls]});
      lse.Merge(LogSumExp{lane_m[ls], lane_s[ls]}, inv_t);
    }
    am.WarpMerge();
    lse.WarpMerge(inv_t);
    if (lane == 0) a.partials[static_cast<int64_t>(blockIdx.x) * a.G + rq] = Partial{am.best, am.idx, lse.m, lse.s};
  }
}

// ---- the per-step reduction and the next step's head state ------------------------------------
struct StepArgs {
  void* logits;  // [R, gamma, V]
  const void* hidden;
  const int64_t* anchor;
  const void* w1;
  const void* gate_w;
  const void* gate_b;
  const void* conf_w;
  const void* conf_b;
  const float* temperature;
  int64_t* tokens;
  float* logprob;
  float* lse;
  float* conf_logit;
  const Partial* partials;  // [groups, nblocks, G]: the sweep's, request rq in group rq / G
  void* e_eff;              // [R, rank]
  const float* hg;          // [R, gamma, rank] gate_w[:, :d] @ h_k (gated head)
  const float* hc;          // [R, gamma] conf_w[:d] . h_k (confidence head)
  int G, gamma, V, rank, d, k, nblocks;
  MarkovHead head;
  bool confidence, confidence_markov;
};

// Finishes step k (k >= 0) and prepares step k + 1; k = -1 prepares step 0 from the anchors.
template <class T, class W>
__global__ void __launch_bounds__(kThreads) MarkovStepKernel(StepArgs a) {
  __shared__ float e_s[kMaxRank];
  __shared__ double red_best[kWarps], red_s[kWarps];
  __shared__ int red_idx[kWarps];
  __shared__ float red_m[kWarps];
  __shared__ float red_f[32];
  __shared__ int x_s;
  const int rq = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  GridDependencyWait();  // the sweep's partials and z; e_eff, which the sweep reads
  // the last step's successor is someone else's kernel: it starts only when this one is done
  // (the partials it reads are freed right after)
  if (a.k + 1 < a.gamma) GridDependentsMayLaunch();
  int x;
  if (a.k >= 0) {
    const float tf = a.temperature[rq];
    const float inv_t = tf == 0.f ? 1.f : 1.f / tf;
    const double td = tf == 0.f ? 1.0 : static_cast<double>(tf);
    ArgMax am;
    am.Init();
    LogSumExp lse;
    lse.Init();
    const int group = rq / a.G;
    const Partial* partials = a.partials + static_cast<int64_t>(group) * a.nblocks * a.G + (rq - group * a.G);
    for (int b = threadIdx.x; b < a.nblocks; b += kThreads) {
      const Partial p = partials[static_cast<int64_t>(b) * a.G];
      am.Merge(ArgMax{p.best, p.idx});
      lse.Merge(LogSumExp{p.m, p.s}, inv_t);
    }
    am.WarpMerge();
    lse.WarpMerge(inv_t);
    if (lane == 0) {
      red_best[warp] = am.best;
      red_idx[warp] = am.idx;
      red_m[warp] = lse.m;
      red_s[warp] = lse.s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarps; ++w) {
        am.Merge(ArgMax{red_best[w], red_idx[w]});
        lse.Merge(LogSumExp{red_m[w], red_s[w]}, inv_t);
      }
      const int xk = (am.idx >= 0 && am.idx < a.V) ? am.idx : 0;
      const double l = lse.Value(td);
      const T* row = static_cast<const T*>(a.logits) + (static_cast<int64_t>(rq) * a.gamma + a.k) * a.V;
      const double zx = static_cast<double>(ToFloat(row[xk]));
      const int64_t o = static_cast<int64_t>(rq) * a.gamma + a.k;
      a.tokens[o] = xk;
      a.lse[o] = static_cast<float>(l);
      a.logprob[o] = static_cast<float>(zx / td - l);
      x_s = xk;
    }
    __syncthreads();
    x = x_s;
  } else {
    const int64_t x0 = a.anchor[rq];
    x = (x0 >= 0 && x0 < a.V) ? static_cast<int>(x0) : 0;
  }

  const int kn = a.k + 1;
  if (kn >= a.gamma) return;
  const bool gated = a.head == MarkovHead::kGated;
  const bool need_e = a.head == MarkovHead::kVanilla || gated || (a.confidence && a.confidence_markov);
  const W* w1 = static_cast<const W*>(a.w1);
  if (need_e) {
    for (int j = threadIdx.x; j < a.rank; j += kThreads) e_s[j] = ToFloat(w1[static_cast<int64_t>(x) * a.rank + j]);
    __syncthreads();
  }
  W* e_out = static_cast<W*>(a.e_eff) + static_cast<int64_t>(rq) * a.rank;
  if (gated) {
    // g = sigmoid(gate_w @ [h; e] + gate_b), rounded as the reference rounds each op; the h half
    // of the product was computed once for all steps by HeadProjKernel.
    const W* gw = static_cast<const W*>(a.gate_w);
    const W* gb = static_cast<const W*>(a.gate_b);
    const int ld = a.d + a.rank;
    const float* hg = a.hg + (static_cast<int64_t>(rq) * a.gamma + kn) * a.rank;
    // NOTE: kGateRows rows a warp at once, their loads issued together: a warp walks
    // rank / (8 kGateRows) dependent rounds to L2 instead of rank / 8 (the serial tail of a step).
    constexpr int kGateRows = 4;
    for (int i0 = warp; i0 < a.rank; i0 += kGateRows * kWarps) {
      float acc[kGateRows] = {};
#pragma unroll
      for (int u = 0; u < kGateRows; ++u) {
        const int i = i0 + u * kWarps;
        if (i < a.rank) {
          const W* wr = gw + static_cast<int64_t>(i) * ld + a.d;
          for (int j = lane; j < a.rank; j += 32) acc[u] = fmaf(ToFloat(wr[j]), e_s[j], acc[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kGateRows; ++u) {
        const int i = i0 + u * kWarps;
        const float dot = WarpSum(acc[u]);
        if (lane == 0 && i < a.rank) {
          const float pre = RoundTo<T>(RoundTo<T>(dot + hg[i]) + ToFloat(gb[i]));
          const float gate = RoundTo<T>(1.f / (1.f + expf(-pre)));
          e_out[i] = FromFloat<W>(RoundTo<T>(gate * e_s[i]));  // g * e in T, then W
        }
      }
    }
  } else if (a.head == MarkovHead::kVanilla) {
    for (int j = threadIdx.x; j < a.rank; j += kThreads) e_out[j] = w1[static_cast<int64_t>(x) * a.rank + j];
  }
  if (a.confidence) {
    float dot = 0.f;
    if (a.confidence_markov) {
      const W* cw = static_cast<const W*>(a.conf_w) + a.d;
      for (int j = threadIdx.x; j < a.rank; j += kThreads) dot = fmaf(ToFloat(cw[j]), e_s[j], dot);
    }
    dot = BlockSum(dot, red_f);
    if (threadIdx.x == 0) {
      const int64_t o = static_cast<int64_t>(rq) * a.gamma + kn;
      const float cb = ToFloat(static_cast<const W*>(a.conf_b)[0]);
      a.conf_logit[o] = RoundTo<T>(RoundTo<T>(a.hc[o] + dot) + cb);
    }
  }
}

// ---- host --------------------------------------------------------------------------------------
struct SweepLayout {
  int tv = 0, es_stride = 0, wpr = 1;
  int off_bias = 0, off_slot_m = 0, off_slot_idx = 0, off_es = 0, bytes = 0;
};

int AlignUp(int x, int a) { return (x + a - 1) / a * a; }

// Largest vocabulary tile of a group: keeps the bias tile near 32 KB.
int MaxTile(int G) { return kItem * std::max(1, 8 / (AlignUp(G, 8) / 8)); }

SweepLayout MakeSweepLayout(int G, int tv, int rank, bool mma, int elem_bytes, bool has_bias) {
  SweepLayout l;
  const int gpad = AlignUp(G, 8);
  l.tv = tv;
  if (mma) {
    // Row stride = 64 (mod 128) bytes: the 8 lanes of an LDS.128 phase hit disjoint banks.
    l.es_stride = rank % 64 == 32 ? rank : rank + 32;
  } else {
    l.es_stride = AlignUp(rank, 4);
  }
  // Warps per request in the epilogue: a group smaller than the block's warps spreads each
  // request's items over several warps (slots), so no warp idles at R = 1.
  l.wpr = G >= kWarps ? 1 : kWarps / G;
  const int nlane = G * l.wpr * 32;
  int off = nlane * 8;  // lane_best
  l.off_bias = off;
  off += has_bias ? gpad * (l.tv + 4) * 4 : 0;
  l.off_slot_m = off;
  off += 2 * nlane * 4;  // lane_m, lane_s
  l.off_slot_idx = off;
  off += nlane * 4;
  off = AlignUp(off, 16);
  l.off_es = off;
  off += has_bias ? gpad * l.es_stride * (mma ? elem_bytes : 4) : 0;
  l.bytes = AlignUp(off, 16);
  return l;
}

using SweepKernel = void (*)(SweepArgs);

// The sweep variant a call needs: tensor cores (16-bit weights only), and U in the 16-bit weight
// dtype under float logits (out of place) or in T. Null: no such variant.
template <class T, class W>
SweepKernel SweepFor(bool mma, bool narrow_u) {
  if constexpr (sizeof(W) == 2 && !std::is_same_v<T, W>) {
    if (narrow_u) return mma ? MarkovSweepKernel<T, W, true, W> : MarkovSweepKernel<T, W, false, W>;
  }
  if (narrow_u) return nullptr;
  if constexpr (sizeof(W) == 2) {
    if (mma) return MarkovSweepKernel<T, W, true, T>;
  }
  return MarkovSweepKernel<T, W, false, T>;
}

Status AllowSmem(SweepKernel kernel, int smem) {
  if (smem > 48 * 1024 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    return Status::kCudaError;
  }
  return Status::kOk;
}

// Co-resident blocks of the sweep at this shared-memory size.
Status SweepGrid(SweepKernel kernel, int smem, const DeviceLimits& lim, int* blocks) {
  if (Status st = AllowSmem(kernel, smem); st != Status::kOk) return st;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem) != cudaSuccess) {
    return Status::kCudaError;
  }
  *blocks = std::max(1, per_sm) * lim.sm_count;
  return Status::kOk;
}

Status LaunchSweep(SweepKernel kernel, const SweepArgs& a, int smem, int blocks, cudaStream_t stream,
                   bool dependent) {
  if (Status st = AllowSmem(kernel, smem); st != Status::kOk) return st;
  return LaunchKernel(kernel, dim3(blocks), dim3(kThreads), smem, stream, dependent, a);
}

template <class T, class W>
Status MarkovLaunch(const MarkovSampleParams& p, cudaStream_t stream) {
  DeviceLimits lim;
  if (Status s = CurrentDeviceLimits(&lim); s != Status::kOk) return s;
  const int R = static_cast<int>(p.R), gamma = static_cast<int>(p.gamma), V = static_cast<int>(p.V);
  const int rank = static_cast<int>(p.rank), d = static_cast<int>(p.d);
  const bool has_bias = p.head == MarkovHead::kVanilla || p.head == MarkovHead::kGated;
  const bool gated = p.head == MarkovHead::kGated;
  constexpr int kElem = sizeof(W);  // weights; the logits are T
  const bool mma = has_bias && kElem == 2 && rank % 32 == 0 && Aligned(p.w2, 16);
  const bool narrow_u = p.u && p.u_dtype != p.dtype;  // U in W, z in T (validated at the door)
  const void* u = p.u ? p.u : p.logits;
  const SweepKernel sweep = SweepFor<T, W>(mma, narrow_u);
  if (!sweep) return Status::kUnsupported;

  // Groups: as many requests per group as the shared memory takes (at most 64), the requests
  // then spread evenly over the fewest groups (equal groups finish their sweeps together).
  int G = std::min(R, kMaxGroup);
  SweepLayout lay = MakeSweepLayout(G, MaxTile(G), rank, mma, kElem, has_bias);
  while (G > 1 && lay.bytes > std::min(lim.smem_optin, 160 * 1024)) {
    G = (G + 1) / 2;
    lay = MakeSweepLayout(G, MaxTile(G), rank, mma, kElem, has_bias);
  }
  G = static_cast<int>(CeilDiv(R, CeilDiv(R, G)));
  const int groups = static_cast<int>(CeilDiv(R, G));
  lay = MakeSweepLayout(G, MaxTile(G), rank, mma, kElem, has_bias);
  if (lay.bytes > lim.smem_optin) return Status::kUnsupported;
  int max_blocks = 0;  // co-resident blocks at the largest tile (smaller tiles only fit more)
  Status st = SweepGrid(sweep, lay.bytes, lim, &max_blocks);
  if (st != Status::kOk) return st;
  // Every group gets an equal share of the co-resident blocks, and one sweep launch per step
  // serves all groups: their blocks run side by side over the same tiles (W2 from HBM once per
  // step, not once per group). Beyond max_blocks groups, blocks queue and the sharing is lost,
  // not the result.
  const int per_group = std::max(1, max_blocks / groups);
  // The smallest tile (multiple of 128) that covers V in one wave of a group's blocks: the sweep
  // is bound by HBM, so what matters is every block streaming at once, not SM balance.
  const int tv = static_cast<int>(std::min<int64_t>(
      MaxTile(G), std::max<int64_t>(kItem, kItem * CeilDiv(V, static_cast<int64_t>(kItem) * per_group))));
  const SweepLayout gl = MakeSweepLayout(G, tv, rank, mma, kElem, has_bias);
  // Every block gets the same number of tiles (k or k - 1): a tail where few blocks stream alone
  // would leave HBM idle.
  const int ntiles = static_cast<int>(CeilDiv(V, gl.tv));
  const int gblocks = static_cast<int>(CeilDiv(ntiles, CeilDiv(ntiles, per_group)));

  Scratch scratch(stream);
  Partial* partials = nullptr;
  W* e_eff = nullptr;
  float* hg = nullptr;
  float* hc = nullptr;
  if ((st = scratch.Get(static_cast<size_t>(groups) * gblocks * G, &partials)) != Status::kOk) return st;
  if ((st = scratch.Get(static_cast<size_t>(R) * std::max(rank, 1), &e_eff)) != Status::kOk) return st;
  if (gated && (st = scratch.Get(static_cast<size_t>(R) * gamma * rank, &hg)) != Status::kOk) return st;
  if (p.confidence && (st = scratch.Get(static_cast<size_t>(R) * gamma, &hc)) != Status::kOk) return st;

  if (gated || p.confidence) {
    HeadProjArgs pa{};
    pa.hidden = p.hidden;
    pa.gate_w = gated ? p.gate_w : nullptr;
    pa.conf_w = p.confidence ? p.conf_w : nullptr;
    pa.hg = hg;
    pa.hc = hc;
    pa.N = R * gamma;
    pa.d = d;
    pa.rank_rows = gated ? rank : 0;
    pa.ld_gate = d + rank;
    if (d > 0) {
      st = LaunchHeadProj<W, kThreads>(pa, lim.sm_count, stream);
    } else {
      if (gated) cudaMemsetAsync(hg, 0, sizeof(float) * R * gamma * rank, stream);
      if (p.confidence) cudaMemsetAsync(hc, 0, sizeof(float) * R * gamma, stream);
      st = LaunchStatus();
    }
    if (st != Status::kOk) return st;
  }

  SweepArgs sa{};
  sa.logits = p.logits;
  sa.u = u;
  sa.w2 = p.w2;
  sa.e_eff = e_eff;
  sa.temperature = p.temperature;
  sa.seed = p.seed;
  sa.stream = p.stream;
  sa.round = p.round;
  sa.coupled = p.coupled;
  sa.mask = p.token_bitmask;
  sa.words = static_cast<int>(CeilDiv(p.V, 32));
  sa.partials = partials;
  sa.R = R;
  sa.G = G;
  sa.gblocks = gblocks;
  sa.gamma = gamma;
  sa.V = V;
  sa.rank = rank;
  sa.tv = gl.tv;
  sa.es_stride = gl.es_stride;
  sa.off_bias = gl.off_bias;
  sa.wpr = gl.wpr;
  sa.off_slot_m = gl.off_slot_m;
  sa.off_slot_idx = gl.off_slot_idx;
  sa.off_es = gl.off_es;
  sa.has_bias = has_bias;
  sa.vec = V % 4 == 0 && Aligned(p.logits, 4 * sizeof(T)) && Aligned(u, 4 * (narrow_u ? kElem : sizeof(T)));
  sa.w2_vec = has_bias && rank % 4 == 0 && Aligned(p.w2, 4 * kElem);

  StepArgs ta{};
  ta.logits = p.logits;
  ta.hidden = p.hidden;
  ta.anchor = p.anchor;
  ta.w1 = p.w1;
  ta.gate_w = p.gate_w;
  ta.gate_b = p.gate_b;
  ta.conf_w = p.conf_w;
  ta.conf_b = p.conf_b;
  ta.temperature = p.temperature;
  ta.tokens = p.tokens;
  ta.logprob = static_cast<float*>(p.logprob);
  ta.lse = static_cast<float*>(p.lse);
  ta.conf_logit = static_cast<float*>(p.conf_logit);
  ta.partials = partials;
  ta.e_eff = e_eff;
  ta.hg = hg;
  ta.hc = hc;
  ta.G = G;
  ta.gamma = gamma;
  ta.V = V;
  ta.rank = rank;
  ta.d = d;
  ta.nblocks = gblocks;
  ta.head = p.head;
  ta.confidence = p.confidence;
  ta.confidence_markov = p.confidence_markov;

  // 2 gamma + 1 launches for the whole batch: the prologue, then per step the sweep (all
  // groups) and the step kernel (one block per request). On sm_90+ the per-step launches are
  // dependent launches: each kernel's blocks start while its predecessor drains (the sweep
  // prefetching W2 meanwhile), so a step pays no launch gap.
  const bool pdl = DependentLaunches(lim, sweep) && DependentLaunches(lim, MarkovStepKernel<T, W>);
  ta.k = -1;
  MarkovStepKernel<T, W><<<R, kThreads, 0, stream>>>(ta);  // after someone else's kernel: plain
  if ((st = LaunchStatus()) != Status::kOk) return st;
  for (int k = 0; k < gamma; ++k) {
    sa.k = k;
    if ((st = LaunchSweep(sweep, sa, gl.bytes, groups * gblocks, stream, pdl)) != Status::kOk) return st;
    ta.k = k;
    st = LaunchKernel(MarkovStepKernel<T, W>, dim3(R), dim3(kThreads), 0, stream, pdl, ta);
    if (st != Status::kOk) return st;
  }
  return Status::kOk;
}

// The head's launcher for one (logits, weights) dtype pair.
template <class T, class W>
Status LaunchHead(const MarkovSampleParams& p, cudaStream_t stream) {
  return p.head == MarkovHead::kSelector ? MarkovSelectLaunch<T, W>(p, stream)
                                         : MarkovLaunch<T, W>(p, stream);
}

}  // namespace
}  // namespace dspark::cuda

namespace dspark {

Status MarkovSampleCuda(const MarkovSampleParams& p, void* stream) {
  using namespace dspark::cuda;
  if (p.R < 0 || p.gamma < 0 || p.V < 0 || p.rank < 0 || p.d < 0) return Status::kBadArgument;
  if (p.R == 0 || p.gamma == 0) return Status::kOk;
  // Positions enter Philox as 16 bits; indices and offsets are 32-bit in the kernels.
  if (p.V < 1 || p.V > (1ll << 30) || p.gamma > 0xffff || p.R * p.gamma > (1ll << 30) || p.d > (1 << 30)) {
    return Status::kBadArgument;
  }
  if (p.head == MarkovHead::kRnn) return Status::kUnsupported;  // the ops door routes rnn to the reference
  if (p.head != MarkovHead::kNone && p.head != MarkovHead::kVanilla && p.head != MarkovHead::kGated &&
      p.head != MarkovHead::kSelector) {
    return Status::kBadArgument;
  }
  if (p.dtype != DType::kFloat64 && p.out_dtype != DType::kFloat32) return Status::kBadArgument;
  // U (out of place) in the logits dtype, or in the 16-bit weight dtype under float32 logits
  if (p.u && p.u_dtype != p.dtype &&
      !(p.dtype == DType::kFloat32 && p.u_dtype == p.weight_dtype && p.weight_dtype != p.dtype)) {
    return Status::kUnsupported;
  }
  if (!p.logits || !p.anchor || !p.temperature || !p.seed || !p.stream || !p.round || !p.tokens ||
      !p.logprob || !p.lse || !p.conf_logit) {
    return Status::kBadArgument;
  }
  const bool has_bias = p.head != MarkovHead::kNone;
  const bool need_e = has_bias || (p.confidence && p.confidence_markov);
  if (need_e && (!p.w1 || p.rank < 1)) return Status::kBadArgument;
  if (need_e && p.rank > kMaxRank) return Status::kUnsupported;
  if (has_bias && !p.w2) return Status::kBadArgument;
  if (p.head == MarkovHead::kGated && (!p.gate_w || !p.gate_b || !p.hidden)) return Status::kBadArgument;
  if (p.head == MarkovHead::kSelector) {
    // gate_w [rank, d] and hidden are read only when d > 0 (an empty tensor may have no pointer)
    if (p.top_k < 1 || p.top_k > p.V || (p.d > 0 && (!p.gate_w || !p.hidden))) return Status::kBadArgument;
    if (p.top_k > kSelectMaxTopK || p.rank > kSelectMaxRank) return Status::kUnsupported;
  }
  if (p.confidence && (!p.conf_w || !p.conf_b || !p.hidden)) return Status::kBadArgument;
  const cudaStream_t stream_ = AsStream(stream);
  DeviceGuard guard(stream_);
  if (p.weight_dtype == p.dtype) {
    DSPARK_DISPATCH_FLOAT(p.dtype, return LaunchHead<scalar_t, scalar_t>(p, stream_););
  }
  // A bf16/fp16 model's head under float32 logits: weights in 16 bits (tensor cores), z in float.
  if (p.dtype == DType::kFloat32 && p.weight_dtype == DType::kBFloat16) {
    return LaunchHead<float, __nv_bfloat16>(p, stream_);
  }
  if (p.dtype == DType::kFloat32 && p.weight_dtype == DType::kFloat16) {
    return LaunchHead<float, __half>(p, stream_);
  }
  return Status::kUnsupported;
}

}  // namespace dspark
