// markov_sample's selector head on the GPU (DFlash2's candidate selector): the whole drafting
// stage for R requests and gamma steps. Semantics: reference.markov_sample, head "selector".
// Per step k of a request: C_k = the top_k indices of U_k = logits[r, k] (NaN as -inf, equal
// values: lower index first); g = gate_w @ h_k; u = g * e (e = W1[x_{k-1}], u rounded to W);
// z_k = U_k + W2[c] . u on C_k and -inf elsewhere, written over the logits row; then the token
// (greedy argmax or Gumbel argmax, Philox as the other heads), lse_k, logprob_k and conf_k.
//
// Shape of the work. Only the token chain x_0 -> x_1 -> ... is sequential, and it is per
// request (no grid-wide barrier): everything that depends on U or h alone runs first, over all
// R * gamma rows at once.
//   * HeadProjKernel (head_proj.cuh, shared with markov_sample.cu): g = gate_w @ h_k and the
//     confidence head's conf_w[:d] . h_k for every row (float accumulators).
//   * SelectTopkKernel, block = (row, slice of the vocabulary): streams its slice of U once;
//     each warp keeps its running top_k in registers (2 or 8 entries per lane, sorted), fed by
//     ballots of the entries above its current k-th key, so after warm-up a 128-entry chunk
//     costs one compare per entry. The block merges its 8 warp lists by rank (binary searches)
//     and overwrites its slice with -inf. Candidates are ordered by one 64-bit key (value's
//     monotone bits, then 0x7fffffff - index), so the set is exact and independent of the
//     split, and the step kernel sees them in the reference's rank order.
//   * SelectMergeKernel (only when a row has several slices): merges the slices' lists by rank.
//   * SelectStepKernel, one block per request, loops over the gamma steps: e, u, one warp per
//     candidate for W2[c] . u, z written at the candidates, then warp 0 forms lse, the token
//     and logprob (one Philox word per candidate) while warp 1 forms the confidence logit.
// The slice count is chosen so that about 4 blocks per SM stream U (at most 32 slices of at
// least 2048 entries, slices x top_k <= 2048); the result does not depend on it.
//
// Floor, per step and request: the logits row read once and written once (2 V sizeof(T):
// 1.2 MB in float32 for V = 151936), plus top_k rows of W2 (top_k r sizeof(W)), one W1 row and
// g; once per launch gate_w (r d sizeof(W)) and hidden. Known to be below its floor:
//   * the step kernel is latency-bound: one block per request, and each step is a chain of
//     dependent loads (x -> W1 row -> W2 rows) and three barriers, a few us whatever the bytes;
//     at small R it leaves most SMs idle;
//   * the projection re-reads gate_w from L2 for every 8 rows (R * gamma / 8 times);
//   * a row whose values rise along the index keeps inserting into the warp lists (every entry
//     beats the k-th), several times slower than typical logits (slower, never wrong);
//   * four launches (three when a row is one slice).
//
// Types: T is the logits' (z and the roundings of the head's arithmetic, as the reference rounds
// them), W the weights' and hidden's (W = T, or bf16 / fp16 under float32 logits), as in
// markov_sample.cu; out of place (p.u), U is read from p.u, in T or in W, and z written over
// p.logits. top_k <= kSelectMaxTopK (256) and rank <= kSelectMaxRank (1024), else
// kUnsupported.
#include "cuda/markov_select.cuh"

#include <algorithm>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/head_proj.cuh"
#include "cuda/sampling.cuh"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kChunk = 128;      // vocabulary entries a warp reads at once: 32 lanes x 4
constexpr int kUnroll = 4;       // chunks in flight per warp (2 with the 8-slot lists: registers)
constexpr int kMaxSplit = 32;    // most slices (blocks) per row in the top-k sweep
constexpr int kMinSlice = 2048;  // fewest vocabulary entries per slice
constexpr int kMergeMax = 2048;  // slices x top_k: the merge kernel's shared-memory lists

// ---- the candidates' total order ---------------------------------------------------------------
// High word: monotone map of the value (NaN as -inf, -0 as +0); low word: 0x7fffffff - index,
// so equal values rank the lower index first. Keys of a row are unique and every real key is
// > 0: 0 marks an empty slot.
__device__ __forceinline__ uint64_t CandKey(float f, int idx) {
  if (f != f) f = -kInfF;
  if (f == 0.f) f = 0.f;
  const uint32_t b = __float_as_uint(f);
  const uint32_t o = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (static_cast<uint64_t>(o) << 32) | static_cast<uint32_t>(0x7fffffff - idx);
}

__device__ __forceinline__ int CandIndex(uint64_t key) {
  return 0x7fffffff - static_cast<int>(static_cast<uint32_t>(key) & 0x7fffffffu);
}

// A warp's running top-k: entry i (sorted by key, descending) lives in lane i % 32, slot i / 32,
// with its raw value (NaN kept: the key alone would lose it). Entries at positions >= k are
// scratch. Every member is warp-collective.
template <int E>
struct WarpTopK {
  uint64_t key[E];
  float val[E];

  __device__ __forceinline__ void Init() {
#pragma unroll
    for (int j = 0; j < E; ++j) {
      key[j] = 0;
      val[j] = -kInfF;
    }
  }
  // Key of entry k - 1: an entry enters the top k iff its key is larger.
  __device__ __forceinline__ uint64_t Threshold(int k) const {
    // NOTE: a mask, not `if (j == slot) t = key[j]`: the compiler turns that select of array
    // elements into a dynamic index, which moves the whole list to local memory.
    const int slot = (k - 1) >> 5;
    uint64_t t = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) t |= key[j] & (0ull - static_cast<uint64_t>(j == slot));
    return __shfl_sync(kFull, t, (k - 1) & 31);
  }
  // Inserts x (warp-uniform, not yet present) at its rank p if p < k; entries p.. move down one.
  __device__ __forceinline__ void Insert(uint64_t x, float xv, int k) {
    const int lane = threadIdx.x & 31;
    int p = 0;
#pragma unroll
    for (int j = 0; j < E; ++j) p += __popc(__ballot_sync(kFull, key[j] > x));
    if (p >= k) return;
    uint64_t up[E], wrap[E];
    float upv[E], wrapv[E];
#pragma unroll
    for (int j = 0; j < E; ++j) {
      up[j] = __shfl_up_sync(kFull, key[j], 1);   // entry i - 1 for lanes 1..31
      upv[j] = __shfl_up_sync(kFull, val[j], 1);
      wrap[j] = __shfl_sync(kFull, key[j], 31);   // entry 32 j + 31: lane 0's entry i - 1 of slot j + 1
      wrapv[j] = __shfl_sync(kFull, val[j], 31);
    }
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int i = j * 32 + lane;
      if (i == p) {
        key[j] = x;
        val[j] = xv;
      } else if (i > p) {  // i >= 1 here
        key[j] = lane > 0 ? up[j] : wrap[j > 0 ? j - 1 : 0];
        val[j] = lane > 0 ? upv[j] : wrapv[j > 0 ? j - 1 : 0];
      }
    }
  }
};

// Entries of a descending list of n keys that are larger than x.
__device__ __forceinline__ int CountGreater(const uint64_t* list, int n, uint64_t x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (list[mid] > x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The top k of L descending lists of k keys each (shared memory, 0 = empty) into out_key /
// out_val, in rank order: an entry's rank is its position in its own list plus the entries of
// the other lists above it (keys are unique). Slots past the real entries get key 0, value -inf.
__device__ __forceinline__ void MergeLists(const uint64_t* keys, const float* vals, int L, int k,
                                           uint64_t* out_key, float* out_val) {
  for (int e = threadIdx.x; e < L * k; e += blockDim.x) {
    const uint64_t x = keys[e];
    if (x == 0) continue;
    const int l = e / k;
    int rank = e - l * k;
    for (int l2 = 0; l2 < L && rank < k; ++l2) {
      if (l2 != l) rank += CountGreater(keys + l2 * k, k, x);
    }
    if (rank < k) {
      out_key[rank] = x;
      out_val[rank] = vals[e];
    }
  }
  for (int i = threadIdx.x; i < k; i += blockDim.x) {
    int n = 0;
    for (int l = 0; l < L; ++l) n += CountGreater(keys + l * k, k, 0);
    if (i >= n) {
      out_key[i] = 0;
      out_val[i] = -kInfF;
    }
  }
}

// ---- top-k of U, and the -inf fill ------------------------------------------------------------
struct TopkArgs {
  void* logits;        // [N, V] z: -inf written over every entry
  const void* u;       // [N, V] U, read (logits itself when in place)
  uint64_t* part_key;  // [N, S, K]
  float* part_val;     // [N, S, K]
  int V, K, S, slice;  // slice: entries per block, a multiple of kChunk
  bool vec;            // rows allow 4-element vector access
};

// Four entries v .. v + 3 of a row (beyond hi: -inf, never offered). Coherent loads: this kernel
// overwrites the row afterwards.
template <class T>
__device__ __forceinline__ float4 LoadQuad(const T* rp, int v, int hi, bool vec) {
  if (vec && v < hi) return Load4Coherent(rp + v);  // hi and v are multiples of 4 then
  float4 x = make_float4(-kInfF, -kInfF, -kInfF, -kInfF);
  if (v < hi) x.x = ToFloat(rp[v]);
  if (v + 1 < hi) x.y = ToFloat(rp[v + 1]);
  if (v + 2 < hi) x.z = ToFloat(rp[v + 2]);
  if (v + 3 < hi) x.w = ToFloat(rp[v + 3]);
  return x;
}

template <class T, class U, int E>
__global__ void __launch_bounds__(kThreads) SelectTopkKernel(TopkArgs a) {
  __shared__ uint64_t sk[kWarps * 32 * E];
  __shared__ float sv[kWarps * 32 * E];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x;
  const int split = blockIdx.y, K = a.K;
  const int lo = split * a.slice, hi = min(a.V, lo + a.slice);
  const U* up = static_cast<const U*>(a.u) + row * a.V;
  T* rp = static_cast<T*>(a.logits) + row * a.V;

  WarpTopK<E> top;
  top.Init();
  uint64_t thr = 0;
  constexpr int kU = E > 2 ? kUnroll / 2 : kUnroll;
  // Warp w reads chunks w, w + 8, ... of the slice (warp-uniform trip count: ballots below).
  for (int base = lo + warp * kChunk; base < hi; base += kWarps * kChunk * kU) {
    float4 xs[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) xs[u] = LoadQuad(up, base + u * kWarps * kChunk + lane * 4, hi, a.vec);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int v = base + u * kWarps * kChunk + lane * 4;
      const float xv[4] = {xs[u].x, xs[u].y, xs[u].z, xs[u].w};
      uint64_t kk[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) kk[j] = v + j < hi ? CandKey(xv[j], v + j) : 0;
      const uint64_t mx = max(max(kk[0], kk[1]), max(kk[2], kk[3]));
      if (!__any_sync(kFull, mx > thr)) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        unsigned m = __ballot_sync(kFull, kk[j] > thr);
        while (m) {
          const int src = __ffs(m) - 1;
          const uint64_t x = __shfl_sync(kFull, kk[j], src);
          const float xval = __shfl_sync(kFull, xv[j], src);
          top.Insert(x, xval, K);
          thr = top.Threshold(K);
          m &= m - 1;
          m &= __ballot_sync(kFull, kk[j] > thr);
        }
      }
    }
  }
  __syncthreads();  // every read of the slice is done: overwrite it with -inf

  for (int v = lo + static_cast<int>(threadIdx.x) * 4; v < hi; v += kThreads * 4) {
    if (a.vec) {
      Store4(rp + v, make_float4(-kInfF, -kInfF, -kInfF, -kInfF));
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (v + j < hi) rp[v + j] = FromFloat<T>(-kInfF);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const int i = j * 32 + lane;
    if (i < K) {
      sk[warp * K + i] = top.key[j];
      sv[warp * K + i] = top.val[j];
    }
  }
  __syncthreads();
  const int64_t out = (row * a.S + split) * K;
  MergeLists(sk, sv, kWarps, K, a.part_key + out, a.part_val + out);
}

// The slices' lists of a row -> its candidates.
__global__ void __launch_bounds__(kThreads) SelectMergeKernel(const uint64_t* part_key, const float* part_val, int S,
                                                              int K, uint64_t* cand_key, float* cand_val) {
  __shared__ uint64_t sk[kMergeMax];
  __shared__ float sv[kMergeMax];
  const int64_t row = blockIdx.x;
  const int n = S * K;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    sk[i] = part_key[row * n + i];
    sv[i] = part_val[row * n + i];
  }
  __syncthreads();
  MergeLists(sk, sv, S, K, cand_key + row * K, cand_val + row * K);
}

// ---- the sequential steps ---------------------------------------------------------------------
struct StepArgs {
  void* logits;  // [R, gamma, V]: -inf outside the candidates (SelectTopkKernel)
  const int64_t* anchor;
  const void* w1;
  const void* w2;
  const void* conf_w;
  const void* conf_b;
  const float* temperature;
  const uint64_t* seed;
  const int64_t* stream;
  const int64_t* round;
  const uint8_t* coupled;   // [R] or null
  const int32_t* mask;      // [R, ceil(V / 32)] or null: the grammar's token bitmask of step 1
  const uint64_t* cand_key; // [R, gamma, K] in rank order
  const float* cand_val;    // [R, gamma, K] their U values
  const float* hg;          // [R, gamma, rank] gate_w @ h_k, or null (d = 0: g = 0)
  const float* hc;          // [R, gamma] conf_w[:d] . h_k, or null (d = 0)
  int64_t* tokens;
  float* logprob;
  float* lse;
  float* conf_logit;
  int gamma, V, rank, d, K;
  bool confidence, confidence_markov;
  bool w2_vec;  // W2 rows allow 4-element vector loads
};

template <class T, class W>
__global__ void __launch_bounds__(kThreads) SelectStepKernel(StepArgs a) {
  __shared__ __align__(16) float e_s[kSelectMaxRank];
  __shared__ __align__(16) float u_s[kSelectMaxRank];
  __shared__ float z_s[kSelectMaxTopK];
  __shared__ int c_s[kSelectMaxTopK];
  __shared__ int x_s;
  const int rq = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const W* w1 = static_cast<const W*>(a.w1);
  const W* w2 = static_cast<const W*>(a.w2);
  const int rank = a.rank, K = a.K;

  const int64_t x0 = a.anchor[rq];
  int x = (x0 >= 0 && x0 < a.V) ? static_cast<int>(x0) : 0;
  const float tf = a.temperature[rq];
  const bool greedy = tf == 0.f;
  const float inv_t = greedy ? 1.f : 1.f / tf;
  const double td = greedy ? 1.0 : static_cast<double>(tf);
  const PhiloxKey pkey{a.seed[rq], static_cast<uint32_t>(a.stream[rq]), static_cast<uint32_t>(a.round[rq])};
  const bool coupled = a.coupled && a.coupled[rq];

  for (int k = 0; k < a.gamma; ++k) {
    const int64_t o = static_cast<int64_t>(rq) * a.gamma + k;
    T* row = static_cast<T*>(a.logits) + o * a.V;
    // e = W1[x_{k-1}]; u = g * e in T, then rounded to W (the reference's u.to(W)).
    const float* hg = a.hg ? a.hg + o * rank : nullptr;
    for (int j = tid; j < rank; j += kThreads) {
      const float e = ToFloat(w1[static_cast<int64_t>(x) * rank + j]);
      e_s[j] = e;
      const float g = hg ? RoundTo<T>(hg[j]) : 0.f;
      u_s[j] = RoundTo<W>(RoundTo<T>(g * e));
    }
    for (int c = tid; c < K; c += kThreads) {
      const int v = CandIndex(a.cand_key[o * K + c]);
      c_s[c] = (v >= 0 && v < a.V) ? v : -1;  // -1: an empty slot (none while top_k <= V)
    }
    __syncthreads();

    // z = U + bias on the candidates, bias = W2[c] . u rounded to T: one warp per candidate.
    for (int c = warp; c < K; c += kWarps) {
      const int v = c_s[c];  // warp-uniform
      float z = -kInfF;
      if (v >= 0) {
        const W* wr = w2 + static_cast<int64_t>(v) * rank;
        float acc = 0.f;
        if (a.w2_vec) {
          for (int j = lane * 4; j < rank; j += 128) {
            const float4 w = Load4(wr + j);
            const float4 u = *reinterpret_cast<const float4*>(u_s + j);
            acc = fmaf(w.x, u.x, fmaf(w.y, u.y, fmaf(w.z, u.z, fmaf(w.w, u.w, acc))));
          }
        } else {
          for (int j = lane; j < rank; j += 32) acc = fmaf(ToFloat(wr[j]), u_s[j], acc);
        }
        acc = WarpSum(acc);
        z = RoundTo<T>(a.cand_val[o * K + c] + RoundTo<T>(acc));
        // step 1 under a grammar: a forbidden candidate is -inf (candidates are U's top_k)
        if (k == 0 && !TokenAllowed(a.mask ? a.mask + static_cast<int64_t>(rq) * ((a.V + 31) / 32) : nullptr, v)) z = -kInfF;
        if (lane == 0) row[v] = FromFloat<T>(z);
      }
      if (lane == 0) z_s[c] = z;
    }
    __syncthreads();

    if (warp == 0) {
      // x_k, lse_k, logprob_k over the candidates (every other entry is -inf: it adds nothing
      // to the sum and wins only when every score is -inf, where the reference picks index 0).
      const NoiseSite site = SiteOf(pkey, coupled, kPurposeDraft, k + 1);
      ArgMax am;
      am.Init();
      LogSumExp ls;
      ls.Init();
      for (int c = lane; c < K; c += 32) {
        const int v = c_s[c];
        if (v < 0) continue;
        const float z = z_s[c];
        ls.Add4(make_float4(z, -kInfF, -kInfF, -kInfF), inv_t);
        if (greedy) {
          am.Offer(static_cast<double>(z), v);
        } else {
          // the word of index v (philox.h), as the sweep kernel draws it: quad v / 4, lane v % 4
          const uint4 w4 = PhiloxQuad(site.key, site.purpose, site.position, static_cast<uint32_t>(v) >> 2);
          const int q = v & 3;
          const uint32_t word = q == 0 ? w4.x : (q == 1 ? w4.y : (q == 2 ? w4.z : w4.w));
          am.Offer(static_cast<double>(z) / td + GumbelExact(word), v);
        }
      }
      ls.WarpMerge(inv_t);
      am.WarpMerge();
      if (lane == 0) {
        const int xk = (am.best == -kInfD || am.idx < 0 || am.idx >= a.V) ? 0 : am.idx;
        const double l = ls.Value(td);
        const double zx = static_cast<double>(ToFloat(row[xk]));  // written above, or -inf
        a.tokens[o] = xk;
        a.lse[o] = static_cast<float>(l);
        a.logprob[o] = static_cast<float>(zx / td - l);
        x_s = xk;
      }
    } else if (warp == 1 && a.confidence) {
      // conf_k = conf_w . [h_k; e] (or h_k) + conf_b, rounded as the reference rounds it.
      float dot = 0.f;
      if (a.confidence_markov) {
        const W* cw = static_cast<const W*>(a.conf_w) + a.d;
        for (int j = lane; j < rank; j += 32) dot = fmaf(ToFloat(cw[j]), e_s[j], dot);
      }
      dot = WarpSum(dot);
      if (lane == 0) {
        const float h = a.hc ? a.hc[o] : 0.f;
        const float cb = ToFloat(static_cast<const W*>(a.conf_b)[0]);
        a.conf_logit[o] = RoundTo<T>(RoundTo<T>(h + dot) + cb);
      }
    }
    __syncthreads();
    x = x_s;
  }
}

// ---- host -------------------------------------------------------------------------------------
template <class T, class U, int E>
Status LaunchTopk(const TopkArgs& a, int64_t N, cudaStream_t stream) {
  SelectTopkKernel<T, U, E><<<dim3(static_cast<unsigned>(N), static_cast<unsigned>(a.S)), kThreads, 0, stream>>>(a);
  return LaunchStatus();
}

template <class T, class W>
Status SelectLaunch(const MarkovSampleParams& p, cudaStream_t stream) {
  DeviceLimits lim;
  if (Status s = CurrentDeviceLimits(&lim); s != Status::kOk) return s;
  const int R = static_cast<int>(p.R), gamma = static_cast<int>(p.gamma), V = static_cast<int>(p.V);
  const int rank = static_cast<int>(p.rank), d = static_cast<int>(p.d), K = static_cast<int>(p.top_k);
  const int64_t N = static_cast<int64_t>(R) * gamma;
  constexpr int kElem = sizeof(W);
  const bool conf = p.confidence;

  // Slices per row: about 4 blocks per SM in all, each slice a multiple of kChunk entries.
  const int64_t max_split = std::max<int64_t>(
      1, std::min<int64_t>({kMaxSplit, kMergeMax / K, CeilDiv(V, kMinSlice)}));
  int64_t S = std::min<int64_t>(max_split, std::max<int64_t>(1, CeilDiv(4ll * lim.sm_count, N)));
  const int slice = static_cast<int>(CeilDiv(CeilDiv(V, S), kChunk) * kChunk);
  S = CeilDiv(V, slice);

  Scratch scratch(stream);
  Status st;
  float* hg = nullptr;
  float* hc = nullptr;
  uint64_t* part_key = nullptr;
  float* part_val = nullptr;
  if (d > 0 && (st = scratch.Get(static_cast<size_t>(N) * rank, &hg)) != Status::kOk) return st;
  if (d > 0 && conf && (st = scratch.Get(static_cast<size_t>(N), &hc)) != Status::kOk) return st;
  if ((st = scratch.Get(static_cast<size_t>(N) * S * K, &part_key)) != Status::kOk) return st;
  if ((st = scratch.Get(static_cast<size_t>(N) * S * K, &part_val)) != Status::kOk) return st;
  uint64_t* cand_key = part_key;  // one slice: the block's list is the row's
  float* cand_val = part_val;
  if (S > 1) {
    if ((st = scratch.Get(static_cast<size_t>(N) * K, &cand_key)) != Status::kOk) return st;
    if ((st = scratch.Get(static_cast<size_t>(N) * K, &cand_val)) != Status::kOk) return st;
  }

  if (d > 0) {
    HeadProjArgs pa{};
    pa.hidden = p.hidden;
    pa.gate_w = p.gate_w;
    pa.conf_w = conf ? p.conf_w : nullptr;
    pa.hg = hg;
    pa.hc = hc;
    pa.N = N;
    pa.d = d;
    pa.rank_rows = rank;
    pa.ld_gate = d;
    if ((st = LaunchHeadProj<W, kThreads>(pa, lim.sm_count, stream)) != Status::kOk) return st;
  }

  TopkArgs ta{};
  ta.logits = p.logits;
  ta.u = p.u ? p.u : p.logits;
  ta.part_key = part_key;
  ta.part_val = part_val;
  ta.V = V;
  ta.K = K;
  ta.S = static_cast<int>(S);
  ta.slice = slice;
  // U in the 16-bit weight dtype under float logits (out of place), else in T
  const bool narrow_u = p.u && p.u_dtype != p.dtype;
  st = Status::kUnsupported;
  ta.vec = V % 4 == 0 && Aligned(p.logits, 4 * sizeof(T)) &&
           Aligned(ta.u, 4 * (narrow_u ? sizeof(W) : sizeof(T)));
  if constexpr (!std::is_same_v<T, W>) {
    if (narrow_u) st = K <= 64 ? LaunchTopk<T, W, 2>(ta, N, stream) : LaunchTopk<T, W, 8>(ta, N, stream);
  }
  if (!narrow_u) st = K <= 64 ? LaunchTopk<T, T, 2>(ta, N, stream) : LaunchTopk<T, T, 8>(ta, N, stream);
  if (st != Status::kOk) return st;

  if (S > 1) {
    SelectMergeKernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(part_key, part_val, static_cast<int>(S), K,
                                                                          cand_key, cand_val);
    if ((st = LaunchStatus()) != Status::kOk) return st;
  }

  StepArgs sa{};
  sa.logits = p.logits;
  sa.anchor = p.anchor;
  sa.w1 = p.w1;
  sa.w2 = p.w2;
  sa.conf_w = p.conf_w;
  sa.conf_b = p.conf_b;
  sa.temperature = p.temperature;
  sa.seed = p.seed;
  sa.stream = p.stream;
  sa.round = p.round;
  sa.coupled = p.coupled;
  sa.mask = p.token_bitmask;
  sa.cand_key = cand_key;
  sa.cand_val = cand_val;
  sa.hg = hg;
  sa.hc = hc;
  sa.tokens = p.tokens;
  sa.logprob = static_cast<float*>(p.logprob);
  sa.lse = static_cast<float*>(p.lse);
  sa.conf_logit = static_cast<float*>(p.conf_logit);
  sa.gamma = gamma;
  sa.V = V;
  sa.rank = rank;
  sa.d = d;
  sa.K = K;
  sa.confidence = conf;
  sa.confidence_markov = p.confidence_markov;
  sa.w2_vec = rank % 4 == 0 && Aligned(p.w2, 4 * kElem);
  SelectStepKernel<T, W><<<R, kThreads, 0, stream>>>(sa);
  return LaunchStatus();
}

}  // namespace

template <class T, class W>
Status MarkovSelectLaunch(const MarkovSampleParams& p, cudaStream_t stream) {
  if (p.R == 0 || p.gamma == 0) return Status::kOk;
  if (p.top_k < 1 || p.top_k > p.V || p.rank < 1) return Status::kBadArgument;
  if (p.top_k > kSelectMaxTopK || p.rank > kSelectMaxRank) return Status::kUnsupported;
  if (!p.w1 || !p.w2 || (p.d > 0 && (!p.gate_w || !p.hidden))) return Status::kBadArgument;
  if (p.confidence && (!p.conf_w || !p.conf_b)) return Status::kBadArgument;
  return SelectLaunch<T, W>(p, stream);
}

template Status MarkovSelectLaunch<float, float>(const MarkovSampleParams&, cudaStream_t);
template Status MarkovSelectLaunch<__half, __half>(const MarkovSampleParams&, cudaStream_t);
template Status MarkovSelectLaunch<__nv_bfloat16, __nv_bfloat16>(const MarkovSampleParams&, cudaStream_t);
template Status MarkovSelectLaunch<float, __nv_bfloat16>(const MarkovSampleParams&, cudaStream_t);
template Status MarkovSelectLaunch<float, __half>(const MarkovSampleParams&, cudaStream_t);

}  // namespace dspark::cuda
