// rejection_sample on the GPU: lossless acceptance for the whole batch (DESIGN §2 step 6).
// Semantics: reference.rejection_sample.
//
// Two stream-ordered launches, each over the whole batch:
//   1. RowStatsKernel, block = (request, verified row, 8192-entry vocabulary chunk): streams the
//      target row once and leaves a partial: the argmax (greedy rows), the log-sum-exp of x / T
//      (rows whose P feeds an acceptance test) or a Gumbel argmax (the last row's bonus token;
//      every row of a coupled request, whose tokens y_k are all Gumbel argmaxes). Rows whose
//      start is 16-byte aligned stream in 16-byte loads, kInFlight of them issued per thread
//      before the first is used (128 B a thread, 32 KB a block in flight); each thread keeps
//      float statistics over its 32 entries and the block merges them once.
//   2. DecideKernel, block = (request, chunk): every block of a request merges the row partials
//      in the same fixed order and runs the (at most gamma) acceptance tests, so all reach the
//      same decision; at a rejection each block then streams its chunk of the target and draft
//      rows once more for the residual Gumbel-max, max(0, P - q) formed on the fly, and the
//      last of the request's blocks to finish (an atomic ticket) merges the chunks' residual
//      partials into y, in chunk order.
// Coupled requests (DESIGN §2) decide like greedy ones, x_k == y_k, on their rows' Gumbel argmaxes
// and never sweep a residual.
// A sampled draft row whose q is not finite (draft_lse NaN or +-inf, a draft logit NaN or +inf:
// a drafter's overflow) is rejected in full and its residual is P itself (reference.py
// nonfinite_q). Launch 1 checks the draft rows of those tests as it streams their target rows.
// The NaN / +inf check of every verified row (the request's `failed`) rides on launch 1's one
// pass: no separate sweep of the logits. Target logits may be 16-bit under float32 drafts (a
// bf16 model's verify output as it is: widened in registers, exactly as a cast would), which
// halves launch 1's bytes and saves the cast's read and write.
// A grammar's token bitmask (null: none) is applied where target entries are loaded (MaskQuad):
// launch 1's statistics, the acceptance test's P(x) and the residual sweep all read forbidden
// entries as -inf, so the whole rule runs on P' = P * mask / Z at no extra pass; launch 1 also
// flags a row whose mask allows nothing (kAllowed missing from every chunk: the request fails).
// Splitting rows into fixed-size chunks (rather than one block per request) keeps the Gumbel
// work of a single request spread over many SMs: at R = 1 a one-block sweep of 152k entries
// would take tens of microseconds of Philox and logs. The chunk size is a constant, so results
// (including the log-sum-exp rounding) do not depend on the GPU or the launch shape.
#include "rejection_sample.h"

#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/sampling.cuh"

namespace dspark::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 8192;  // vocabulary entries per block: 8 quads per thread
constexpr int kInFlight = 4;  // 16-byte loads a RowStats thread issues before it uses the first

struct RowStat {
  double best;  // argmax part (greedy argmax, bonus Gumbel argmax or residual Gumbel argmax)
  int idx;
  float m;      // log-sum-exp part (sampling.cuh)
  double s;
  int bad;      // kTargetBad: the chunk of the target row holds NaN or +inf; kDraftBad: the
                // chunk of the draft row judged against it does
};
constexpr int kTargetBad = 1, kDraftBad = 2, kAllowed = 4;  // kAllowed: the chunk allows a token

struct Args {
  const void* target;  // [N, V]
  const int32_t* cu_rows;
  const int64_t* draft_tokens;  // [R, gamma]
  const void* draft_logits;     // [R, gamma, V]
  const float* draft_lse;       // [R, gamma]
  const float* temperature;
  const uint64_t* seed;
  const int64_t* stream;
  const int64_t* round;
  const uint8_t* coupled;       // [R] or null
  const int32_t* mask;          // [N, words] or null: the grammar's token bitmask per target row
  int words;                    // ceil(V / 32)
  int32_t* num_accepted;
  int64_t* out_tokens;  // [R, gamma + 1]
  uint8_t* failed;      // [R]
  RowStat* stats;       // [R, gamma + 1, C]
  RowStat* resid;       // [R, C]
  int* tickets;         // [R] Decide blocks of the request done with their residual chunk
  int R, gamma, V, C;
  bool vec_t, vec_d;    // target / draft rows allow 4-element vector loads
  bool v16_t, v16_d;    // ... and 16-byte loads (every row start 16-byte aligned)
};

__device__ __forceinline__ PhiloxKey KeyOf(const Args& a, int r) {
  return PhiloxKey{a.seed[r], static_cast<uint32_t>(a.stream[r]), static_cast<uint32_t>(a.round[r])};
}

__device__ __forceinline__ bool CoupledOf(const Args& a, int r) { return a.coupled && a.coupled[r]; }

// The mask row of target row `row` (null: no grammar).
__device__ __forceinline__ const int32_t* MaskRow(const Args& a, int64_t row) {
  return a.mask ? a.mask + row * a.words : nullptr;
}

template <class T>
__device__ __forceinline__ float4 LoadQuad(const T* row, int v, int nvalid, bool vec) {
  float4 x = make_float4(-kInfF, -kInfF, -kInfF, -kInfF);
  if (nvalid == 4 && vec) return Load4(row + v);
  if (nvalid > 0) x.x = ToFloat(row[v]);
  if (nvalid > 1) x.y = ToFloat(row[v + 1]);
  if (nvalid > 2) x.z = ToFloat(row[v + 2]);
  if (nvalid > 3) x.w = ToFloat(row[v + 3]);
  return x;
}

// Merges every thread's (argmax, lse) into thread 0's, in a fixed order.
__device__ __forceinline__ void BlockMerge(ArgMax& am, LogSumExp& lse, float inv_t) {
  __shared__ double sb[kWarps], ss[kWarps];
  __shared__ int si[kWarps];
  __shared__ float sm[kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  am.WarpMerge();
  lse.WarpMerge(inv_t);
  if (lane == 0) {
    sb[warp] = am.best;
    si[warp] = am.idx;
    sm[warp] = lse.m;
    ss[warp] = lse.s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      am.Merge(ArgMax{sb[w], si[w]});
      lse.Merge(LogSumExp{sm[w], ss[w]}, inv_t);
    }
  }
}

// ---- 1: per-row partials ---------------------------------------------------------------------
// Elements of T in one 16-byte load, widened to float (exactly).
template <class T> struct Vec16 { static constexpr int kElems = 16 / sizeof(T); };

__device__ __forceinline__ void Unpack16(uint4 u, const float*, float out[4]) {
  out[0] = __uint_as_float(u.x);
  out[1] = __uint_as_float(u.y);
  out[2] = __uint_as_float(u.z);
  out[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ float2 Widen2(uint32_t w, const __half*) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ float2 Widen2(uint32_t w, const __nv_bfloat16*) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
template <class H>
__device__ __forceinline__ void Unpack16(uint4 u, const H* tag, float out[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = Widen2(w[i], tag);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// One thread's running statistics of a row over the entries it streams, in float: a greedy
// row's argmax (float compares are exact: the reference's double scores are the floats widened),
// a test row's log-sum-exp (m, s), a Gumbel row's argmax (exact double scores, float pre-filter),
// and whether a NaN or +inf went by. The block merges them once, in double (BlockMerge).
struct RowLane {
  float gmax = -kInfF;   // greedy: best value (NaN counts as -inf, as reference._first_argmax)
  int gidx = 0x7fffffff;
  float m = -kInfF, s = 0.f;  // log-sum-exp of x / T: max and sum of exp((x - m) / T)
  ArgMax am;             // Gumbel rows
  float best_f = -kInfF;
  bool bad = false;
  bool allowed = false;  // the chunk's mask bits allow a token (set after the stream)

  // Four consecutive entries v .. v + 3 (invalid ones -inf and beyond nvalid).
  __device__ __forceinline__ void Add(int kind, float4 x, int v, int nvalid, float inv_t, double td,
                                      const NoiseSite& site) {
    bad |= !(x.x < kInfF) | !(x.y < kInfF) | !(x.z < kInfF) | !(x.w < kInfF);
    if (kind == 0) {
      OfferMax4(gmax, gidx, x, v, nvalid);
    } else if (kind == 1) {
      OfferGumbel4(am, best_f, x, v, nvalid, inv_t, td, site.key, site.purpose, site.position);
    } else {
      AddLse(x, inv_t);
    }
  }
  // LogSumExp::Add4 with a float sum (a thread adds at most 32 terms <= 1 per chunk).
  __device__ __forceinline__ void AddLse(float4 x, float inv_t) {
    const float mx = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));
    if (mx > m) {
      s *= __expf((m - mx) * inv_t);
      m = mx;
    }
    if (m == -kInfF || m == kInfF) {
      if (m == kInfF && s == s) s = 1.f;
      if (x.x != x.x || x.y != x.y || x.z != x.z || x.w != x.w) s = kNaNF;
      return;
    }
    s += (__expf((x.x - m) * inv_t) + __expf((x.y - m) * inv_t)) +
         (__expf((x.z - m) * inv_t) + __expf((x.w - m) * inv_t));
  }
  // The block-merge states of this thread.
  __device__ __forceinline__ void Export(int kind, ArgMax& out_am, LogSumExp& out_lse) const {
    out_am = am;
    if (kind == 0 && gidx != 0x7fffffff) out_am = ArgMax{static_cast<double>(gmax), gidx};
    out_lse = LogSumExp{m, static_cast<double>(s)};
  }
};

// What StreamRow feeds: a target row into a thread's statistics, or a draft row into its
// NaN / +inf flag. (Functors, not lambdas: their calls are forced inline, no ABI call.)
struct TargetSink {
  RowLane* acc;
  int kind;
  float inv_t;
  double td;
  NoiseSite site;
  const int32_t* mask;  // the row's grammar mask, or null
  __device__ __forceinline__ void operator()(float4 x, int v, int nvalid) const {
    acc->Add(kind, MaskQuad(x, mask, v), v, nvalid, inv_t, td, site);
  }
};
struct DraftSink {
  bool* bad;
  __device__ __forceinline__ void operator()(float4 z, int, int) const {
    *bad |= !(z.x < kInfF) | !(z.y < kInfF) | !(z.z < kInfF) | !(z.w < kInfF);
  }
};

// Streams entries [v_begin, v_end) of `row` into `fn`: 16-byte loads (kInFlight per thread in
// flight) over the whole vectors when `v16` (the row start is 16-byte aligned; v_begin is a
// multiple of the vector width), 4-element or scalar loads for the tail.
template <class T, class Fn>
__device__ __forceinline__ void StreamRow(const T* row, int v_begin, int v_end, bool v16, bool vec4, const Fn& fn) {
  constexpr int E = Vec16<T>::kElems;
  int v_tail = v_begin;
  if (v16) {
    const uint64_t pol = EvictFirstPolicy();
    v_tail = v_begin + (v_end - v_begin) / E * E;
    for (int base = v_begin + threadIdx.x * E; base < v_tail; base += kThreads * E * kInFlight) {
      uint4 u[kInFlight];
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        const int v = base + i * kThreads * E;
        u[i] = v < v_tail ? LdStream16(row + v, pol) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        const int v = base + i * kThreads * E;
        if (v < v_tail) {
          float f[E];
          Unpack16(u[i], row, f);
#pragma unroll
          for (int q = 0; q < E / 4; ++q) fn(make_float4(f[4 * q], f[4 * q + 1], f[4 * q + 2], f[4 * q + 3]), v + 4 * q, 4);
        }
      }
    }
  }
  // NOTE: v_tail - v_begin is a multiple of 4, so the tail's quads stay Philox quads.
  for (int v = v_tail + threadIdx.x * 4; v < v_end; v += kThreads * 4) {
    const int nvalid = min(4, v_end - v);
    fn(LoadQuad(row, v, nvalid, vec4), v, nvalid);
  }
}

template <class T, class D>
__global__ void __launch_bounds__(kThreads) RowStatsKernel(Args a) {
  const int ra = blockIdx.x, c = blockIdx.y;
  const int r = ra / (a.gamma + 1), row_k = ra - r * (a.gamma + 1);
  // DecideKernel's residual tickets start at 0 (stream order: it runs after this launch).
  if (row_k == 0 && c == 0 && threadIdx.x == 0) a.tickets[r] = 0;
  const int lo = a.cu_rows[r], ell = a.cu_rows[r + 1] - lo - 1;
  if (ell < 0 || ell > a.gamma || row_k > ell) return;
  const float tf = a.temperature[r];
  const bool greedy = tf == 0.f;
  const bool coupled = CoupledOf(a, r);
  // bonus row, or any coupled row: y = argmax(row / T + gumbel(site))
  const bool gumbel_row = !greedy && (coupled || row_k == ell);
  const int kind = greedy ? 0 : gumbel_row ? 1 : 2;
  const NoiseSite site = coupled ? SiteOf(KeyOf(a, r), true, 0, row_k + 1)
                                 : SiteOf(KeyOf(a, r), false, kPurposeEmit, ell + 1);
  const float inv_t = greedy ? 1.f : 1.f / tf;
  const double td = greedy ? 1.0 : static_cast<double>(tf);
  const T* row = static_cast<const T*>(a.target) + static_cast<int64_t>(lo + row_k) * a.V;
  const int v_begin = c * kChunk, v_end = min(a.V, (c + 1) * kChunk);

  RowLane acc;
  acc.am.Init();
  const int32_t* mask = MaskRow(a, lo + row_k);
  StreamRow(row, v_begin, v_end, a.v16_t, a.vec_t, TargetSink{&acc, kind, inv_t, td, site, mask});
  if (mask) {  // the chunk allows a token iff a bit of its range is set (whatever the logits)
    for (int v = v_begin + threadIdx.x; v < v_end && !acc.allowed; v += kThreads) acc.allowed = TokenAllowed(mask, v);
  }
  // NOTE: an acceptance test's draft row is streamed too, for NaN / +inf only (a drafter's
  // overflow must reject, not emit): 4 more bytes per entry of the rows that run a test.
  bool dbad = false;
  if (kind == 2) {
    const D* drow = static_cast<const D*>(a.draft_logits) + (static_cast<int64_t>(r) * a.gamma + row_k) * a.V;
    StreamRow(drow, v_begin, v_end, a.v16_d, a.vec_d, DraftSink{&dbad});
  }
  const int any_bad = (__syncthreads_or(acc.bad) ? kTargetBad : 0) | (__syncthreads_or(dbad) ? kDraftBad : 0) |
                      (!mask || __syncthreads_or(acc.allowed) ? kAllowed : 0);
  ArgMax am;
  LogSumExp lse;
  acc.Export(kind, am, lse);
  BlockMerge(am, lse, inv_t);
  if (threadIdx.x == 0) a.stats[static_cast<int64_t>(ra) * a.C + c] = RowStat{am.best, am.idx, lse.m, lse.s, any_bad};
}

// ---- 2: acceptance tests and the residual sweep ----------------------------------------------
// Absolute error bound of a float exponent a1 - c and its __expf (see the residual sweep).
// Capped at 1 so that a masked entry (a1 = -inf, exp = 0) adds 0, not inf * 0 = NaN; an error
// that large only arises where exp(a1 - c) is 0 or inf in float anyway.
__device__ __forceinline__ float ErrBound(float a1, float c) {
  return fminf(4.8e-7f * (fabsf(a1) + fabsf(c) + 1.f), 1.f);  // 2^-21 = 4.77e-7
}

constexpr int kMaxRows = 64;  // gamma + 1 rows of one request (the launcher checks gamma < 64)

// Merges the C chunk partials of one row with the lanes of a warp, in a fixed tree order.
// Returns the OR of the chunks' kTargetBad / kDraftBad flags (every lane gets it).
__device__ __forceinline__ int WarpMergeRow(const RowStat* st, int C, float inv_t, ArgMax& am, LogSumExp& lse) {
  const int lane = threadIdx.x & 31;
  am.Init();
  lse.Init();
  int bad = 0, allowed = 0;
  for (int c = lane; c < C; c += 32) {
    const RowStat s = st[c];
    am.Merge(ArgMax{s.best, s.idx});
    lse.Merge(LogSumExp{s.m, s.s}, inv_t);
    bad |= s.bad;
    allowed |= s.bad & kAllowed;
  }
  am.WarpMerge();
  lse.WarpMerge(inv_t);
  return (__any_sync(0xffffffffu, bad & kTargetBad) ? kTargetBad : 0) |
         (__any_sync(0xffffffffu, bad & kDraftBad) ? kDraftBad : 0) |
         (__any_sync(0xffffffffu, allowed) ? kAllowed : 0);
}

template <class T, class D>
__global__ void __launch_bounds__(kThreads) DecideKernel(Args a) {
  __shared__ int arg_s[kMaxRows];
  __shared__ unsigned char ok_s[kMaxRows], bad_s[kMaxRows], qbad_s[kMaxRows];
  __shared__ double lse_row[kMaxRows];
  __shared__ float m_row[kMaxRows], logs_row[kMaxRows];
  __shared__ int a_s, y_s, rejected_s;
  const int r = blockIdx.x, c = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int lo = a.cu_rows[r], ell = a.cu_rows[r + 1] - lo - 1;
  const int G1 = a.gamma + 1;
  if (ell < 0 || ell > a.gamma) {  // malformed cu_rows: emit nothing rather than read out of range
    if (c == 0) {
      for (int j = threadIdx.x; j < G1; j += kThreads) a.out_tokens[static_cast<int64_t>(r) * G1 + j] = -1;
      if (threadIdx.x == 0) {
        a.num_accepted[r] = 0;
        a.failed[r] = 1;
      }
    }
    return;
  }
  const float tf = a.temperature[r];
  const bool greedy = tf == 0.f;
  // greedy and coupled rows accept x_k iff it equals row k-1's (Gumbel) argmax
  const bool by_argmax = greedy || CoupledOf(a, r);
  if (by_argmax && c > 0) return;  // no residual sweep: block 0 decides alone
  const float inv_t = greedy ? 1.f : 1.f / tf;
  const double td = greedy ? 1.0 : static_cast<double>(tf);
  const PhiloxKey key = KeyOf(a, r);
  const RowStat* st = a.stats + static_cast<int64_t>(r) * G1 * a.C;
  const T* target = static_cast<const T*>(a.target);
  const D* draft = static_cast<const D*>(a.draft_logits);

  // Every row's merged partials and acceptance test at once (warp = row), so the sequential
  // part below is arithmetic on shared memory. Every block of the request computes the same.
  for (int k = warp; k <= ell; k += kWarps) {
    ArgMax am;
    LogSumExp lse;
    const int bad = WarpMergeRow(st + k * a.C, a.C, inv_t, am, lse);
    if (lane == 0) {
      bad_s[k] = (bad & kTargetBad) != 0 || !(bad & kAllowed);  // NaN / +inf, or nothing allowed
      unsigned char qbad = 0;
      arg_s[k] = am.idx;
      m_row[k] = lse.m;
      logs_row[k] = static_cast<float>(log(lse.s));
      lse_row[k] = lse.Value(td);
      unsigned char ok = 0;
      if (k < ell) {
        const int64_t dk = static_cast<int64_t>(r) * a.gamma + k;
        const int64_t x = a.draft_tokens[dk];
        if (by_argmax) {
          ok = x == am.idx;
        } else {
          // q not finite: rejected in full (ok stays 0), the residual below is P itself
          qbad = (bad & kDraftBad) || !(fabs(static_cast<double>(a.draft_lse[dk])) < kInfD);
          if (!qbad && x >= 0 && x < a.V) {
            // P'(x) = 0 where the grammar forbids x: then u q < P' fails, a rejection
            const double P = TokenAllowed(MaskRow(a, lo + k), x)
                ? exp(static_cast<double>(ToFloat(target[static_cast<int64_t>(lo + k) * a.V + x])) / td - lse_row[k])
                : 0.0;
            const double q = exp(static_cast<double>(ToFloat(draft[dk * a.V + x])) / td - static_cast<double>(a.draft_lse[dk]));
            const double u = WordToUniform(PhiloxWord(key, kPurposeAccept, static_cast<uint32_t>(k + 1), 0));
            ok = u * q < P;
          }
        }
      }
      ok_s[k] = ok;
      qbad_s[k] = qbad;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int acc = 0;
    while (acc < ell && ok_s[acc]) ++acc;
    const bool rejected = !by_argmax && acc < ell;
    a_s = acc;
    y_s = arg_s[acc];  // greedy / coupled: (Gumbel) argmax of row acc; sampled: the bonus argmax
    rejected_s = rejected;
  }
  __syncthreads();
  const int acc = a_s, rejected = rejected_s;
  if (c == 0) {
    for (int j = threadIdx.x; j < G1; j += kThreads) {
      int64_t tok = -1;
      if (j < acc) tok = a.draft_tokens[static_cast<int64_t>(r) * a.gamma + j];
      if (j == acc && !rejected) tok = y_s;
      a.out_tokens[static_cast<int64_t>(r) * G1 + j] = tok;
    }
    if (threadIdx.x == 0) {
      a.num_accepted[r] = acc;
      unsigned char failed = 0;
      for (int k = 0; k <= ell; ++k) failed |= bad_s[k];
      a.failed[r] = failed;
    }
  }
  if (!rejected) return;

  // Residual Gumbel-max over this block's chunk of row `acc`:
  //   score_v = log(max(0, P_v - q_v)) + gumbel(emit, acc + 1, v).
  // A float upper bound of P - q decides which entries need the exact double evaluation (the
  // few that can still reach the running best). NOTE: the bound must hold at every scale. The
  // float exponents a = (x - m) / T - c are differences of terms as large as |x - m| / T and
  // |c| (thousands at T = 0.01 with a draft maximum far above the target's), each rounded to
  // float, so their absolute error grows with those terms: ErrBound below is 2^-21 (|a1| + |c|
  // + 1), eight half-ulps of the largest terms plus __expf's own ~2^-22 relative error, and
  // the relative error of exp(a) is at most e^err - 1 <= 2 err. A flat 1e-4 margin (the old
  // bound) is exceeded below T ~ 0.03 and pruned tokens whose residual is positive.
  const double lse_t = lse_row[acc];
  const float m_t = m_row[acc], log_s = logs_row[acc];
  const int64_t dk = static_cast<int64_t>(r) * a.gamma + acc;
  const double ld = static_cast<double>(a.draft_lse[dk]);
  const bool q0 = qbad_s[acc];  // q treated as 0: every q term below is 0
  const float cq = static_cast<float>(ld - static_cast<double>(m_t) / td);  // q = exp((z - m_t) / T - cq)
  const T* trow = target + static_cast<int64_t>(lo + acc) * a.V;
  const D* drow = draft + dk * a.V;
  const uint32_t pos = static_cast<uint32_t>(acc + 1);
  const int32_t* tmask = MaskRow(a, lo + acc);
  const int v_end = min(a.V, (c + 1) * kChunk);
  ArgMax am;
  am.Init();
  float best_f = -kInfF;
  for (int v = c * kChunk + threadIdx.x * 4; v < v_end; v += kThreads * 4) {
    const int nvalid = min(4, v_end - v);
    const float4 x4 = MaskQuad(LoadQuad(trow, v, nvalid, a.vec_t), tmask, v);
    const float4 z4 = LoadQuad(drow, v, nvalid, a.vec_d);
    const float xs[4] = {x4.x, x4.y, x4.z, x4.w}, zs[4] = {z4.x, z4.y, z4.z, z4.w};
    float ub[4];  // upper bounds of log(P - q); -inf: certainly zero residual
    float ub_max = -kInfF;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float ap = (xs[j] - m_t) * inv_t, aq = (zs[j] - m_t) * inv_t;
      const float pf = __expf(ap - log_s);
      const float qf = q0 ? 0.f : __expf(aq - cq);
      // P <= pf (1 + 2 ep) and q >= qf (1 - eq); 1e-4 covers the rounding of diff itself.
      const float ep = ErrBound(ap, log_s), eq = q0 ? 0.f : ErrBound(aq, cq);
      float diff = (pf - qf) + (1e-4f + 2.f * ep) * pf + (1e-4f + eq) * qf;
      // pf flushed to 0 leaves P below ~2^-125: bound the residual by 2^-124 instead of 0.
      if (pf == 0.f) diff = fmaxf(diff, 4.7e-38f);
      ub[j] = (j < nvalid && diff > 0.f) ? __logf(diff) : -kInfF;
      // NaN inputs give NaN diff: leave them to the exact path while nothing finite was seen.
      if (j < nvalid && diff != diff) ub[j] = kInfF;
      ub_max = fmaxf(ub_max, ub[j]);
    }
    if (best_f != -kInfF && ub_max + kGumbelMax + 1e-3f < best_f) continue;
    const uint4 w4 = PhiloxQuad(key, kPurposeEmit, pos, static_cast<uint32_t>(v) >> 2);
    const uint32_t ws[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j >= nvalid) continue;
      if (ub[j] == -kInfF && best_f != -kInfF) continue;
      const float sf = ub[j] + GumbelApprox(ws[j]);
      if (sf + ScoreMargin(sf) < best_f) continue;
      const double P = exp(static_cast<double>(xs[j]) / td - lse_t);
      const double q = q0 ? 0.0 : exp(static_cast<double>(zs[j]) / td - ld);
      const double res = P - q;
      am.Offer(res > 0.0 ? log(res) + GumbelExact(ws[j]) : -kInfD, v + j);
      best_f = fmaxf(best_f, static_cast<float>(am.best));
    }
  }
  LogSumExp unused;
  unused.Init();
  BlockMerge(am, unused, 1.f);
  // The last of the request's C blocks to get here merges every chunk's partial into y.
  // NOTE: the fence orders this block's partial before its ticket; the merging block reads the
  // partials through L2 (ld.cg), never a stale L1 line.
  __shared__ bool last_s;
  if (threadIdx.x == 0) {
    a.resid[static_cast<int64_t>(r) * a.C + c] = RowStat{am.best, am.idx, -kInfF, 0.0, 0};
    __threadfence();
    last_s = atomicAdd(&a.tickets[r], 1) == a.C - 1;
  }
  __syncthreads();
  if (!last_s || warp != 0) return;
  __threadfence();
  ArgMax y;
  y.Init();
  const RowStat* rs = a.resid + static_cast<int64_t>(r) * a.C;
  for (int cc = lane; cc < a.C; cc += 32) y.Merge(ArgMax{__ldcg(&rs[cc].best), __ldcg(&rs[cc].idx)});
  y.WarpMerge();
  if (lane == 0) a.out_tokens[static_cast<int64_t>(r) * G1 + acc] = y.idx < a.V ? y.idx : 0;
}

// T: the target logits' element type, D: the draft logits' (T, or float under 16-bit T).
template <class T, class D>
Status Launch(const RejectionSampleParams& p, cudaStream_t stream) {
  Args a{};
  a.target = p.target_logits;
  a.cu_rows = p.cu_rows;
  a.draft_tokens = p.draft_tokens;
  a.draft_logits = p.draft_logits;
  a.draft_lse = static_cast<const float*>(p.draft_lse);
  a.temperature = p.temperature;
  a.seed = p.seed;
  a.stream = p.stream;
  a.round = p.round;
  a.coupled = p.coupled;
  a.mask = p.token_bitmask;
  a.words = static_cast<int>(CeilDiv(p.V, 32));
  a.num_accepted = p.num_accepted;
  a.out_tokens = p.out_tokens;
  a.failed = p.failed;
  a.R = static_cast<int>(p.R);
  a.gamma = static_cast<int>(p.gamma);
  a.V = static_cast<int>(p.V);
  a.C = static_cast<int>(CeilDiv(p.V, kChunk));
  a.vec_t = p.V % 4 == 0 && Aligned(p.target_logits, 4 * sizeof(T));
  a.vec_d = p.V % 4 == 0 && (p.gamma == 0 || Aligned(p.draft_logits, 4 * sizeof(D)));
  // 16-byte loads: every row start (base + k V elements) on a 16-byte boundary
  a.v16_t = p.V * sizeof(T) % 16 == 0 && Aligned(p.target_logits, 16);
  a.v16_d = p.V * sizeof(D) % 16 == 0 && (p.gamma == 0 || Aligned(p.draft_logits, 16));
  Scratch scratch(stream);
  Status st;
  if ((st = scratch.Get(static_cast<size_t>(a.R) * (a.gamma + 1) * a.C, &a.stats)) != Status::kOk) return st;
  if ((st = scratch.Get(static_cast<size_t>(a.R) * a.C, &a.resid)) != Status::kOk) return st;
  if ((st = scratch.Get(static_cast<size_t>(a.R), &a.tickets)) != Status::kOk) return st;
  RowStatsKernel<T, D><<<dim3(a.R * (a.gamma + 1), a.C), kThreads, 0, stream>>>(a);
  if ((st = LaunchStatus()) != Status::kOk) return st;
  DecideKernel<T, D><<<dim3(a.R, a.C), kThreads, 0, stream>>>(a);
  return LaunchStatus();
}

}  // namespace
}  // namespace dspark::cuda

namespace dspark {

Status RejectionSampleCuda(const RejectionSampleParams& p, void* stream) {
  using namespace dspark::cuda;
  if (p.R < 0 || p.gamma < 0 || p.V < 1) return Status::kBadArgument;
  if (p.R == 0) return Status::kOk;
  if (p.V > 65535ll * kChunk || p.R * (p.gamma + 1) > (1ll << 30)) return Status::kBadArgument;
  if (p.gamma + 1 > kMaxRows) return Status::kUnsupported;
  if (!p.target_logits || !p.cu_rows || !p.temperature || !p.seed || !p.stream || !p.round ||
      !p.num_accepted || !p.out_tokens || !p.failed) {
    return Status::kBadArgument;
  }
  if (p.gamma > 0 && (!p.draft_tokens || !p.draft_logits || !p.draft_lse)) return Status::kBadArgument;
  if (p.dtype != DType::kFloat64 && p.lse_dtype != DType::kFloat32) return Status::kBadArgument;
  const cudaStream_t stream_ = AsStream(stream);
  DeviceGuard guard(stream_);
  if (p.draft_dtype == p.dtype) {
    DSPARK_DISPATCH_FLOAT(p.dtype, return Launch<scalar_t, scalar_t>(p, stream_););
  } else if (p.draft_dtype == DType::kFloat32 && p.dtype == DType::kBFloat16) {
    return Launch<__nv_bfloat16, float>(p, stream_);
  } else if (p.draft_dtype == DType::kFloat32 && p.dtype == DType::kFloat16) {
    return Launch<__half, float>(p, stream_);
  }
  return Status::kUnsupported;
}

}  // namespace dspark
