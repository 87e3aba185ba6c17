// Pieces the C++ CPU kernels share: a thread-count-independent parallel loop, ISA clones for
// hot loops, lane-split dot products, log-sum-exp / argmax partials that merge in a fixed
// order, and the exact-but-pruned Gumbel-max scan over a Philox stream.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common.h"
#include "philox.h"

namespace dspark::cpu {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Hot loops are compiled for AVX-512, AVX2+FMA and baseline x86-64 and picked at load time
// (GCC function multiversioning), so the extension stays portable without -march=native.
// NOTE: a cloned function must only call always-inline helpers to benefit.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define DSPARK_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DSPARK_CPU_CLONES
#endif
#define DSPARK_ALWAYS_INLINE inline __attribute__((always_inline))

// fn(i) for i in [0, n). Every i is independent work, so results do not depend on the number
// of threads; OpenMP (when the build found it) only changes who runs which i.
template <class F>
void ParallelFor(int64_t n, bool parallel, const F& fn) {
#ifdef _OPENMP
  if (parallel && n > 1) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) fn(i);
}

// bfloat16 (raw bits) -> float, exact.
DSPARK_ALWAYS_INLINE float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// x rounded to the nearest bfloat16 (ties to even, as torch rounds), returned as a float.
DSPARK_ALWAYS_INLINE float RoundToBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;  // NaN stays NaN
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// A weight element in the arithmetic type: itself, or bfloat16 bits widened (exact).
DSPARK_ALWAYS_INLINE float Widen(float x) { return x; }
DSPARK_ALWAYS_INLINE double Widen(double x) { return x; }
DSPARK_ALWAYS_INLINE float Widen(uint16_t b) { return Bf16ToFloat(b); }

// 16-bit storage types of kernels that take 16-bit tensors and compute in float32 (linear,
// verify_attention): distinct types, so overloads pick the right widening.
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
DSPARK_ALWAYS_INLINE float Widen(Bf16 v) { return Bf16ToFloat(v.bits); }
DSPARK_ALWAYS_INLINE float Widen(F16 v) {
  _Float16 h;
  std::memcpy(&h, &v.bits, 2);
  return static_cast<float>(h);
}

// The arithmetic result stored as the element type, rounded to nearest even (as torch casts).
DSPARK_ALWAYS_INLINE void Narrow(float a, float* o) { *o = a; }
DSPARK_ALWAYS_INLINE void Narrow(double a, double* o) { *o = a; }
DSPARK_ALWAYS_INLINE void Narrow(float a, Bf16* o) {
  const float r = RoundToBf16(a);
  uint32_t u;
  std::memcpy(&u, &r, 4);
  o->bits = static_cast<uint16_t>(u >> 16);
}
DSPARK_ALWAYS_INLINE void Narrow(float a, F16* o) {
  const _Float16 h = static_cast<_Float16>(a);
  std::memcpy(&o->bits, &h, 2);
}

// dot(a, b) accumulated in T over kLanes independent partial sums (lets the compiler use SIMD
// without -ffast-math), then summed pairwise. Same result for the same n on every call.
// a may be bfloat16 bits under float b (widened on load).
template <class W, class T>
DSPARK_ALWAYS_INLINE T Dot(const W* a, const T* b, int64_t n) {
  constexpr int kLanes = 16;
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += Widen(a[i + j]) * b[i + j];
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += Widen(a[i]) * b[i];
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  }
  return acc[0];
}

// out[r] = dot(w + r * ld, u) for the 8 rows r < 8, each of length n. Accumulates one 64-byte
// vector per row and folds the 8 vectors together with shuffles (3 ops per dot instead of a
// full horizontal sum each): the w2 sweep of markov_sample is this loop.
#if defined(__GNUC__)
typedef float Vec64F __attribute__((vector_size(64), aligned(4)));  // unaligned loads are fine
typedef double Vec64D __attribute__((vector_size(64), aligned(8)));
typedef int32_t Mask64F __attribute__((vector_size(64)));
typedef int64_t Mask64D __attribute__((vector_size(64)));
template <class T>
struct Vec64Of;
template <>
struct Vec64Of<float> {
  typedef Vec64F type;
};
template <>
struct Vec64Of<double> {
  typedef Vec64D type;
};
template <class T>
using Vec64 = typename Vec64Of<T>::type;  // 16 floats or 8 doubles

// out = lane-pair sums of a, then of b (by reference: vector returns would change the ABI).
template <class V, class M, int L>
DSPARK_ALWAYS_INLINE void FoldPairs(const V& a, const V& b, V& out) {
  M even, odd;
  for (int l = 0; l < L; ++l) {
    even[l] = 2 * l;
    odd[l] = 2 * l + 1;
  }
  out = __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

// One vector of weights: 64 bytes of T, or 16 bfloat16 (32 bytes) widened to 16 floats in
// registers, so a bfloat16 matrix is streamed at 2 bytes per element.
typedef uint16_t Vec32U16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t Vec64U32 __attribute__((vector_size(64)));
DSPARK_ALWAYS_INLINE void LoadVec(const float* p, Vec64F& v) { std::memcpy(&v, p, 64); }
DSPARK_ALWAYS_INLINE void LoadVec(const double* p, Vec64D& v) { std::memcpy(&v, p, 64); }
DSPARK_ALWAYS_INLINE void LoadVec(const uint16_t* p, Vec64F& v) {
  Vec32U16 h;
  std::memcpy(&h, p, 32);
  const Vec64U32 x = __builtin_convertvector(h, Vec64U32) << 16;
  std::memcpy(&v, &x, 64);
}

template <class T, class V, class M, class W>
DSPARK_ALWAYS_INLINE void DotRows8Vec(const W* w, int64_t ld, const T* u, int64_t n, T out[8]) {
  constexpr int L = 64 / sizeof(T);
  V acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = V{};
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    V uv, wv;
    std::memcpy(&uv, u + i, 64);
    for (int r = 0; r < 8; ++r) {
      LoadVec(w + r * ld + i, wv);
      acc[r] += wv * uv;
    }
  }
  // Fold: 8 vectors of L lanes -> one vector whose first 8 lanes are the 8 row sums.
  V c[4], d[2], e;
  for (int k = 0; k < 4; ++k) FoldPairs<V, M, L>(acc[2 * k], acc[2 * k + 1], c[k]);
  for (int k = 0; k < 2; ++k) FoldPairs<V, M, L>(c[2 * k], c[2 * k + 1], d[k]);
  FoldPairs<V, M, L>(d[0], d[1], e);
  if (L == 16) FoldPairs<V, M, L>(V(e), V(e), e);  // float: one more fold of 2 lanes per row
  for (int r = 0; r < 8; ++r) {
    T tail = 0;
    for (int64_t k = i; k < n; ++k) tail += Widen(w[r * ld + k]) * u[k];
    out[r] = e[r] + tail;
  }
}

DSPARK_ALWAYS_INLINE void DotRows8(const float* w, int64_t ld, const float* u, int64_t n,
                                   float out[8]) {
  DotRows8Vec<float, Vec64F, Mask64F>(w, ld, u, n, out);
}
DSPARK_ALWAYS_INLINE void DotRows8(const double* w, int64_t ld, const double* u, int64_t n,
                                   double out[8]) {
  DotRows8Vec<double, Vec64D, Mask64D>(w, ld, u, n, out);
}
DSPARK_ALWAYS_INLINE void DotRows8(const uint16_t* w, int64_t ld, const float* u, int64_t n,
                                   float out[8]) {
  DotRows8Vec<float, Vec64F, Mask64F>(w, ld, u, n, out);
}
#else
template <class W, class T>
DSPARK_ALWAYS_INLINE void DotRows8(const W* w, int64_t ld, const T* u, int64_t n, T out[8]) {
  for (int r = 0; r < 8; ++r) out[r] = Dot(w + r * ld, u, n);
}
#endif

// The logistic function in T (float32 heads stay in float32, as the reference computes them).
template <class T>
DSPARK_ALWAYS_INLINE T Sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// log-sum-exp partial of a fixed slice: m = max, s = sum exp(x - m). Slices merge in a fixed
// order, so the value is independent of the thread count. Semantics of torch.logsumexp:
// NaN anywhere -> NaN, +inf -> +inf, all -inf (or empty) -> -inf.
struct LsePart {
  double m = -kInf;
  double s = 0.0;
  bool nan = false;

  void Merge(const LsePart& o) {
    nan |= o.nan;
    if (o.m == -kInf) return;
    if (m == -kInf || o.m == kInf) {
      if (m != kInf) {
        s = (m == -kInf) ? o.s : o.s + s * std::exp(m - o.m);
        m = o.m;
      }
      return;
    }
    if (m == kInf) return;
    if (o.m > m) {
      s = s * std::exp(m - o.m) + o.s;
      m = o.m;
    } else {
      s += o.s * std::exp(o.m - m);
    }
  }
  double Value() const {
    if (nan) return std::numeric_limits<double>::quiet_NaN();
    if (m == kInf || m == -kInf) return m;
    return m + std::log(s);
  }
};

// Largest x of a slice; NaN never wins; ties keep the earlier (lower) index. idx < 0: nothing
// above -inf was seen, which _first_argmax resolves to index 0 (all entries equal -inf).
struct ArgPart {
  double best = -kInf;
  int64_t idx = -1;

  DSPARK_ALWAYS_INLINE void Offer(double x, int64_t i) {
    if (x > best) {
      best = x;
      idx = i;
    }
  }
  // o covers later indices than *this.
  void Merge(const ArgPart& o) {
    if (o.idx >= 0 && (idx < 0 || o.best > best)) *this = o;
  }
  int64_t Index() const { return idx < 0 ? 0 : idx; }
};

// exp(x) in plain arithmetic the compiler vectorises (std::exp is a libm call, ~10 ns here):
// 2^n e^r with n = round(x / ln 2) by the 1.5 * 2^52 trick (its low bits are n, so no
// double -> int64 conversion is needed), Cody-Waite r = x - n ln 2 (|r| <= 0.35) and Taylor to
// r^13 (truncation < 2^-57). A couple of ulps, against torch's exp: scores that decide tokens
// are unaffected except at float ties. x < -708 gives 0 (no subnormals), x > 709.78 gives inf,
// NaN stays NaN.
DSPARK_ALWAYS_INLINE double ExpD(double x) {
  constexpr double kShift = 6755399441055744.0;  // 1.5 * 2^52
  const double xc = x < -708.0 ? -708.0 : (x > 709.0 ? 709.0 : x);
  const double t = xc * 1.4426950408889634 + kShift;
  const double n = t - kShift;
  const double r = (xc - n * 0.693147180369123816490) - n * 1.90821492927058770002e-10;
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  int64_t bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits - 0x4338000000000000LL + 1023) << 52;  // n + bias in the exponent field
  double scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const double e = p * scale;
  return x < -708.0 ? 0.0 : (x > 709.78 ? kInf : e);
}

// x[j] for j < n into an LsePart, with w[j] = exp(x[j] - part.m) kept for the Gumbel scan.
// Max and sum run over kLanes partial lanes (vectorisable without -ffast-math), combined in a
// fixed order.
DSPARK_ALWAYS_INLINE LsePart LseSlice(const double* x, int64_t n, double* w) {
  constexpr int kLanes = 8;
  LsePart p;
  double lane_mx[kLanes];
  bool lane_nan[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    lane_mx[l] = -kInf;
    lane_nan[l] = false;
  }
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double v = x[j + l];
      lane_nan[l] |= v != v;
      lane_mx[l] = v > lane_mx[l] ? v : lane_mx[l];
    }
  }
  for (int l = 0; j < n; ++j, ++l) {
    lane_nan[l] |= x[j] != x[j];
    lane_mx[l] = x[j] > lane_mx[l] ? x[j] : lane_mx[l];
  }
  double mx = -kInf;
  for (int l = 0; l < kLanes; ++l) {
    p.nan |= lane_nan[l];
    mx = lane_mx[l] > mx ? lane_mx[l] : mx;
  }
  p.m = mx;
  if (mx == kInf || mx == -kInf) {
    // Degenerate slice: weights only steer the Gumbel pruning; NaN weights disable it.
    for (int64_t i = 0; i < n; ++i) w[i] = std::numeric_limits<double>::quiet_NaN();
    return p;
  }
  for (int64_t i = 0; i < n; ++i) w[i] = ExpD(x[i] - mx);
  double lane_s[kLanes] = {};
  j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lane_s[l] += w[j + l];
  }
  for (int l = 0; j < n; ++j, ++l) lane_s[l] += w[j];
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int l = 0; l < width; ++l) lane_s[l] += lane_s[l + width];
  }
  p.s = lane_s[0];
  return p;
}

// The four Philox words of block b (indices 4b .. 4b+3) of one (purpose, position): the
// counter layout of PhiloxWord in philox.h.
DSPARK_ALWAYS_INLINE void PhiloxBlock(const PhiloxKey& key, uint32_t purpose, uint32_t position,
                                      uint64_t block, uint32_t out[4]) {
  out[0] = static_cast<uint32_t>(block);
  out[1] = position | (purpose << 16);
  out[2] = key.round;
  out[3] = key.stream;
  Philox4x32x10(out, static_cast<uint32_t>(key.seed), static_cast<uint32_t>(key.seed >> 32));
}

// argmax over j of logit(j) + gumbel(v0 + j) for j < n, merged into `arg`, where
// w[j] = exp(logit(j) - c). Same outcome as scoring every index, but the two logs of a Gumbel
// are taken only where the score can beat the best B so far:
//   logit + g > B  <=>  -log u < exp(logit - B) = w * exp(c - B) =: E,
// and u <= 1 - E implies -log u >= E, so such a u cannot win. The factor 1.001 (1e-3 in score
// units) covers every rounding in E and in the scores. Corner cases stay exact: while B = -inf
// or for NaN/inf weights the test is false (exact score); when 1 - 1.001 E rounds to 1, E is
// below 2^-25 <= -log u for every u; an underflowed w with a finite factor means
// logit - B < -745 + 710, where no u can win either. v0 must be a multiple of 4.
template <class LogitFn>
DSPARK_ALWAYS_INLINE void GumbelArgmax(const PhiloxKey& key, uint32_t purpose, uint32_t position,
                                       int64_t v0, int64_t n, const double* w, double c,
                                       const LogitFn& logit, ArgPart& arg) {
  double factor = std::exp(c - arg.best);  // +inf while nothing has been seen
  uint32_t words[4];
  for (int64_t j0 = 0; j0 < n; j0 += 4) {
    PhiloxBlock(key, purpose, position, static_cast<uint64_t>(v0 + j0) >> 2, words);
    const int64_t m = n - j0 < 4 ? n - j0 : 4;
    for (int64_t t = 0; t < m; ++t) {
      const int64_t j = j0 + t;
      const double u = WordToUniform(words[t]);
      if (u <= 1.0 - 1.001 * (w[j] * factor)) continue;
      const double score = logit(j) + -std::log(-std::log(u));
      if (score > arg.best) {
        arg.best = score;
        arg.idx = v0 + j;
        factor = std::exp(c - arg.best);
      }
    }
  }
}

}  // namespace dspark::cpu
