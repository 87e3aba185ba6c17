// verify_attention on the GPU: tree-free ragged attention over the paged KV cache (DESIGN §5).
// Semantics: reference.verify_attention.
//
// Tensor-core path (float16 / bfloat16, head_dim 64 or 128), three launches:
//   1. AttnPlanKernel (one block) reads cu_q / kv_lens on the device (the host never sees them:
//      no sync) and decides the split-KV factor of every request: no split when the
//      (request, KV head, 64-row tile) units already fill the GPU, otherwise each unit's KV range
//      is cut into near-equal pieces, as many as the fewest full waves of pieces take
//      (attn_split.h: the chunk by wave efficiency, one candidate per thread).
//   2. AttnKernel (persistent, 4 warps): work item = (request, KV head, 64-row query tile, KV
//      split). The rows of a tile are the (query, group member) pairs of ONE KV head packed
//      together (row = i * group + g), so every K/V page is read once per KV head, not once per
//      query head. S = Q K^T and O += P V run on mma.sync m16n8k16 with fp32 accumulation;
//      K/V tiles of 64 keys stream through a two-stage cp.async pipeline (page lookups per key
//      row, so any page size works); online softmax in the exp2 domain. Unsplit items write the
//      output; split items write (O / l, log2-sum-exp) partials.
//   3. AttnMergeKernel: log-sum-exp merge of the partials of split items.
// Step 1 runs once per forward when the caller planned (VerifyAttentionPlanCuda into buffers it
// owns, FlashInfer's plan/run): every layer of the forward then launches 2 and 3 only, with no
// allocation of its own. Unplanned calls plan into stream-ordered scratch.
// Other head dims and float32 take AttnSimtKernel, a plain CUDA-core kernel (a warp per query
// and head) meant for correctness, not speed.
// Sliding window (p.window > 0): both paths mask keys outside each row's window and start at the
// first KV tile (key, on the CUDA-core path) any row of the item sees, so tiles wholly before
// the window are never loaded; the plan and the splits cover only that visible key range.
//
// NOTE: keys at or beyond a request's kv_len are never read (zero-filled instead), so pages or
// slots the request does not own may hold anything, NaN included.
// NOTE: bad metadata cannot be checked on the host without a sync. A request whose used
// block-table entries are not all page ids in [0, num_pages) (or outside its table row) gets
// NaN in all its output rows, as reference.verify_attention defines: the runner's NaN check
// then fails that request alone. Every work item scans its request's used entries (4 bytes
// per page against the page's K/V, at least 2 KB: noise).
//
// NOTE: row and batch invariance (DESIGN §6). What a query row's output depends on besides its
// own q, its request's K/V up to its position and its window, checked path by path:
//   * Path choice (tensor cores or CUDA cores) follows the dtype, head_dim and the 16-byte
//     alignment of q, k_cache, v_cache and out: nothing about rows. (A row slice of a
//     contiguous q of head_dim 64 / 128 keeps the alignment; an `out` view that breaks it would
//     move the whole call to the CUDA-core path, whose bits differ.) No path is chosen by n_q.
//   * Split-KV (default mode): the split factor follows the whole batch (step 1), and an
//     item's split boundaries cut ITS tile range, which ends at the last row of its query tile:
//     a row's partial sums then depend on the batch and on the chain length (n_q). Neither row-
//     nor batch-invariant: the same row alone, or in a smaller batch, may be split differently.
//   * p.batch_invariant never splits. A row then runs, on either path, a sequence that is a
//     function of its own position alone:
//     - tensor cores: KV tiles of 64 keys anchored to key 0 (tile t = keys 64t .. 64t + 63;
//       with a window the first tile is floor(lo / 64) of the tile's first row, still a
//       multiple of 64), taken in order. Tiles of the item past the row's last key (later chain
//       rows' keys, up to the query tile's last row) are fully masked for the row: m stays, the
//       rescale is exp2(0) = 1, P = 0, so l and O are unchanged (0 * V = 0 for finite V);
//       tiles wholly before a windowed row's first key leave m = -inf, l = O = 0, as if absent.
//       Within a tile the row's scores, max, P (rounded to 16 bits for P V), row sum and
//       rescaling are per-row values: an mma output element reads its own A row only, the
//       quad shuffles reduce within the row, and m / l are float32 per row. Which other rows
//       (its chain's, or zero padding) share the 64-row query tile, and where the row sits in
//       it (warp, lane, packed GQA index), changes nothing. Rows of different requests never
//       share a tile.
//       The score is formed with __fmul_rn: whether a warp's tile takes the masking branch
//       depends on the other rows of the warp (hi_min_warp, key_hi), and a plain multiply
//       could be contracted into the exp2 argument's subtraction on one branch and not on the
//       other (the PTX today keeps them apart; the intrinsic makes it a guarantee).
//     - CUDA cores: a warp per (query, head) walks its own visible keys [KeyLo(pos), pos + 1)
//       in 32-key chunks anchored at its own first key; nothing is shared between rows.
//     So under p.batch_invariant a causal row's result is bit-identical to computing it alone
//     as a 1-row chain with kv_len = its position + 1, and independent of the batch. (A fixed
//     split size would also do, but its partial slots depend on the device's kv_lens, which
//     the host-sized plan buffers cannot bound.)
//   Limits: (1) a planned call (p.work) runs the plan's splits whatever p.batch_invariant says:
//   the plan must be made in the same mode (VerifyAttentionPlanCuda reads p.batch_invariant).
//   (2) K/V must be finite: a non-finite V of a later chain key meets P = 0 in a shared tile
//   and gives NaN (0 * inf), as the reference's softmax(s) @ v does. (3) Bidirectional rows
//   see the whole chain by definition; batch invariance still holds for them.
#include "verify_attention.h"

#include <algorithm>

#include "attn_split.h"
#include "cuda/common.cuh"
#include "cuda/mma.cuh"

namespace dspark::cuda {
namespace {

constexpr int kBlockM = 64;  // packed query rows per tile (16 per warp)
constexpr int kBlockN = 64;  // keys per KV tile
constexpr int kThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kPlanCache = 2048;  // requests the planner's search reads from shared memory

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
  int* merge_off;   // [R + 1] first merge unit of each request
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
// or its kv_len overruns the table row (combine with __syncthreads_or).
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

// ---- 1: plan ----------------------------------------------------------------------------------
__global__ void __launch_bounds__(1024) AttnPlanKernel(AttnArgs a, int target_ctas) {
  __shared__ int warp_sums[33];
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
  int carry_items = 0, carry_slots = 0, carry_merges = 0;
  for (int base = 0; base < a.R; base += 1024) {
    const int r = base + tid;
    int items = 0, slots = 0, merges = 0, S = 1;
    if (r < a.R) {
      const ReqInfo ri = LoadReq(a, r);
      const int tiles = PlanTiles(a, ri);
      if (chunk != kNoSplit) S = max(1, (tiles + chunk - 1) / chunk);
      items = a.h_kv * ri.mtiles * S;
      slots = S > 1 ? items : 0;
      merges = S > 1 ? a.h_kv * ri.mtiles : 0;
      a.split[r] = S;
    }
    int e_items, e_slots, e_merges;
    const int t_items = BlockExclusiveScan(items, &e_items, warp_sums);
    const int t_slots = BlockExclusiveScan(slots, &e_slots, warp_sums);
    const int t_merges = BlockExclusiveScan(merges, &e_merges, warp_sums);
    if (r < a.R) {
      a.item_off[r] = carry_items + e_items;
      a.slot_off[r] = carry_slots + e_slots;
      a.merge_off[r] = carry_merges + e_merges;
    }
    carry_items += t_items;
    carry_slots += t_slots;
    carry_merges += t_merges;
  }
  if (tid == 0) {
    a.item_off[a.R] = carry_items;
    a.slot_off[a.R] = carry_slots;
    a.merge_off[a.R] = carry_merges;
  }
}

// ---- 2: attention tiles -----------------------------------------------------------------------
// Shared-memory tiles are [64 rows][HD] 16-bit, 16-byte chunks XOR-swizzled by row so that
// ldmatrix (8 rows x 16 bytes) and cp.async rows hit all 32 banks.
template <int HD>
__device__ __forceinline__ int Swz(int row, int chunk) {
  return row * HD + ((chunk ^ (row & 7)) << 3);
}

template <class T, int HD>
__device__ __forceinline__ void LoadKvTile(const AttnArgs& a, T* sk, T* sv, int r, int h, int key0, int key_hi) {
  constexpr int kChunks = HD / 8;
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  const int32_t* bt = a.block_tables + static_cast<int64_t>(r) * a.max_pages;
#pragma unroll
  for (int it = 0; it < kBlockN * kChunks / kThreads; ++it) {
    const int idx = it * kThreads + threadIdx.x;
    const int row = idx / kChunks, ch = idx % kChunks;
    const int key = key0 + row;
    bool valid = key < key_hi && key / a.page_size < a.max_pages;
    int64_t off = 0;
    if (valid) {
      // NOTE: a page index outside the cache (bad metadata) reads zeros instead of faulting.
      const int page = __ldg(bt + key / a.page_size);
      valid = page >= 0 && page < a.num_pages;
      off = valid ? ((static_cast<int64_t>(page) * a.page_size + key % a.page_size) * a.h_kv + h) * HD + ch * 8 : 0;
    }
    const int so = Swz<HD>(row, ch);
    CpAsync16(SmemAddr(sk + so), kc + off, valid ? 16 : 0);
    CpAsync16(SmemAddr(sv + so), vc + off, valid ? 16 : 0);
  }
}

template <class T, int HD>
__global__ void __launch_bounds__(kThreads, 2) AttnKernel(AttnArgs a) {
  constexpr int kChunks = HD / 8;
  constexpr int kDTiles = HD / 8;  // n-tiles of the output
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // [Q | K stage 0 | K stage 1 | V stage 0 | V stage 1], each [64][HD]. NOTE: stage pointers are
  // computed, not kept in an array, which a run-time index would move to local memory.
  T* sq = reinterpret_cast<T*>(smem_raw);
  auto sk = [&](int stage) { return sq + (kBlockM + stage * kBlockN) * HD; };
  auto sv = [&](int stage) { return sq + (kBlockM + (2 + stage) * kBlockN) * HD; };
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int total = a.item_off[a.R];

  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    // ---- decode the work item ----
    const int r = FindOwner(a.item_off, a.R, item);
    const ReqInfo ri = LoadReq(a, r);
    const int S = a.split[r];
    const int local = item - a.item_off[r];
    const int mt = local % ri.mtiles, rest = local / ri.mtiles;
    const int s = rest % S, h = rest / S;
    const int row0 = mt * kBlockM;
    const int rows_here = min(kBlockM, ri.rows - row0);
    const int i_min = row0 / a.group, i_max = (row0 + rows_here - 1) / a.group;
    // The item's visible keys [kv_begin, kv_end); its tiles t_first .. t_end - 1 (those wholly
    // before kv_begin are skipped, not loaded) are cut into S near-equal splits.
    const int kv_begin = KeyLo(a, ri.L - ri.n + i_min);
    const int kv_end = KeyHi(a, ri.L, ri.L - ri.n + i_max);
    const int t_first = kv_begin / kBlockN;
    const int tiles = max(0, (kv_end + kBlockN - 1) / kBlockN - t_first);
    const int tb = t_first + static_cast<int>(static_cast<int64_t>(s) * tiles / S);
    const int te = t_first + static_cast<int>(static_cast<int64_t>(s + 1) * tiles / S);
    const int key_hi = min(te * kBlockN, kv_end);

    // Also the barrier after which the previous item is done with every tile.
    const bool bad = __syncthreads_or(ThreadSeesBadPage(a, r, ri.L));
    // ---- Q tile: packed row p = (query i, group member gg) ----
    {
      const T* qg = static_cast<const T*>(a.q);
#pragma unroll
      for (int it = 0; it < kBlockM * kChunks / kThreads; ++it) {
        const int idx = it * kThreads + threadIdx.x;
        const int p = idx / kChunks, ch = idx % kChunks;
        const bool valid = p < rows_here;
        int64_t off = 0;
        if (valid) {
          const int i = (row0 + p) / a.group, gg = (row0 + p) % a.group;
          off = (static_cast<int64_t>(ri.q0 + i) * a.h_q + h * a.group + gg) * HD + ch * 8;
        }
        CpAsync16(SmemAddr(sq + Swz<HD>(p, ch)), qg + off, valid ? 16 : 0);
      }
    }
    if (tb < te) LoadKvTile<T, HD>(a, sk(0), sv(0), r, h, tb * kBlockN, key_hi);
    CpAsyncCommit();

    // Rows of this thread: p0 = warp * 16 + g and p0 + 8; their visible keys [lo, hi) (causal
    // mask, window). The warp's tightest edges tell whether a tile needs the mask at all.
    const int p0 = warp * 16 + g;
    const bool warp_active = warp * 16 < rows_here;
    const int qpos0 = ri.L - ri.n + (row0 + p0) / a.group;
    const int qpos1 = ri.L - ri.n + (row0 + p0 + 8) / a.group;
    const int lo0 = KeyLo(a, qpos0), hi0 = KeyHi(a, ri.L, qpos0);
    const int lo1 = KeyLo(a, qpos1), hi1 = KeyHi(a, ri.L, qpos1);
    const int hi_min_warp = KeyHi(a, ri.L, ri.L - ri.n + (row0 + warp * 16) / a.group);
    const int lo_max_warp = KeyLo(a, ri.L - ri.n + (row0 + min(warp * 16 + 15, rows_here - 1)) / a.group);
    float m0 = -kInfF, m1 = -kInfF, l0 = 0.f, l1 = 0.f;
    float o[kDTiles][4];
#pragma unroll
    for (int dn = 0; dn < kDTiles; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;

    for (int tile = tb; tile < te; ++tile) {
      const int stage = (tile - tb) & 1;
      if (tile + 1 < te) {
        LoadKvTile<T, HD>(a, sk(stage ^ 1), sv(stage ^ 1), r, h, (tile + 1) * kBlockN, key_hi);
        CpAsyncCommit();
        CpAsyncWait<1>();
      } else {
        CpAsyncWait<0>();
      }
      __syncthreads();
      if (warp_active) {
        const int kb = tile * kBlockN;
        // ---- S = Q K^T (16 rows x 64 keys per warp) ----
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
        const int mi = lane >> 3, r8 = lane & 7;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          uint32_t qa[4];
          LdMatrixX4(qa, SmemAddr(sq + Swz<HD>(warp * 16 + (mi & 1) * 8 + r8, kk * 2 + (mi >> 1))));
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            uint32_t kb4[4];
            LdMatrixX4(kb4, SmemAddr(sk(stage) + Swz<HD>(np * 16 + (mi >> 1) * 8 + r8, kk * 2 + (mi & 1))));
            Mma16816<T>(acc[2 * np], qa[0], qa[1], qa[2], qa[3], kb4[0], kb4[1]);
            Mma16816<T>(acc[2 * np + 1], qa[0], qa[1], qa[2], qa[3], kb4[2], kb4[3]);
          }
        }
        // ---- scale, mask, online softmax (exp2 domain) ----
        const bool need_mask = kb + kBlockN > min(key_hi, hi_min_warp) || kb < lo_max_warp;
        float mx0 = -kInfF, mx1 = -kInfF;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float v = __fmul_rn(acc[nt][e], a.scale_log2);  // never contracted: see the NOTE
            if (need_mask) {
              const int key = kb + nt * 8 + 2 * t + (e & 1);
              const int lo = e < 2 ? lo0 : lo1, hi = e < 2 ? hi0 : hi1;
              if (key >= key_hi || key >= hi || key < lo) v = -kInfF;
            }
            acc[nt][e] = v;
          }
          mx0 = fmaxf(mx0, fmaxf(acc[nt][0], acc[nt][1]));
          mx1 = fmaxf(mx1, fmaxf(acc[nt][2], acc[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        // A row with every key masked so far keeps m = -inf; exponents use 0 instead so that
        // exp2(-inf - 0) = 0 rather than NaN.
        const float mu0 = mn0 == -kInfF ? 0.f : mn0, mu1 = mn1 == -kInfF ? 0.f : mn1;
        const float al0 = exp2f(m0 - mu0), al1 = exp2f(m1 - mu1);
        m0 = mn0;
        m1 = mn1;
        float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          acc[nt][0] = exp2f(acc[nt][0] - mu0);
          acc[nt][1] = exp2f(acc[nt][1] - mu0);
          acc[nt][2] = exp2f(acc[nt][2] - mu1);
          acc[nt][3] = exp2f(acc[nt][3] - mu1);
          rs0 += acc[nt][0] + acc[nt][1];
          rs1 += acc[nt][2] + acc[nt][3];
        }
        l0 = l0 * al0 + rs0;
        l1 = l1 * al1 + rs1;
#pragma unroll
        for (int dn = 0; dn < kDTiles; ++dn) {
          o[dn][0] *= al0;
          o[dn][1] *= al0;
          o[dn][2] *= al1;
          o[dn][3] *= al1;
        }
        // ---- O += P V: P straight from the S accumulators (C layout = A layout) ----
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          const uint32_t pa0 = PackPair<T>(acc[2 * kk][0], acc[2 * kk][1]);
          const uint32_t pa1 = PackPair<T>(acc[2 * kk][2], acc[2 * kk][3]);
          const uint32_t pa2 = PackPair<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
          const uint32_t pa3 = PackPair<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
#pragma unroll
          for (int dp = 0; dp < HD / 16; ++dp) {
            uint32_t vb[4];
            LdMatrixX4Trans(vb, SmemAddr(sv(stage) + Swz<HD>(kk * 16 + (mi & 1) * 8 + r8, dp * 2 + (mi >> 1))));
            Mma16816<T>(o[2 * dp], pa0, pa1, pa2, pa3, vb[0], vb[1]);
            Mma16816<T>(o[2 * dp + 1], pa0, pa1, pa2, pa3, vb[2], vb[3]);
          }
        }
      }
      __syncthreads();  // this stage is refilled two iterations from now
    }
    CpAsyncWait<0>();  // an empty split loaded Q only: let it land before sq is reused

    // ---- epilogue ----
    if (!warp_active) continue;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    if (bad) inv0 = inv1 = kNaNF;  // NaN rows (a split: NaN partials of log-sum-exp +inf)
    const bool ok0 = p0 < rows_here, ok1 = p0 + 8 < rows_here;
    if (S == 1) {
      T* og = static_cast<T*>(a.out);
      int64_t base0 = 0, base1 = 0;
      if (ok0) {
        const int i = (row0 + p0) / a.group, gg = (row0 + p0) % a.group;
        base0 = (static_cast<int64_t>(ri.q0 + i) * a.h_q + h * a.group + gg) * HD;
      }
      if (ok1) {
        const int i = (row0 + p0 + 8) / a.group, gg = (row0 + p0 + 8) % a.group;
        base1 = (static_cast<int64_t>(ri.q0 + i) * a.h_q + h * a.group + gg) * HD;
      }
#pragma unroll
      for (int dn = 0; dn < kDTiles; ++dn) {
        const int d = dn * 8 + 2 * t;
        if (ok0) *reinterpret_cast<uint32_t*>(og + base0 + d) = PackPair<T>(o[dn][0] * inv0, o[dn][1] * inv0);
        if (ok1) *reinterpret_cast<uint32_t*>(og + base1 + d) = PackPair<T>(o[dn][2] * inv1, o[dn][3] * inv1);
      }
    } else {
      const int64_t slot = a.slot_off[r] + local;
      float* po = a.part_o + slot * kBlockM * HD;
#pragma unroll
      for (int dn = 0; dn < kDTiles; ++dn) {
        const int d = dn * 8 + 2 * t;
        if (ok0) *reinterpret_cast<float2*>(po + p0 * HD + d) = make_float2(o[dn][0] * inv0, o[dn][1] * inv0);
        if (ok1) *reinterpret_cast<float2*>(po + (p0 + 8) * HD + d) = make_float2(o[dn][2] * inv1, o[dn][3] * inv1);
      }
      if (t == 0) {
        float* pl = a.part_lse + slot * kBlockM;
        if (ok0) pl[p0] = bad ? kInfF : (l0 > 0.f ? m0 + log2f(l0) : -kInfF);
        if (ok1) pl[p0 + 8] = bad ? kInfF : (l1 > 0.f ? m1 + log2f(l1) : -kInfF);
      }
    }
  }
}

// ---- 3: merge of split partials -------------------------------------------------------------
template <class T>
__global__ void __launch_bounds__(kThreads) AttnMergeKernel(AttnArgs a) {
  const int total = a.merge_off[a.R];
  const int HD = a.head_dim, d4n = HD / 4;
  for (int u = blockIdx.x; u < total; u += gridDim.x) {
    const int r = FindOwner(a.merge_off, a.R, u);
    const ReqInfo ri = LoadReq(a, r);
    const int S = a.split[r];
    const int local = u - a.merge_off[r];
    const int mt = local % ri.mtiles, h = local / ri.mtiles;
    const int row0 = mt * kBlockM, rows_here = min(kBlockM, ri.rows - row0);
    for (int idx = threadIdx.x; idx < rows_here * d4n; idx += kThreads) {
      const int p = idx / d4n, d = (idx - p * d4n) * 4;
      float lmax = -kInfF;
      for (int s = 0; s < S; ++s) {
        const int64_t slot = a.slot_off[r] + static_cast<int64_t>(h * S + s) * ri.mtiles + mt;
        lmax = fmaxf(lmax, a.part_lse[slot * kBlockM + p]);
      }
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      float wsum = 0.f;
      if (lmax != -kInfF) {
        for (int s = 0; s < S; ++s) {
          const int64_t slot = a.slot_off[r] + static_cast<int64_t>(h * S + s) * ri.mtiles + mt;
          const float w = exp2f(a.part_lse[slot * kBlockM + p] - lmax);
          if (w == 0.f) continue;  // an empty split's O is 0 but skip it anyway
          const float4 ov = *reinterpret_cast<const float4*>(a.part_o + (slot * kBlockM + p) * HD + d);
          acc.x += w * ov.x;
          acc.y += w * ov.y;
          acc.z += w * ov.z;
          acc.w += w * ov.w;
          wsum += w;
        }
      }
      const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
      const int i = (row0 + p) / a.group, gg = (row0 + p) % a.group;
      T* dst = static_cast<T*>(a.out) + (static_cast<int64_t>(ri.q0 + i) * a.h_q + h * a.group + gg) * HD + d;
      Store4(dst, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
    }
  }
}

// ---- fallback: CUDA cores, any dtype, head_dim <= 256 -----------------------------------------
// Block = (request, query head); warp = one query at a time; lanes take 32 keys at a time for
// q.k, then the whole warp accumulates P V with lane-owned dims.
constexpr int kSimtMaxHd = 256;

template <class T>
__global__ void __launch_bounds__(kThreads) AttnSimtKernel(AttnArgs a) {
  __shared__ float qs[kThreads / 32][kSimtMaxHd];
  const int r = blockIdx.x, hq = blockIdx.y, h = hq / a.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, HD = a.head_dim;
  const ReqInfo ri = LoadReq(a, r);
  const T* qg = static_cast<const T*>(a.q);
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  const int32_t* bt = a.block_tables + static_cast<int64_t>(r) * a.max_pages;
  const float scale = a.scale_log2 / kLog2e;
  const bool bad = __syncthreads_or(ThreadSeesBadPage(a, r, ri.L));
  for (int i = warp; i < ri.n; i += kThreads / 32) {
    const T* qrow = qg + (static_cast<int64_t>(ri.q0 + i) * a.h_q + hq) * HD;
    for (int d = lane; d < HD; d += 32) qs[warp][d] = ToFloat(qrow[d]) * scale;
    __syncwarp();
    const int pos = ri.L - ri.n + i;
    const int kv_begin = KeyLo(a, pos), kv_end = KeyHi(a, ri.L, pos);  // keys before are never read
    float m = -kInfF, l = 0.f, o[kSimtMaxHd / 32] = {};
    for (int kb = kv_begin; kb < kv_end; kb += 32) {
      const int key = kb + lane;
      const bool valid = key < kv_end;
      int64_t off = 0;
      float s = -kInfF;
      const int page = valid && key / a.page_size < a.max_pages ? bt[key / a.page_size] : -1;
      if (page >= 0 && page < a.num_pages) {
        off = ((static_cast<int64_t>(page) * a.page_size + key % a.page_size) * a.h_kv + h) * HD;
        float acc = 0.f;
        for (int d = 0; d < HD; ++d) acc = fmaf(qs[warp][d], ToFloat(kc[off + d]), acc);
        s = acc;
      } else if (valid) {
        s = 0.f;  // bad metadata: a zero key and value, as on the tensor-core path
        off = -1;
      }
      const float mn = fmaxf(m, WarpMax(s));  // finite: key kb is always valid
      const float alpha = expf(m - mn);  // accurate expf: this path is the float32 reference twin
      const float p = valid ? expf(s - mn) : 0.f;
      l = l * alpha + WarpSum(p);
#pragma unroll
      for (int j = 0; j < kSimtMaxHd / 32; ++j) o[j] *= alpha;
      const int nk = min(32, kv_end - kb);
      for (int jj = 0; jj < nk; ++jj) {
        const float pj = __shfl_sync(0xffffffffu, p, jj);
        const int64_t oj = __shfl_sync(0xffffffffu, off, jj);
        if (oj < 0) continue;
#pragma unroll
        for (int j = 0; j < kSimtMaxHd / 32; ++j) {
          const int d = lane + 32 * j;
          if (d < HD) o[j] = fmaf(pj, ToFloat(vc[oj + d]), o[j]);
        }
      }
      m = mn;
    }
    T* orow = static_cast<T*>(a.out) + (static_cast<int64_t>(ri.q0 + i) * a.h_q + hq) * HD;
    const float inv = bad ? kNaNF : (l > 0.f ? 1.f / l : 0.f);
#pragma unroll
    for (int j = 0; j < kSimtMaxHd / 32; ++j) {
      const int d = lane + 32 * j;
      if (d < HD) orow[d] = FromFloat<T>(o[j] * inv);
    }
    __syncwarp();  // qs is rewritten for the next query
  }
}

// ---- host ------------------------------------------------------------------------------------
// The persistent tensor-core grid: as many blocks as are co-resident on the device.
template <class T, int HD>
Status TensorCoreGrid(const DeviceLimits& lim, int* target, int* smem) {
  auto kernel = AttnKernel<T, HD>;
  *smem = (kBlockM + 4 * kBlockN) * HD * static_cast<int>(sizeof(T));
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, *smem) != cudaSuccess) {
    return Status::kCudaError;
  }
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, *smem) != cudaSuccess) {
    return Status::kCudaError;
  }
  *target = std::max(1, per_sm) * lim.sm_count;
  return Status::kOk;
}

// Same for p's type and head_dim; *target = 0 where p takes the CUDA-core path (which needs no
// plan). A tensor-core call whose pointers turn out misaligned also falls back to it at run
// time and ignores its plan.
template <class T>
Status TensorCoreGridFor(const VerifyAttentionParams& p, const DeviceLimits& lim, int* target, int* smem) {
  *target = 0;
  if constexpr (sizeof(T) == 2) {
    if (p.head_dim == 128) return TensorCoreGrid<T, 128>(lim, target, smem);
    if (p.head_dim == 64) return TensorCoreGrid<T, 64>(lim, target, smem);
  }
  return Status::kOk;
}

// Split slots never exceed 2 * target: the planner's candidates past that are refused
// (attn_split.h SplitScore); slots <= split items.
int64_t SlotsFor(int target) { return 2 * static_cast<int64_t>(target); }

void SetPlan(AttnArgs& a, int32_t* work, float* part_o, float* part_lse) {
  const int n1 = a.R + 1;
  a.item_off = work;
  a.split = work + n1;
  a.slot_off = work + 2 * n1;
  a.merge_off = work + 3 * n1;
  a.part_o = part_o;
  a.part_lse = part_lse;
}

AttnArgs MakeArgs(const VerifyAttentionParams& p) {
  AttnArgs a{};
  a.q = p.q;
  a.cu_q = p.cu_q;
  a.k_cache = p.k_cache;
  a.v_cache = p.v_cache;
  a.block_tables = p.block_tables;
  a.kv_lens = p.kv_lens;
  a.out = p.out;
  a.R = static_cast<int>(p.R);
  a.h_q = static_cast<int>(p.h_q);
  a.h_kv = static_cast<int>(p.h_kv);
  a.group = static_cast<int>(p.h_q / p.h_kv);
  a.head_dim = static_cast<int>(p.head_dim);
  a.page_size = static_cast<int>(p.page_size);
  a.max_pages = static_cast<int>(p.max_pages);
  a.num_pages = static_cast<int>(std::min<int64_t>(p.num_pages, 0x7fffffff));
  a.window = static_cast<int>(std::min<int64_t>(p.window, 0x7fffffff));
  a.causal = p.causal;
  a.batch_invariant = p.batch_invariant;
  a.scale_log2 = p.scale * kLog2e;
  return a;
}

template <class T, int HD>
Status LaunchTensorCore(AttnArgs a, const VerifyAttentionParams& p, const DeviceLimits& lim, cudaStream_t stream) {
  int target = 0, smem = 0;
  Status st = TensorCoreGrid<T, HD>(lim, &target, &smem);
  if (st != Status::kOk) return st;
  Scratch scratch(stream);
  if (p.work) {  // planned once for the whole forward
    if (p.plan_slots < SlotsFor(target) || !p.part_o || !p.part_lse) return Status::kBadArgument;
    SetPlan(a, p.work, p.part_o, p.part_lse);
  } else {
    int32_t* work = nullptr;
    float *part_o = nullptr, *part_lse = nullptr;
    const size_t slots = static_cast<size_t>(SlotsFor(target));
    if ((st = scratch.Get(4 * (static_cast<size_t>(a.R) + 1), &work)) != Status::kOk) return st;
    if ((st = scratch.Get(slots * kBlockM * HD, &part_o)) != Status::kOk) return st;
    if ((st = scratch.Get(slots * kBlockM, &part_lse)) != Status::kOk) return st;
    SetPlan(a, work, part_o, part_lse);
    AttnPlanKernel<<<1, 1024, 0, stream>>>(a, target);
    if ((st = LaunchStatus()) != Status::kOk) return st;
  }
  AttnKernel<T, HD><<<target, kThreads, smem, stream>>>(a);
  if ((st = LaunchStatus()) != Status::kOk) return st;
  AttnMergeKernel<T><<<target, kThreads, 0, stream>>>(a);
  return LaunchStatus();
}

template <class T>
Status Launch(const VerifyAttentionParams& p, cudaStream_t stream) {
  DeviceLimits lim;
  if (Status s = CurrentDeviceLimits(&lim); s != Status::kOk) return s;
  const AttnArgs a = MakeArgs(p);
  if constexpr (sizeof(T) == 2) {
    const bool aligned = Aligned(p.q, 16) && Aligned(p.k_cache, 16) && Aligned(p.v_cache, 16) && Aligned(p.out, 16);
    if (aligned && p.head_dim == 128) return LaunchTensorCore<T, 128>(a, p, lim, stream);
    if (aligned && p.head_dim == 64) return LaunchTensorCore<T, 64>(a, p, lim, stream);
  }
  if (p.head_dim > kSimtMaxHd) return Status::kUnsupported;
  if (p.R > 0x7fffffff || p.h_q > 65535) return Status::kUnsupported;
  AttnSimtKernel<T><<<dim3(static_cast<unsigned>(p.R), static_cast<unsigned>(p.h_q)), kThreads, 0, stream>>>(a);
  return LaunchStatus();
}

template <class T>
Status PlanSlots(const VerifyAttentionParams& p, int64_t* slots) {
  DeviceLimits lim;
  if (Status s = CurrentDeviceLimits(&lim); s != Status::kOk) return s;
  int target = 0, smem = 0;
  const Status st = TensorCoreGridFor<T>(p, lim, &target, &smem);
  *slots = target > 0 ? SlotsFor(target) : 0;
  return st;
}

template <class T>
Status Plan(const VerifyAttentionParams& p, cudaStream_t stream) {
  DeviceLimits lim;
  if (Status s = CurrentDeviceLimits(&lim); s != Status::kOk) return s;
  int target = 0, smem = 0;
  Status st = TensorCoreGridFor<T>(p, lim, &target, &smem);
  if (st != Status::kOk || target == 0) return st;
  if (!p.work || !p.part_o || !p.part_lse || p.plan_slots < SlotsFor(target)) return Status::kBadArgument;
  AttnArgs a = MakeArgs(p);
  SetPlan(a, p.work, p.part_o, p.part_lse);
  AttnPlanKernel<<<1, 1024, 0, stream>>>(a, target);
  return LaunchStatus();
}

// Sizes every launcher accepts (they keep 32-bit indices in the kernels).
Status CheckSizes(const VerifyAttentionParams& p) {
  if (p.R < 0 || p.h_q < 1 || p.h_kv < 1 || p.h_q % p.h_kv != 0 || p.head_dim < 1 || p.page_size < 1 ||
      p.num_pages < 0 || p.max_pages < 0 || p.window < 0) {
    return Status::kBadArgument;
  }
  if (p.R >= (1ll << 24) || p.h_q * p.head_dim > (1ll << 24) || p.page_size > (1ll << 24) ||
      p.max_pages * p.page_size > (1ll << 30)) {
    return Status::kUnsupported;
  }
  return Status::kOk;
}

}  // namespace
}  // namespace dspark::cuda

namespace dspark {

Status VerifyAttentionCuda(const VerifyAttentionParams& p, void* stream) {
  using namespace dspark::cuda;
  if (Status s = CheckSizes(p); s != Status::kOk || p.R == 0) return s;
  if (!p.cu_q || !p.kv_lens) return Status::kBadArgument;
  // NOTE: q and out have no storage when N = 0 (torch hands out a null data_ptr for an empty CUDA
  // tensor, e.g. a batch of empty chains); then every chain is empty and there is nothing to do.
  // The host cannot read cu_q to tell (no sync), so a null q / out means N = 0, as on the CPU.
  if (!p.q || !p.out) return Status::kOk;
  if (!p.k_cache || !p.v_cache || (p.max_pages > 0 && !p.block_tables)) return Status::kBadArgument;
  const cudaStream_t s = AsStream(stream);
  DeviceGuard guard(s);
  DSPARK_DISPATCH_FLOAT(p.dtype, return Launch<scalar_t>(p, s););
  return Status::kUnsupported;
}

Status VerifyAttentionPlanSlots(const VerifyAttentionParams& p, void* stream, int64_t* slots) {
  using namespace dspark::cuda;
  *slots = 0;
  if (Status s = CheckSizes(p); s != Status::kOk) return s;
  DeviceGuard guard(AsStream(stream));
  DSPARK_DISPATCH_FLOAT(p.dtype, return PlanSlots<scalar_t>(p, slots););
  return Status::kUnsupported;
}

Status VerifyAttentionPlanCuda(const VerifyAttentionParams& p, void* stream) {
  using namespace dspark::cuda;
  if (Status s = CheckSizes(p); s != Status::kOk || p.R == 0) return s;
  if (!p.cu_q || !p.kv_lens) return Status::kBadArgument;
  const cudaStream_t s = AsStream(stream);
  DeviceGuard guard(s);
  DSPARK_DISPATCH_FLOAT(p.dtype, return Plan<scalar_t>(p, s););
  return Status::kUnsupported;
}

}  // namespace dspark
