// linear on the CPU: out = x w^T with one fixed reduction order per output element
// (reference.py::linear; the row-invariance contract is in linear.h).
//
// Order. out[m, n] is the dot of x row m and w row n along K, accumulated in kLanes = 8
// interleaved partial sums (lane j takes k = j, j + 8, j + 16, ... in order; the K tail enters as
// zeros), then the 8 lanes summed by one fixed tree. Nothing in that sequence depends on M, on
// the tile a row falls in or on the thread count, so a row gives the same bits alone or in any
// company. (torch's float32 linear does not: MKL takes a GEMV for one row and other blockings
// for two or three; see DESIGN §6.)
//
// Tiling. Rows of x are widened once into a zero-padded float32 block Xp [Mb, Kp] (float64 for
// float64); weights are read in place, kNr rows at a time, 16-bit ones widened in registers, so
// a weight byte is read once per row block: a decode-sized call streams the weights once. The
// micro-kernel keeps kMr x kNr accumulators of 8 lanes in registers (AVX2: 12 of 16 ymm). Work
// is split over threads by weight rows only. With 16-bit weights and more than kMr rows (a
// verify of gamma + 1, a batch), kNr weight rows are widened once into a zero-padded float block
// and swept by 4 x 3 tiles (WideTask): widening in registers cost one conversion per kMr rows,
// which made 8 rows cost 4.6 one-row calls; now about 3 (AVX2 has no bf16 dot product, so 8
// rows are FMA-bound here: 8 N K FMAs against one pass over 2 N K bytes).
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/kernel_util.h"
#include "linear.h"

namespace dspark {
namespace {
using namespace cpu;

constexpr int kLanes = 8;
constexpr int kMr = 2;                 // rows of x per micro-tile
constexpr int kNr = 6;                 // rows of w per micro-tile
constexpr int64_t kNrPerTask = 16;     // micro-tiles of w per parallel task
constexpr int64_t kXBlockBytes = 192 << 10;  // Xp block kept in L2 across a task's weights

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <class A>
struct Lanes;
template <>
struct Lanes<float> {
  typedef float type __attribute__((vector_size(32), aligned(4), may_alias));
};
template <>
struct Lanes<double> {
  typedef double type __attribute__((vector_size(64), aligned(8), may_alias));
};
template <class A>
using VecA = typename Lanes<A>::type;  // kLanes accumulators of A
typedef uint16_t Vec8U16 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t Vec8U32 __attribute__((vector_size(32)));
typedef int32_t Vec8I32 __attribute__((vector_size(32)));

// kLanes elements of a weight row, widened to A (exact for every input type).
DSPARK_ALWAYS_INLINE void LoadW(const float* p, VecA<float>& v) {
  v = *reinterpret_cast<const VecA<float>*>(p);
}
DSPARK_ALWAYS_INLINE void LoadW(const double* p, VecA<double>& v) {
  v = *reinterpret_cast<const VecA<double>*>(p);
}
DSPARK_ALWAYS_INLINE void LoadW(const Bf16* p, VecA<float>& v) {
  Vec8U16 h;
  std::memcpy(&h, p, 16);
  const Vec8U32 u = __builtin_convertvector(h, Vec8U32) << 16;
  std::memcpy(&v, &u, 32);
}
// IEEE half -> float in integer arithmetic the compiler vectorises: exponent and mantissa
// shifted into place and rescaled by 2^112 (exact for normals and subnormals), inf / NaN
// rebuilt with an all-ones exponent, then the sign.
DSPARK_ALWAYS_INLINE void LoadW(const F16* p, VecA<float>& v) {
  Vec8U16 h;
  std::memcpy(&h, p, 16);
  const Vec8U32 u = __builtin_convertvector(h, Vec8U32);
  const Vec8U32 em = (u & 0x7fffu) << 13;
  VecA<float> f;
  std::memcpy(&f, &em, 32);
  f *= 5.192296858534828e33f;  // 2^112
  Vec8U32 bits;
  std::memcpy(&bits, &f, 32);
  const Vec8I32 special = (u & 0x7c00u) == 0x7c00u;
  bits = special ? (em | 0x7f800000u) : bits;
  bits |= (u & 0x8000u) << 16;
  std::memcpy(&v, &bits, 32);
}

// acc[i][j] += Xp row i (x) w row j over Kp / kLanes full vectors, then over the K tail.
// kRows rows of x: kMr, or 1 for a lone last row (the same arithmetic per element).
template <class A, class W, int kRows>
DSPARK_ALWAYS_INLINE void MicroTile(const A* xp, int64_t kp, const W* const w[kNr], int64_t K,
                                    A out[kMr][kNr]) {
  using V = VecA<A>;
  V acc[kRows][kNr];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kNr; ++j) acc[i][j] = V{};
  const int64_t K8 = K / kLanes * kLanes;
  for (int64_t k = 0; k < K8; k += kLanes) {
    // NOTE: loaded through the (unaligned, may_alias) vector type: a memcpy into a vector array
    // compiled to two 16-byte stores and a 32-byte reload, a store-forwarding stall per step.
    V xv[kRows];
    for (int i = 0; i < kRows; ++i) xv[i] = *reinterpret_cast<const V*>(xp + i * kp + k);
    for (int j = 0; j < kNr; ++j) {
      V wv;
      LoadW(w[j] + k, wv);
      for (int i = 0; i < kRows; ++i) acc[i][j] += xv[i] * wv;
    }
  }
  if (K8 < K) {  // the tail: weights copied into a zero-padded vector (Xp is zero there too)
    V wv[kNr];
    for (int j = 0; j < kNr; ++j) {
      W tmp[kLanes];
      std::memset(tmp, 0, sizeof(tmp));
      std::memcpy(tmp, w[j] + K8, (K - K8) * sizeof(W));
      LoadW(tmp, wv[j]);
    }
    for (int i = 0; i < kRows; ++i) {
      V xv;
      std::memcpy(&xv, xp + i * kp + K8, sizeof(V));
      for (int j = 0; j < kNr; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kNr; ++j) {
      const V& a = acc[i][j];
      out[i][j] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
}

// acc[i][j] += Xp row i (x) Wp row j over all Kp: both zero-padded past K, so the sequence of
// additions per output is MicroTile's exactly (its tail adds the same zero-padded vectors).
template <class A, int kRows, int kCols>
DSPARK_ALWAYS_INLINE void PaddedTile(const A* xp, int64_t kp, const A* wp, A* out, int64_t ldo) {
  using V = VecA<A>;
  V acc[kRows][kCols];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kCols; ++j) acc[i][j] = V{};
  for (int64_t k = 0; k < kp; k += kLanes) {
    V xv[kRows];
    for (int i = 0; i < kRows; ++i) xv[i] = *reinterpret_cast<const V*>(xp + i * kp + k);
    for (int j = 0; j < kCols; ++j) {
      const V wv = *reinterpret_cast<const V*>(wp + j * kp + k);
      for (int i = 0; i < kRows; ++i) acc[i][j] += xv[i] * wv;
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kCols; ++j) {
      const V& a = acc[i][j];
      out[i * ldo + j] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
}

// The 16-bit path for several rows of x: kNr weight rows are widened once into a zero-padded
// float block (L1-resident), then swept by tiles of kWideRows rows of x, so the widening is paid
// once per weight byte whatever the number of rows (in registers it was paid once per kMr rows).
constexpr int kWideRows = 4;
constexpr int kWideCols = 3;  // 12 accumulators (FMA latency x 2 pipes) + 4 x + 1 w: one spill

template <class A, int kRows>
DSPARK_ALWAYS_INLINE void WideRows(const A* xp, int64_t kp, const A* wp, A acc[][kNr]) {
  for (int j = 0; j < kNr; j += kWideCols)
    PaddedTile<A, kRows, kWideCols>(xp, kp, wp + j * kp, &acc[0][j], kNr);
}

template <class A, class T>
DSPARK_ALWAYS_INLINE void WideTask(const LinearParams& p, const A* xp, int64_t kp, int64_t m0,
                                   int64_t mb, int64_t n0, int64_t n1) {
  static_assert(kNr % kWideCols == 0, "weight block must split into whole tiles");
  const T* w = static_cast<const T*>(p.w);
  T* out = static_cast<T*>(p.out);
  std::vector<A> wp(kNr * kp);
  for (int64_t n = n0; n < n1; n += kNr) {
    for (int j = 0; j < kNr; ++j) {
      A* row = wp.data() + j * kp;
      if (n + j < n1) {
        const T* src = w + (n + j) * p.ldw;
        const int64_t K8 = p.K / kLanes * kLanes;
        for (int64_t k = 0; k < K8; k += kLanes) LoadW(src + k, *reinterpret_cast<VecA<A>*>(row + k));
        for (int64_t k = K8; k < p.K; ++k) row[k] = Widen(src[k]);
        std::fill(row + p.K, row + kp, A(0));
      } else {
        std::fill(row, row + kp, A(0));
      }
    }
    for (int64_t i = 0; i < mb; i += kWideRows) {
      A acc[kWideRows][kNr];
      const A* xi = xp + i * kp;
      switch (std::min<int64_t>(kWideRows, mb - i)) {
        case 1: WideRows<A, 1>(xi, kp, wp.data(), acc); break;
        case 2: WideRows<A, 2>(xi, kp, wp.data(), acc); break;
        case 3: WideRows<A, 3>(xi, kp, wp.data(), acc); break;
        default: WideRows<A, kWideRows>(xi, kp, wp.data(), acc); break;
      }
      for (int a = 0; a < kWideRows && i + a < mb; ++a)
        for (int j = 0; j < kNr && n + j < n1; ++j)
          Narrow(acc[a][j], out + (m0 + i + a) * p.ldo + n + j);
    }
  }
}

// Rows [m0, m0 + mb) of x against weight rows [n0, n1): Xp holds those rows widened.
template <class A, class T>
DSPARK_ALWAYS_INLINE void Task(const LinearParams& p, const A* xp, int64_t kp, int64_t m0,
                               int64_t mb, int64_t n0, int64_t n1, const T* zero_w) {
  if (sizeof(T) == 2 && mb > kMr) return WideTask<A, T>(p, xp, kp, m0, mb, n0, n1);
  const T* w = static_cast<const T*>(p.w);
  T* out = static_cast<T*>(p.out);
  for (int64_t n = n0; n < n1; n += kNr) {
    const T* wr[kNr];
    for (int j = 0; j < kNr; ++j) wr[j] = n + j < n1 ? w + (n + j) * p.ldw : zero_w;
    for (int64_t i = 0; i < mb; i += kMr) {
      A acc[kMr][kNr] = {};
      if (mb - i == 1) {
        MicroTile<A, T, 1>(xp + i * kp, kp, wr, p.K, acc);
      } else {
        MicroTile<A, T, kMr>(xp + i * kp, kp, wr, p.K, acc);
      }
      for (int a = 0; a < kMr && i + a < mb; ++a)
        for (int j = 0; j < kNr && n + j < n1; ++j)
          Narrow(acc[a][j], out + (m0 + i + a) * p.ldo + n + j);
    }
  }
}

template <class A, class T>
void Run(const LinearParams& p, void (*task)(const LinearParams&, const A*, int64_t, int64_t,
                                             int64_t, int64_t, int64_t, const T*)) {
  const int64_t kp = RoundUp(std::max<int64_t>(p.K, 1), kLanes);
  const int64_t mb_max = std::max<int64_t>(
      kMr, kXBlockBytes / static_cast<int64_t>(kp * sizeof(A)) / kMr * kMr);
  const T* x = static_cast<const T*>(p.x);
  const std::vector<T> zero_w(RoundUp(p.K, kLanes), T{});
  const int64_t span = kNr * kNrPerTask, tasks = (p.N + span - 1) / span;
  std::vector<A> xp;
  for (int64_t m0 = 0; m0 < p.M; m0 += mb_max) {
    const int64_t mb = std::min(mb_max, p.M - m0), mbp = RoundUp(mb, kMr);
    xp.assign(mbp * kp, A(0));
    for (int64_t i = 0; i < mb; ++i)
      for (int64_t k = 0; k < p.K; ++k) xp[i * kp + k] = Widen(x[(m0 + i) * p.ldx + k]);
    const bool par = mb * p.N * p.K > (1 << 18);
    ParallelFor(tasks, par, [&](int64_t t) {
      task(p, xp.data(), kp, m0, mb, t * span, std::min(p.N, (t + 1) * span), zero_w.data());
    });
  }
}

DSPARK_CPU_CLONES void Task32(const LinearParams& p, const float* xp, int64_t kp, int64_t m0,
                              int64_t mb, int64_t n0, int64_t n1, const float* z) {
  Task<float, float>(p, xp, kp, m0, mb, n0, n1, z);
}
DSPARK_CPU_CLONES void Task64(const LinearParams& p, const double* xp, int64_t kp, int64_t m0,
                              int64_t mb, int64_t n0, int64_t n1, const double* z) {
  Task<double, double>(p, xp, kp, m0, mb, n0, n1, z);
}
DSPARK_CPU_CLONES void TaskBf16(const LinearParams& p, const float* xp, int64_t kp, int64_t m0,
                                int64_t mb, int64_t n0, int64_t n1, const Bf16* z) {
  Task<float, Bf16>(p, xp, kp, m0, mb, n0, n1, z);
}
DSPARK_CPU_CLONES void TaskF16(const LinearParams& p, const float* xp, int64_t kp, int64_t m0,
                               int64_t mb, int64_t n0, int64_t n1, const F16* z) {
  Task<float, F16>(p, xp, kp, m0, mb, n0, n1, z);
}

}  // namespace

Status LinearCpu(const LinearParams& p) {
  if (p.M < 0 || p.N < 0 || p.K < 0 || p.ldx < p.K || p.ldw < p.K || p.ldo < p.N)
    return Status::kBadArgument;
  if (p.M == 0 || p.N == 0) return Status::kOk;
  if (!p.out || (p.K > 0 && (!p.x || !p.w))) return Status::kBadArgument;
  switch (p.dtype) {
    case DType::kFloat32: Run<float, float>(p, Task32); break;
    case DType::kFloat64: Run<double, double>(p, Task64); break;
    case DType::kBFloat16: Run<float, Bf16>(p, TaskBf16); break;
    case DType::kFloat16: Run<float, F16>(p, TaskF16); break;
    default: return Status::kUnsupported;
  }
  return Status::kOk;
}

}  // namespace dspark
