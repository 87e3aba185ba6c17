// verify_attention on the GPU: tree-free ragged attention over the paged KV cache (DESIGN §5).
// Semantics: reference.verify_attention.
//
// Tensor-core path (float16 / bfloat16, head_dim 64 or 128), two launches:
//   1. AttnPlanKernel (one block, attn_plan.cuh) reads cu_q / kv_lens / block tables on the
//      device (the host never sees them: no sync), decides the split-KV factor of every request
//      (attn_split.h: a cost model that prices the HBM stream, a block's own stream rate, the
//      per-item overhead and the merge; one candidate chunk per thread), flags requests with bad
//      block-table entries (once per forward, spread over the block) and zeroes the merge
//      tickets.
//   2. AttnKernel (persistent, 4 warps): work item = (request, KV head, 64-row query tile, KV
//      split). The rows of a tile are the (query, group member) pairs of ONE KV head packed
//      together (row = i * group + g), so every K/V page is read once per KV head, not once per
//      query head. S = Q K^T and O += P V run on mma.sync m16n8k16 with fp32 accumulation;
//      K/V tiles of 64 keys stream through a two-stage cp.async pipeline (page lookups per key
//      row, so any page size works); online softmax in the exp2 domain. A tile of 16 rows or
//      fewer (32 or fewer) keeps all 4 warps busy by giving each warp a quarter (half) of every
//      KV tile's keys; their softmax states meet in shared memory at the end (CombineKeyParts).
//      Unsplit items write the output; split items write (O / l, log2-sum-exp) partials, and
//      the last split of a unit to finish (atomic ticket) merges them (attn_merge.cuh): no
//      merge launch, split or not.
// Step 1 runs once per forward when the caller planned (VerifyAttentionPlanCuda into buffers it
// owns, FlashInfer's plan/run): every layer of the forward then launches 2 only, with no
// allocation of its own. Unplanned calls plan into stream-ordered scratch.
// Other head dims and float32 take AttnSimtKernel, a plain CUDA-core kernel (a warp per query
// and head) meant for correctness, not speed.
// Sliding window (p.window > 0): both paths mask keys outside each row's window and start at the
// first KV tile (key, on the CUDA-core path) any row of the item sees, so tiles wholly before
// the window are never loaded; the plan and the splits cover only that visible key range.
//
// Paper estimate (a model, not a measurement; replace it with the first measured run). Shape:
// Qwen3-8B layer (32 query / 8 KV heads, head_dim 128, bf16), 8 queries a request (32 packed
// rows a unit), 4k context (4104 keys: 65 tiles). Assumptions (H200): HBM 4.3 TB/s sustained;
// 132 SMs x 2 blocks = 264; ~1.8 GHz; an L2 round trip ~0.3 us, an HBM one ~0.8 us under load;
// one SM reads L2 at <= 64 B/clock (~115 GB/s); mma.sync m16n8k16 bf16 issues once per 8 clocks
// per SM sub-partition (SMSP); warps 0 and 1 of both blocks of an SM share 2 of its 4 SMSPs; a
// dependent launch in a CUDA graph starts ~1.5 us after its predecessor ends.
//   Floor: K + V 16.8 MB, Q + out 0.13 MB: 3.9 us at R = 1, 126 us at R = 32.
//   R = 1 before (fill-once split, separate merge kernel): 33 splits of 2 tiles on 264 blocks.
//     Attention ~6.9 us: decode 0.3 + each item's bad-page scan 0.3 (+ 5-8 us per item at 32k)
//     + block table -> first tile 1.1 + stream 3.9 (HBM-bound) + the last tile's mma on 2 SMSPs
//     shared by both blocks of the SM (2 x 128 mma x 8 clk per warp: 1.1) + partials 0.2; then
//     a merge launch 1.5 and the merge: 8 blocks, each thread 8 outputs x 33 splits of
//     dependent L2 loads behind exp2-dependent branches (issue 29's SASS review): 264 round
//     trips, ~50-80 us. Total ~60-90 us a layer (4-7% of floor).
//   R = 1 after: the planner takes 9 splits (72 items of 8 tiles; 72 x 2 stages x 32 KB = 4.7 MB
//     in flight still saturates HBM). Decode 0.3 (one round of independent loads; the bad flag
//     is one of them) + first tile 1.1 + stream 3.9 + the last tile on 4 SMSPs (64 mma a warp:
//     0.3; the other 7 tiles hide under the stream: 2.3 us of mma a block against 3.9) + key
//     halves combined in shared memory 0.05 + partial store, fence, ticket 0.6 + the merge in
//     the 8 last blocks: lse 0.3 (one round trip), weights 0.05, 9 partials x 16 KB at 115 GB/s
//     1.25 (16 loads of 16 B in flight a thread: 32 KB a block, the SM's latency x bandwidth),
//     output 0.1. Total ~7.9 us a layer (49% of floor): at the goal of <= 8 us, with the merge's
//     per-SM L2 rate the softest assumption (at 64 B/clk; 1.25 us of the 7.9). bench/paper_model.py
//     prices it at 9.5 us: it adds the 1 us ramp both designs pay and the merge's last batch of
//     4 splits, which loads split 8 four times (12 partials read, not 9: +0.4 us).
//   R = 32 before: no split (256 units < 264 blocks), 65 tiles a block; mma on 2 SMSPs per SM:
//     2 blocks x 65 tiles x 2 warps x 128 mma x 8 clk / 2 SMSPs = 74 us against 126 us of HBM,
//     hidden by the pipeline only while a tile's mma (both blocks: 1.1 us) stays under its load
//     (2 us): ~93-96% of floor. After: no split (the model: 513 against 523 for 2 splits); 4
//     SMSPs: 37 us of mma under 126 us of HBM; overheads ~2 us (first tile, last tile,
//     epilogue): ~98% of floor. R = 256: 2048 units, no split, 8 waves; the first-tile latency
//     of each item is covered by the SM's other block: ~97%. Goal (>= 88%) met at R >= 32.
//   R = 1, 32k: before ~35 us of attention (plus a 5-8 us bad-page scan per item) + the merge
//     ~50-80 us; after: 9 splits of 57 tiles, stream 31.3 + ~3 = ~34 us (92%).
//
// NOTE: keys at or beyond a request's kv_len are never read (zero-filled instead), so pages or
// slots the request does not own may hold anything, NaN included.
// NOTE: bad metadata cannot be checked on the host without a sync. A request whose used
// block-table entries are not all page ids in [0, num_pages) (or outside its table row) gets
// NaN in all its output rows, as reference.verify_attention defines: the runner's NaN check
// then fails that request alone. The plan checks each request's used entries once per forward
// (bad[] of the plan); the CUDA-core path, which has no plan, checks them in every block.
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
//     Key parts (default mode) likewise: whether a tile's keys are shared by 1, 2 or 4 warps
//     follows the number of rows in the tile (n_q x group). The merge itself is deterministic:
//     splits are summed in index order whichever finishes last.
//   * p.batch_invariant never splits and never shares a tile's keys between warps (one warp per
//     16 rows, all 64 keys). A row then runs, on either path, a sequence that is a function of
//     its own position alone:
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
#include "cuda/attn_merge.cuh"
#include "cuda/attn_plan.cuh"
#include "cuda/common.cuh"
#include "cuda/mma.cuh"

namespace dspark::cuda {
namespace {

// ---- 2: attention -----------------------------------------------------------------------------
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

// A work item: rows row0 .. row0 + rows_here - 1 (tile mt) of request r for KV head h, split s
// of S, over KV tiles tb .. te - 1 (keys below key_hi); its partial goes to `slot` (S > 1), and
// the unit's splits 0 .. S-1 sit at slot0 + s * mtiles.
struct Item {
  ReqInfo ri;
  int r, h, mt, S, row0, rows_here, tb, te, key_hi;
  int64_t slot, slot0;
  bool bad;
};

__device__ __forceinline__ Item DecodeItem(const AttnArgs& a, int item) {
  Item it;
  it.r = FindOwner(a.item_off, a.R, item);
  it.ri = LoadReq(a, it.r);
  const ReqInfo& ri = it.ri;
  it.S = a.split[it.r];
  it.bad = a.bad[it.r] != 0;
  const int local = item - a.item_off[it.r];
  it.mt = local % ri.mtiles;
  const int rest = local / ri.mtiles;
  const int s = rest % it.S;
  it.h = rest / it.S;
  it.slot = a.slot_off[it.r] + static_cast<int64_t>(local);
  it.slot0 = a.slot_off[it.r] + static_cast<int64_t>(it.h) * it.S * ri.mtiles + it.mt;
  it.row0 = it.mt * kBlockM;
  it.rows_here = min(kBlockM, ri.rows - it.row0);
  const int i_min = it.row0 / a.group, i_max = (it.row0 + it.rows_here - 1) / a.group;
  // The item's visible keys [kv_begin, kv_end); its tiles t_first .. t_end - 1 (those wholly
  // before kv_begin are skipped, not loaded) are cut into S near-equal splits.
  const int kv_begin = KeyLo(a, ri.L - ri.n + i_min);
  const int kv_end = KeyHi(a, ri.L, ri.L - ri.n + i_max);
  const int t_first = kv_begin / kBlockN;
  const int tiles = max(0, (kv_end + kBlockN - 1) / kBlockN - t_first);
  it.tb = t_first + static_cast<int>(static_cast<int64_t>(s) * tiles / it.S);
  it.te = t_first + static_cast<int>(static_cast<int64_t>(s + 1) * tiles / it.S);
  it.key_hi = min(it.te * kBlockN, kv_end);
  return it;
}

// Warps sharing each KV tile's keys: 4 for a tile of <= 16 rows, 2 for <= 32, else 1 (and always
// 1 under batch_invariant: see the NOTE on row invariance).
__device__ __forceinline__ int KeyParts(const AttnArgs& a, int rows_here) {
  if (a.batch_invariant) return 1;
  return rows_here <= 16 ? 4 : (rows_here <= 32 ? 2 : 1);
}

// KW > 1: warp (rg, kp) = (warp % RG, warp / RG) holds the online softmax of rows rg * 16 ..
// rg * 16 + 15 over the kp-th 64 / KW keys of every tile. Folds the parts kp > 0 into kp = 0,
// in the order kp = 0, 1, ...: per-row (m, l) through `buf` first, then the O fragments of the
// parts kp > 0 rescaled to the common max. Every thread of the block calls it.
template <int HD, int KW>
__device__ __forceinline__ void CombineKeyParts(float* buf, int warp, int lane, float& m0, float& m1, float& l0,
                                                float& l1, float (&o)[HD / 8][4]) {
  constexpr int RG = 4 / KW, kDTiles = HD / 8;
  const int rg = warp % RG, kp = warp / RG, g = lane >> 2, t = lane & 3;
  float* st = buf;            // [4 warps][16 rows] x (m, l)
  float* ob = buf + 4 * 32;   // [KW - 1][RG][kDTiles][4][32 lanes]
  if (t == 0) {
    st[(warp * 16 + g) * 2] = m0;
    st[(warp * 16 + g) * 2 + 1] = l0;
    st[(warp * 16 + g + 8) * 2] = m1;
    st[(warp * 16 + g + 8) * 2 + 1] = l1;
  }
  __syncthreads();
  float mx0 = -kInfF, mx1 = -kInfF;
#pragma unroll
  for (int k = 0; k < KW; ++k) {
    const int w = rg + k * RG;
    mx0 = fmaxf(mx0, st[(w * 16 + g) * 2]);
    mx1 = fmaxf(mx1, st[(w * 16 + g + 8) * 2]);
  }
  // A row no part saw keeps m = -inf: exponents use 0, so exp2(-inf - 0) = 0 rather than NaN.
  const float mu0 = mx0 == -kInfF ? 0.f : mx0, mu1 = mx1 == -kInfF ? 0.f : mx1;
  const float f0 = exp2f(m0 - mu0), f1 = exp2f(m1 - mu1);
  if (kp > 0) {
    float* dst = ob + ((kp - 1) * RG + rg) * kDTiles * 128;
#pragma unroll
    for (int dn = 0; dn < kDTiles; ++dn) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[(dn * 4 + e) * 32 + lane] = o[dn][e] * (e < 2 ? f0 : f1);
    }
  }
  __syncthreads();
  if (kp == 0) {
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int k = 0; k < KW; ++k) {
      const int w = rg + k * RG;
      s0 += exp2f(st[(w * 16 + g) * 2] - mu0) * st[(w * 16 + g) * 2 + 1];
      s1 += exp2f(st[(w * 16 + g + 8) * 2] - mu1) * st[(w * 16 + g + 8) * 2 + 1];
    }
#pragma unroll
    for (int dn = 0; dn < kDTiles; ++dn) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = o[dn][e] * (e < 2 ? f0 : f1);
#pragma unroll
        for (int k = 1; k < KW; ++k) v += ob[(((k - 1) * RG + rg) * kDTiles + dn) * 128 + e * 32 + lane];
        o[dn][e] = v;
      }
    }
    m0 = mx0;
    m1 = mx1;
    l0 = s0;
    l1 = s1;
  }
}

// One work item with KW warps on each tile's keys (KeyParts): loads Q and streams the item's KV
// tiles, then writes the output (S == 1) or the split's partial (S > 1).
template <class T, int HD, int KW>
__device__ __forceinline__ void AttnItem(const AttnArgs& a, unsigned char* smem_raw, const Item& it) {
  constexpr int kChunks = HD / 8;
  constexpr int kDTiles = HD / 8;   // n-tiles of the output
  constexpr int RG = 4 / KW;        // row groups of 16
  constexpr int kKeys = kBlockN / KW;  // keys of a tile per warp
  constexpr int NT = kKeys / 8;     // n-tiles of S per warp
  // [Q | K stage 0 | K stage 1 | V stage 0 | V stage 1], each [64][HD]. NOTE: stage pointers are
  // computed, not kept in an array, which a run-time index would move to local memory.
  T* sq = reinterpret_cast<T*>(smem_raw);
  auto sk = [&](int stage) { return sq + (kBlockM + stage * kBlockN) * HD; };
  auto sv = [&](int stage) { return sq + (kBlockM + (2 + stage) * kBlockN) * HD; };
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rg = warp % RG, kp = warp / RG, koff = kp * kKeys;
  const ReqInfo& ri = it.ri;
  const int r = it.r, h = it.h, row0 = it.row0, rows_here = it.rows_here, key_hi = it.key_hi;
  const int tb = it.tb, te = it.te;

  // ---- Q tile: packed row p = (query i, group member gg) ----
  {
    const T* qg = static_cast<const T*>(a.q);
#pragma unroll
    for (int i_t = 0; i_t < kBlockM * kChunks / kThreads; ++i_t) {
      const int idx = i_t * kThreads + threadIdx.x;
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

  // Rows of this thread: p0 = rg * 16 + g and p0 + 8; their visible keys [lo, hi) (causal
  // mask, window). The warp's tightest edges tell whether its keys of a tile need the mask.
  const int p0 = rg * 16 + g;
  const bool warp_active = rg * 16 < rows_here;
  const int qpos0 = ri.L - ri.n + (row0 + p0) / a.group;
  const int qpos1 = ri.L - ri.n + (row0 + p0 + 8) / a.group;
  const int lo0 = KeyLo(a, qpos0), hi0 = KeyHi(a, ri.L, qpos0);
  const int lo1 = KeyLo(a, qpos1), hi1 = KeyHi(a, ri.L, qpos1);
  const int hi_min_warp = KeyHi(a, ri.L, ri.L - ri.n + (row0 + rg * 16) / a.group);
  const int lo_max_warp = KeyLo(a, ri.L - ri.n + (row0 + min(rg * 16 + 15, rows_here - 1)) / a.group);
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
      const int kb = tile * kBlockN + koff;  // this warp's first key of the tile
      // ---- S = Q K^T (16 rows x kKeys keys per warp) ----
      float acc[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
      const int mi = lane >> 3, r8 = lane & 7;
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t qa[4];
        LdMatrixX4(qa, SmemAddr(sq + Swz<HD>(rg * 16 + (mi & 1) * 8 + r8, kk * 2 + (mi >> 1))));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t kb4[4];
          LdMatrixX4(kb4, SmemAddr(sk(stage) + Swz<HD>(koff + np * 16 + (mi >> 1) * 8 + r8, kk * 2 + (mi & 1))));
          Mma16816<T>(acc[2 * np], qa[0], qa[1], qa[2], qa[3], kb4[0], kb4[1]);
          Mma16816<T>(acc[2 * np + 1], qa[0], qa[1], qa[2], qa[3], kb4[2], kb4[3]);
        }
      }
      // ---- scale, mask, online softmax (exp2 domain) ----
      const bool need_mask = kb + kKeys > min(key_hi, hi_min_warp) || kb < lo_max_warp;
      float mx0 = -kInfF, mx1 = -kInfF;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
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
      for (int nt = 0; nt < NT; ++nt) {
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
      for (int kk = 0; kk < NT / 2; ++kk) {
        const uint32_t pa0 = PackPair<T>(acc[2 * kk][0], acc[2 * kk][1]);
        const uint32_t pa1 = PackPair<T>(acc[2 * kk][2], acc[2 * kk][3]);
        const uint32_t pa2 = PackPair<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
        const uint32_t pa3 = PackPair<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
#pragma unroll
        for (int dp = 0; dp < HD / 16; ++dp) {
          uint32_t vb[4];
          LdMatrixX4Trans(vb, SmemAddr(sv(stage) + Swz<HD>(koff + kk * 16 + (mi & 1) * 8 + r8, dp * 2 + (mi >> 1))));
          Mma16816<T>(o[2 * dp], pa0, pa1, pa2, pa3, vb[0], vb[1]);
          Mma16816<T>(o[2 * dp + 1], pa0, pa1, pa2, pa3, vb[2], vb[3]);
        }
      }
    }
    __syncthreads();  // this stage is refilled two iterations from now
  }
  CpAsyncWait<0>();  // an empty split loaded Q only: let it land before sq is reused

  // ---- epilogue ----
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  // NOTE: the K / V stages are free: the loop's last barrier (or, with no tile, the item's
  // first) follows every warp's last read of them.
  if constexpr (KW > 1) CombineKeyParts<HD, KW>(reinterpret_cast<float*>(sk(0)), warp, lane, m0, m1, l0, l1, o);
  if (!warp_active || kp != 0) return;
  float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  if (it.bad) inv0 = inv1 = kNaNF;  // NaN rows (a split: NaN partials of log-sum-exp +inf)
  const bool ok0 = p0 < rows_here, ok1 = p0 + 8 < rows_here;
  if (it.S == 1) {
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
    float* po = a.part_o + it.slot * kBlockM * HD;
#pragma unroll
    for (int dn = 0; dn < kDTiles; ++dn) {
      const int d = dn * 8 + 2 * t;
      if (ok0) *reinterpret_cast<float2*>(po + p0 * HD + d) = make_float2(o[dn][0] * inv0, o[dn][1] * inv0);
      if (ok1) *reinterpret_cast<float2*>(po + (p0 + 8) * HD + d) = make_float2(o[dn][2] * inv1, o[dn][3] * inv1);
    }
    if (t == 0) {
      float* pl = a.part_lse + it.slot * kBlockM;
      if (ok0) pl[p0] = it.bad ? kInfF : (l0 > 0.f ? m0 + log2f(l0) : -kInfF);
      if (ok1) pl[p0 + 8] = it.bad ? kInfF : (l1 > 0.f ? m1 + log2f(l1) : -kInfF);
    }
  }
}

// NOTE: head_dim 64 asks for 3 blocks per SM (<= 168 registers), as many as its 40 KB of shared
// memory and the registers of the loop allow; 128 for 2 (80 KB each).
template <class T, int HD>
__global__ void __launch_bounds__(kThreads, HD == 64 ? 3 : 2) AttnKernel(AttnArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ int last_s;
  static_assert(kMergeSmemFloats * 4 <= (kBlockM + 4 * kBlockN) * HD * 2, "the merge fits the tiles' place");
  const int total = a.item_off[a.R];
  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    const Item it = DecodeItem(a, item);
    __syncthreads();  // the previous item (its tiles, its merge) is done with shared memory
    const int kw = KeyParts(a, it.rows_here);
    if (kw == 4) {
      AttnItem<T, HD, 4>(a, smem_raw, it);
    } else if (kw == 2) {
      AttnItem<T, HD, 2>(a, smem_raw, it);
    } else {
      AttnItem<T, HD, 1>(a, smem_raw, it);
    }
    if (it.S > 1 && LastSplit(a.tickets + it.slot0, it.S, &last_s)) {
      MergeSplits<T, HD>(a, reinterpret_cast<float*>(smem_raw), it.ri, it.h, it.row0, it.rows_here, it.S, it.slot0,
                         it.ri.mtiles, it.bad);
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
// (attn_split.h SplitScore); slots <= split items. The partials' buffer has one slot more (more
// only on a GPU of over 2048 blocks) for the merge tickets, one int per split slot.
int64_t SplitSlots(int target) { return 2 * static_cast<int64_t>(target); }
int64_t SlotsFor(int target, int head_dim) {
  const int64_t per_slot = static_cast<int64_t>(kBlockM) * head_dim;
  return SplitSlots(target) + (SplitSlots(target) + per_slot - 1) / per_slot;
}

// The plan's arrays in `work` ([4 (R + 1)] int32: item_off | split | slot_off | bad) and the
// partials; the tickets live past the split slots of part_o.
void SetPlan(AttnArgs& a, int32_t* work, float* part_o, float* part_lse, int target) {
  const int n1 = a.R + 1;
  a.item_off = work;
  a.split = work + n1;
  a.slot_off = work + 2 * n1;
  a.bad = work + 3 * n1;
  a.part_o = part_o;
  a.part_lse = part_lse;
  a.tickets = reinterpret_cast<int*>(part_o + SplitSlots(target) * kBlockM * a.head_dim);
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
    if (p.plan_slots < SlotsFor(target, HD) || !p.part_o || !p.part_lse) return Status::kBadArgument;
    SetPlan(a, p.work, p.part_o, p.part_lse, target);
  } else {
    int32_t* work = nullptr;
    float *part_o = nullptr, *part_lse = nullptr;
    const size_t slots = static_cast<size_t>(SlotsFor(target, HD));
    if ((st = scratch.Get(4 * (static_cast<size_t>(a.R) + 1), &work)) != Status::kOk) return st;
    if ((st = scratch.Get(slots * kBlockM * HD, &part_o)) != Status::kOk) return st;
    if ((st = scratch.Get(slots * kBlockM, &part_lse)) != Status::kOk) return st;
    SetPlan(a, work, part_o, part_lse, target);
    AttnPlanKernel<<<1, 1024, 0, stream>>>(a, target);
    if ((st = LaunchStatus()) != Status::kOk) return st;
  }
  AttnKernel<T, HD><<<target, kThreads, smem, stream>>>(a);  // merges its own splits
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
  *slots = target > 0 ? SlotsFor(target, static_cast<int>(p.head_dim)) : 0;
  return st;
}

template <class T>
Status Plan(const VerifyAttentionParams& p, cudaStream_t stream) {
  DeviceLimits lim;
  if (Status s = CurrentDeviceLimits(&lim); s != Status::kOk) return s;
  int target = 0, smem = 0;
  Status st = TensorCoreGridFor<T>(p, lim, &target, &smem);
  if (st != Status::kOk || target == 0) return st;
  if (!p.work || !p.part_o || !p.part_lse || p.plan_slots < SlotsFor(target, static_cast<int>(p.head_dim))) {
    return Status::kBadArgument;
  }
  AttnArgs a = MakeArgs(p);
  SetPlan(a, p.work, p.part_o, p.part_lse, target);
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
