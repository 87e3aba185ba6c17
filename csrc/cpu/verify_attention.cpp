// verify_attention on the CPU: ragged attention over a paged KV cache
// (reference.py::verify_attention).
//
// One work item per (request, KV head): its chain's n queries times the h_q / h_kv query heads
// that share the KV head form M query columns, so every key and value is read once per item,
// straight from its page (no copy of K or V): keys go in tiles of kTileKeys located through the
// block table, and only keys < kv_len are touched (slots past the end and pages the request
// does not own are never read). Per tile:
//   S^T[keys, M] = K Q^T (micro-GEMM, queries along SIMD lanes), scale and causal mask, online
//   softmax per query column (running max and denominator, O rescaled when the max grows),
//   O[M, head_dim] += P V (micro-GEMM); finally O / l.
// Arithmetic is in float32 (float64 for float64), like the reference's einsum/softmax: 16-bit
// q, K and V are widened as they are read (K and V tiles into float32 copies) and the output is
// rounded once. float32 exps use ExpF (below, ~1 ulp), so the result differs from the reference
// by summation order and last-ulp exps only.
//
// Row invariance (DESIGN §6): a query column's result does not depend on the other columns of
// its item (its chain's other rows, the other heads of its group). Key tiles are anchored to key
// 0, never to the chain; every per-column quantity (scores, running max and denominator, P V) is
// computed from that column's data alone in a fixed order; a tile wholly past a column's last
// key (or before its window) leaves it unchanged exactly: its max stays, the rescale factor is
// exp(0) = 1 and its P entries are 0. So a row computed in a chain of n equals the row computed
// alone as a chain of one with kv_len = its position + 1, bit for bit, in every dtype.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/kernel_util.h"
#include "verify_attention.h"

namespace dspark {
namespace {
using namespace cpu;

constexpr int64_t kTileKeys = 64;  // keys per tile; a multiple of kRows
constexpr int kRows = 4;           // micro-GEMM tile: kRows x kCols outputs kept in registers
constexpr int kCols = 16;          // one 64-byte vector of float32 (two of float64)

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// exp for float32 in plain arithmetic the compiler vectorises (std::exp is a libm call):
// 2^n * p(r) with n = round(x / ln 2), Cody-Waite r = x - n ln 2, and Cephes' degree-6
// polynomial (relative error ~1e-7, about one float32 ulp). exp(-inf) must not come from
// here (the clamp would give 2^-126): callers mask instead. NaN stays NaN.
DSPARK_ALWAYS_INLINE float ExpF(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
DSPARK_ALWAYS_INLINE float Exp(float x) { return ExpF(x); }
DSPARK_ALWAYS_INLINE double Exp(double x) { return ExpD(x); }

#if defined(__GNUC__)
// NOTE: GCC vector types: left to the auto-vectoriser, GCC vectorises the depth loop (strided
// loads, shuffles) instead of keeping the output tile in registers.
template <class T>
DSPARK_ALWAYS_INLINE void Load(Vec64<T>& v, const T* p) {
  std::memcpy(&v, p, 64);
}
template <class T>
DSPARK_ALWAYS_INLINE void Store(T* p, const Vec64<T>& v) {
  std::memcpy(p, &v, 64);
}

// C[kRows, kVecs 64-byte vectors] += A B over `depth`, where A(i, k) = a_rows[i][k * a_step]
// and B(k, :) = b_rows[k] + b_off (kRowPtrs) or b + k * ldb.
template <class T, int kVecs, bool kRowPtrs>
DSPARK_ALWAYS_INLINE void MicroGemm(int64_t depth, const T* const* a_rows, int64_t a_step,
                                    const T* const* b_rows, const T* b, int64_t ldb,
                                    int64_t b_off, T* C, int64_t ldc) {
  constexpr int kLanes = 64 / sizeof(T);
  Vec64<T> acc[kRows][kVecs];
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v) Load(acc[i][v], C + i * ldc + v * kLanes);
  for (int64_t k = 0; k < depth; ++k) {
    const T* brow = kRowPtrs ? b_rows[k] + b_off : b + k * ldb;
    Vec64<T> bv[kVecs];
    for (int v = 0; v < kVecs; ++v) Load(bv[v], brow + v * kLanes);
    for (int i = 0; i < kRows; ++i) {
      const T a = a_rows[i][k * a_step];
      for (int v = 0; v < kVecs; ++v) acc[i][v] += a * bv[v];
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < kVecs; ++v) Store(C + i * ldc + v * kLanes, acc[i][v]);
}
#else
template <class T, int kVecs, bool kRowPtrs>
DSPARK_ALWAYS_INLINE void MicroGemm(int64_t depth, const T* const* a_rows, int64_t a_step,
                                    const T* const* b_rows, const T* b, int64_t ldb,
                                    int64_t b_off, T* C, int64_t ldc) {
  constexpr int kWidth = kVecs * 64 / sizeof(T);
  for (int64_t k = 0; k < depth; ++k) {
    const T* brow = kRowPtrs ? b_rows[k] + b_off : b + k * ldb;
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kWidth; ++j) C[i * ldc + j] += a_rows[i][k * a_step] * brow[j];
  }
}
#endif

// S: the element type of q, the caches and out; T: the arithmetic type.
template <class S, class T>
DSPARK_ALWAYS_INLINE void ItemImpl(const VerifyAttentionParams& p, int64_t item) {
  constexpr bool kWiden = !std::is_same<S, T>::value;
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const int64_t r = item / p.h_kv, kvh = item % p.h_kv;
  const int64_t lo = p.cu_q[r], n = p.cu_q[r + 1] - lo, L = p.kv_lens[r];
  if (n == 0) return;
  const int64_t hd = p.head_dim, group = p.h_q / p.h_kv, ps = p.page_size;
  const int64_t M = n * group, Mp = RoundUp(M, kCols), hdp = RoundUp(hd, kCols);
  const S* q = static_cast<const S*>(p.q);
  const S* kc = static_cast<const S*>(p.k_cache);
  const S* vc = static_cast<const S*>(p.v_cache);
  const int32_t* table = p.block_tables + r * p.max_pages;
  const T scale = static_cast<T>(p.scale);
  // V rows are read 64 bytes at a time: pad them in a copy (16-bit K and V: widened copies)
  const bool pad_v = kWiden || hd != hdp;

  // Query column m = i * group + g is chain entry i, query head kvh * group + g; padded
  // columns are zero and see no key.
  std::vector<T> Qt(hd * Mp, T(0)), St(kTileKeys * Mp), O(Mp * hdp, T(0)), zero(hdp, T(0));
  std::vector<T> Vpad(pad_v ? kTileKeys * hdp : 0, T(0)), Kwide(kWiden ? kTileKeys * hd : 0);
  std::vector<T> mrow(Mp, kNegInf), lrow(Mp, T(0)), m_new(Mp), corr(Mp);
  std::vector<int64_t> last(Mp, -1);  // the last key column m may see
  std::vector<int64_t> first(Mp, 0);  // the first (a sliding window's lower edge)
  int64_t t_begin = L;                // the first key any column sees
  for (int64_t m = 0; m < M; ++m) {
    const int64_t i = m / group, h = kvh * group + m % group;
    const S* src = q + ((lo + i) * p.h_q + h) * hd;
    for (int64_t c = 0; c < hd; ++c) Qt[c * Mp + m] = Widen(src[c]);
    const int64_t pos = L - n + i;
    last[m] = p.causal ? pos : L - 1;
    if (p.window > 0) {
      first[m] = std::max<int64_t>(0, pos - p.window + 1);
      if (!p.causal) last[m] = std::min(last[m], pos + p.window - 1);
    }
    t_begin = std::min(t_begin, first[m]);
  }
  t_begin -= t_begin % kTileKeys;  // tiles wholly before every window are skipped
  const T* k_rows[kTileKeys];
  const T* v_rows[kTileKeys];
  const T* p_rows[kRows];

  for (int64_t t0 = t_begin; t0 < L; t0 += kTileKeys) {
    const int64_t nk = std::min(kTileKeys, L - t0), nkp = RoundUp(nk, kRows);
    for (int64_t t = 0; t < nkp; ++t) {
      if (t >= nk) {
        k_rows[t] = zero.data();
        continue;
      }
      const int64_t l = t0 + t;
      const int64_t slot = (int64_t{table[l / ps]} * ps + l % ps) * p.h_kv + kvh;
      const S* krow = kc + slot * hd;
      const S* vrow = vc + slot * hd;
      if constexpr (kWiden) {
        T* kw = Kwide.data() + t * hd;
        for (int64_t c = 0; c < hd; ++c) kw[c] = Widen(krow[c]);
        k_rows[t] = kw;
      } else {
        k_rows[t] = krow;
      }
      if (pad_v) {
        T* vp = Vpad.data() + t * hdp;
        for (int64_t c = 0; c < hd; ++c) vp[c] = Widen(vrow[c]);
        v_rows[t] = vp;
      } else {
        v_rows[t] = reinterpret_cast<const T*>(vrow);  // S == T here
      }
    }
    // S^T = K Q^T
    std::fill(St.begin(), St.begin() + nkp * Mp, T(0));
    for (int64_t t = 0; t < nkp; t += kRows)
      for (int64_t c = 0; c < Mp; c += kCols)
        MicroGemm<T, kCols * sizeof(T) / 64, false>(hd, k_rows + t, 1, nullptr, Qt.data() + c, Mp,
                                                    0, St.data() + t * Mp + c, Mp);
    // Scale, mask, tile max per column.
    for (int64_t m = 0; m < Mp; ++m) m_new[m] = mrow[m];
    for (int64_t t = 0; t < nk; ++t) {
      T* s = St.data() + t * Mp;
      for (int64_t m = 0; m < Mp; ++m) {
        const T v = t0 + t <= last[m] && t0 + t >= first[m] ? s[m] * scale : kNegInf;
        s[m] = v;
        m_new[m] = v > m_new[m] ? v : m_new[m];
      }
    }
    for (int64_t m = 0; m < Mp; ++m) {  // exact exp: also gives 0 for a first max of -inf
      corr[m] = m_new[m] == kNegInf ? T(1) : std::exp(mrow[m] - m_new[m]);
      mrow[m] = m_new[m];
      lrow[m] *= corr[m];
    }
    // P = exp(S - max) with masked entries exactly 0; accumulate the denominators.
    for (int64_t t = 0; t < nk; ++t) {
      T* s = St.data() + t * Mp;
      for (int64_t m = 0; m < Mp; ++m) {
        const T e = Exp(s[m] - m_new[m]);
        s[m] = s[m] == kNegInf ? T(0) : e;
        lrow[m] += s[m];
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      T* o = O.data() + m * hdp;
      for (int64_t c = 0; c < hd; ++c) o[c] *= corr[m];
    }
    // O += P V: A(m, t) = St[t * Mp + m].
    for (int64_t m = 0; m < M; m += kRows) {
      for (int i = 0; i < kRows; ++i) p_rows[i] = St.data() + m + i;
      int64_t c = 0;
      for (; c + 2 * kCols <= hdp; c += 2 * kCols)  // two column blocks at once: fewer loads
        MicroGemm<T, 2 * kCols * sizeof(T) / 64, true>(nk, p_rows, Mp, v_rows, nullptr, 0, c,
                                                       O.data() + m * hdp + c, hdp);
      for (; c < hdp; c += kCols)
        MicroGemm<T, kCols * sizeof(T) / 64, true>(nk, p_rows, Mp, v_rows, nullptr, 0, c,
                                                   O.data() + m * hdp + c, hdp);
    }
  }

  S* out = static_cast<S*>(p.out);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t i = m / group, h = kvh * group + m % group;
    S* dst = out + ((lo + i) * p.h_q + h) * hd;
    const T inv = T(1) / lrow[m];
    for (int64_t c = 0; c < hd; ++c) Narrow(O[m * hdp + c] * inv, dst + c);
  }
}
DSPARK_CPU_CLONES void Item32(const VerifyAttentionParams& p, int64_t item) {
  ItemImpl<float, float>(p, item);
}
DSPARK_CPU_CLONES void Item64(const VerifyAttentionParams& p, int64_t item) {
  ItemImpl<double, double>(p, item);
}
DSPARK_CPU_CLONES void ItemBf16(const VerifyAttentionParams& p, int64_t item) {
  ItemImpl<Bf16, float>(p, item);
}
DSPARK_CPU_CLONES void ItemF16(const VerifyAttentionParams& p, int64_t item) {
  ItemImpl<F16, float>(p, item);
}

Status Validate(const VerifyAttentionParams& p) {
  if (p.R < 0 || p.h_q < 0 || p.h_kv < 0 || p.head_dim < 0 || p.page_size < 0 ||
      p.num_pages < 0 || p.max_pages < 0 || p.window < 0) {
    return Status::kBadArgument;
  }

  if (p.R == 0) return Status::kOk;
  if (!p.cu_q || !p.kv_lens || p.cu_q[0] != 0) return Status::kBadArgument;
  int64_t N = 0;
  for (int64_t r = 0; r < p.R; ++r) {
    const int64_t n = int64_t{p.cu_q[r + 1]} - p.cu_q[r];
    if (n < 0 || p.kv_lens[r] < n) return Status::kBadArgument;
    N += n;
  }
  if (N == 0 || p.h_q == 0) return Status::kOk;  // empty chains only: nothing is read
  if (p.h_kv < 1 || p.h_q % p.h_kv != 0 || p.head_dim < 1 || p.page_size < 1 || !p.q ||
      !p.k_cache || !p.v_cache || !p.block_tables || !p.out) {
    return Status::kBadArgument;
  }
  for (int64_t r = 0; r < p.R; ++r) {
    const int64_t L = p.kv_lens[r];
    if (L > p.max_pages * p.page_size) return Status::kBadArgument;
    if (p.cu_q[r + 1] == p.cu_q[r]) continue;  // an empty chain reads no page
    for (int64_t pg = 0; pg < (L + p.page_size - 1) / p.page_size; ++pg) {
      const int32_t page = p.block_tables[r * p.max_pages + pg];
      if (page < 0 || page >= p.num_pages) return Status::kBadArgument;
    }
  }
  return Status::kOk;
}

}  // namespace

Status VerifyAttentionCpu(const VerifyAttentionParams& p) {
  const Status s = Validate(p);
  if (s != Status::kOk || p.R == 0 || p.h_q == 0 || p.cu_q[p.R] == 0) return s;
  const int64_t items = p.R * p.h_kv;
  int64_t macs = 0;  // fan out only when the work dwarfs a fork/join (a few microseconds)
  for (int64_t r = 0; r < p.R; ++r) macs += int64_t{p.cu_q[r + 1] - p.cu_q[r]} * p.kv_lens[r];
  const bool par = macs * p.h_q * p.head_dim > (1 << 18);
  switch (p.dtype) {
    case DType::kFloat64: ParallelFor(items, par, [&](int64_t i) { Item64(p, i); }); break;
    case DType::kBFloat16: ParallelFor(items, par, [&](int64_t i) { ItemBf16(p, i); }); break;
    case DType::kFloat16: ParallelFor(items, par, [&](int64_t i) { ItemF16(p, i); }); break;
    default: ParallelFor(items, par, [&](int64_t i) { Item32(p, i); }); break;
  }
  return Status::kOk;
}

}  // namespace dspark
