// linear on the GPU: out[M, N] = x[M, K] w[N, K]^T, row-invariant (csrc/linear.h, DESIGN §6).
// Semantics: reference.linear (float32 accumulation, one rounding to the output dtype).
//
// Design. One kernel per dtype family, one tile shape for every M (no choice by M):
//   * float16 / bfloat16: LinearMmaKernel. A block computes BM x BN = 16 x 32 outputs: one m16
//     tile of rows against 32 weight rows, 2 warps of 16 columns (two n8 tiles) each. K streams
//     in order through a 4-stage cp.async pipeline of BK = 128 (16-byte copies, XOR-swizzled
//     shared tiles read by ldmatrix), and every k16 step is one mma.sync m16n8k16 per n8 tile
//     with float32 accumulators. Grid: x = row tiles (fastest), y = column tiles, so the blocks
//     that share a weight tile run together and W streams from HBM about once whatever M is
//     (the other row tiles hit L2). For decode-sized M (1..16) the one row tile reads each
//     weight byte once for all rows; BN = 32 gives N / 32 blocks (128 at N = 4096, one per SM)
//     with 3 stages x 12 KB in flight each.
//   * float32: LinearSimtKernel, CUDA cores. A block computes 16 x 64 outputs, each thread 2 x 4
//     of them, walking k one element at a time (fmaf) through shared tiles of BK = 32.
//   Rows whose stride or base is not 16-byte aligned (or K % 8 != 0) are loaded element-wise
//   into the same shared layout (kVec = false): the arithmetic is the same instructions on the
//   same shared contents, so the load path never shows in the result.
//
// Row invariance (the guarantee of linear.h). On the tensor-core path out[m, n] is
//   acc = 0; for s = 0 .. ceil(K / 16) - 1: acc = mma(acc, x[m, 16s .. 16s+15], w[n, 16s .. 16s+15])
// followed by one rounding, with k >= K zero-filled: an mma output element is a function of its
// own A row, its own B column and its own accumulator only, so the sequence depends on K alone,
// never on M, on which rows share the m16 tile (or are zero padding), on the tile m falls in,
// on the grid or on the SM count. There is no split-K and no shape-dependent kernel choice; the
// path (tensor cores vs CUDA cores) follows the dtype alone. The float32 path is
// acc = fmaf(x[m, k], w[n, k], acc) for k = 0 .. K - 1, each output owned by one thread.
// NOTE: so out[m, :] equals the result of the call with x[m:m+1] alone, bit for bit; it is not
// the bits of cuBLAS (whose split-K and kernel choice follow the shape).
//
// Paper floor on an H200 (4.3 TB/s, ~790 TFLOP/s bf16 dense), bf16, N = K = 4096:
//   M = 1:  bytes = W 33.55 MB + x 8 KB + out 8 KB = 33.6 MB -> 7.8 us;  FLOPs 2MNK = 34 MFLOP
//           -> 0.04 us (the m16 tile issues 16 rows: 0.54 GFLOP, ~0.7 us at peak, under the
//           load). Floor 7.8 us, bandwidth-bound.
//   M = 8:  33.7 MB -> 7.8 us; 268 MFLOP -> 0.34 us. Floor 7.8 us, bandwidth-bound.
//   M = 64: 33.55 + 0.52 + 0.52 MB = 34.6 MB -> 8.0 us; 2.15 GFLOP -> 2.7 us. Still bandwidth-
//           bound on paper (the ridge is M ~ 790 / 4.3 = 184 rows: M FLOPs per weight byte), if
//           the 4 row tiles of a column tile read W from L2 (grid order): 4 x 33.5 MB of L2 and
//           shared-memory traffic, and mma.sync reaches ~60-70% of the wgmma peak.
// Not measured yet. Large M (prefill) runs at the L2 rate of 16 x 32 tiles (~11 FLOP per loaded
// byte), well below the matrix peak: a larger row tile running the same k16 sequence per
// output would give the same bits and is the next step if prefill time matters.
#include "linear.h"

#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/mma.cuh"

namespace dspark::cuda {
namespace {

struct LinearArgs {
  const void* x;
  const void* w;
  void* out;
  int64_t M, N, ldx, ldw, ldo;
  int K;
};

// ---- float16 / bfloat16: tensor cores ---------------------------------------------------------
constexpr int kBM = 16;                    // rows per block: one m16 tile
constexpr int kBN = 32;                    // weight rows (output columns) per block
constexpr int kBK = 128;                   // k per pipeline stage: 8 mma k-steps
constexpr int kStages = 4;                 // 3 stages in flight while one is consumed
constexpr int kMmaWarps = kBN / 16;        // a warp owns 16 columns: two n8 tiles
constexpr int kMmaThreads = 32 * kMmaWarps;
constexpr int kChunks = kBK / 8;           // 16-byte chunks per shared row
constexpr int kStageElems = (kBM + kBN) * kBK;  // [A: kBM rows | B: kBN rows] x kBK
constexpr int kMmaSmem = kStages * kStageElems * 2;  // 48 KB: within the default limit
static_assert(kMmaSmem <= 48 * 1024, "opt into more shared memory before growing the pipeline");
static_assert(kBM % 8 == 0, "B rows follow A rows in a stage: the swizzle (row & 7) must not shift");

// Shared rows of kBK 16-bit elements; 16-byte chunks XOR-swizzled by row so that ldmatrix (8 rows
// at one chunk column) and the cp.async rows hit all 32 banks.
__device__ __forceinline__ int Swz(int row, int chunk) { return row * kBK + ((chunk ^ (row & 7)) << 3); }

// Stage of k-tile kt: rows m0 .. m0 + 15 of x and n0 .. n0 + 31 of w, k in [kt * kBK, +kBK).
// Out-of-range rows and k >= K are zero-filled (the zeros are the same whatever the path).
template <class T, bool kVec>
__device__ __forceinline__ void LoadStage(const LinearArgs& a, T* stage, int64_t m0, int64_t n0, int kt) {
  const int k0 = kt * kBK;
  for (int idx = threadIdx.x; idx < (kBM + kBN) * kChunks; idx += kMmaThreads) {
    const int row = idx / kChunks, ch = idx % kChunks;
    const bool is_x = row < kBM;
    const int64_t grow = is_x ? m0 + row : n0 + (row - kBM);
    const bool row_ok = grow < (is_x ? a.M : a.N);
    const T* src = static_cast<const T*>(is_x ? a.x : a.w) + (row_ok ? grow * (is_x ? a.ldx : a.ldw) : 0);
    const int k = k0 + ch * 8;
    T* dst = stage + Swz(row, ch);
    if constexpr (kVec) {
      // NOTE: K % 8 == 0 on this path, so a chunk is wholly inside K or wholly outside.
      const bool valid = row_ok && k < a.K;
      CpAsync16(SmemAddr(dst), valid ? src + k : src, valid ? 16 : 0);
    } else {
      const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src);
      uint32_t v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t lo = row_ok && k + 2 * j < a.K ? __ldg(s16 + k + 2 * j) : 0u;
        const uint32_t hi = row_ok && k + 2 * j + 1 < a.K ? __ldg(s16 + k + 2 * j + 1) : 0u;
        v[j] = lo | (hi << 16);
      }
      *reinterpret_cast<uint4*>(dst) = make_uint4(v[0], v[1], v[2], v[3]);
    }
  }
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kMmaThreads) LinearMmaKernel(LinearArgs a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int mi = lane >> 3, r8 = lane & 7;  // ldmatrix: lane l addresses row r8 of matrix mi
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kBM;
  const int64_t n_tiles = (a.N + kBN - 1) / kBN;
  const int k_tiles = (a.K + kBK - 1) / kBK;
  GridDependencyWait();  // x (and out) may belong to the previous kernel in the stream

  for (int64_t nt = blockIdx.y; nt < n_tiles; nt += gridDim.y) {
    const int64_t n0 = nt * kBN;
    float acc[2][4] = {};
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) LoadStage<T, kVec>(a, smem + s * kStageElems, m0, n0, s);
      CpAsyncCommit();  // one group per stage, empty or not: the wait below counts groups
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      CpAsyncWait<kStages - 2>();  // this thread's copies of stage kt landed...
      __syncthreads();             // ...and everyone's; stage kt - 1 is no longer read
      const int nk = kt + kStages - 1;
      if (nk < k_tiles) LoadStage<T, kVec>(a, smem + (nk % kStages) * kStageElems, m0, n0, nk);
      CpAsyncCommit();
      const T* sa = smem + (kt % kStages) * kStageElems;
      const T* sb = sa + kBM * kBK;
      // k16 steps of this stage in order; steps wholly past K are skipped (a function of K only).
      const int steps = (min(kBK, a.K - kt * kBK) + 15) / 16;
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        if (kk < steps) {
          uint32_t af[4], bf[4];
          LdMatrixX4(af, SmemAddr(sa + Swz((mi & 1) * 8 + r8, kk * 2 + (mi >> 1))));
          LdMatrixX4(bf, SmemAddr(sb + Swz(warp * 16 + (mi >> 1) * 8 + r8, kk * 2 + (mi & 1))));
          Mma16816<T>(acc[0], af[0], af[1], af[2], af[3], bf[0], bf[1]);
          Mma16816<T>(acc[1], af[0], af[1], af[2], af[3], bf[2], bf[3]);
        }
      }
    }
    CpAsyncWait<0>();
    __syncthreads();  // every warp is done with the stages before the next column tile refills them
    if (nt + gridDim.y >= n_tiles) GridDependentsMayLaunch();

    // ---- epilogue: C layout, c0,c1 = (g, 2t..2t+1), c2,c3 = (g + 8, 2t..2t+1) of each n8 tile ----
    T* out = static_cast<T*>(a.out);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t n = n0 + warp * 16 + j * 8 + 2 * t;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t m = m0 + g + (e >> 1) * 8, c = n + (e & 1);
        if (m < a.M && c < a.N) out[m * a.ldo + c] = FromFloat<T>(acc[j][e]);
      }
    }
  }
}

// ---- float32: CUDA cores ----------------------------------------------------------------------
constexpr int kSimtBM = 16, kSimtBN = 64, kSimtBK = 32, kSimtThreads = 128;

__global__ void __launch_bounds__(kSimtThreads) LinearSimtKernel(LinearArgs a) {
  // NOTE: rows padded to kSimtBK + 1 floats: the 16 columns a warp reads at one k fall in 16 banks.
  __shared__ float xs[kSimtBM][kSimtBK + 1];
  __shared__ float ws[kSimtBN][kSimtBK + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;  // rows ty, ty + 8; columns tx + 16 j
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kSimtBM;
  const int64_t n_tiles = (a.N + kSimtBN - 1) / kSimtBN;
  const float* x = static_cast<const float*>(a.x);
  const float* w = static_cast<const float*>(a.w);
  float* out = static_cast<float*>(a.out);
  GridDependencyWait();

  for (int64_t nt = blockIdx.y; nt < n_tiles; nt += gridDim.y) {
    const int64_t n0 = nt * kSimtBN;
    float acc[2][4] = {};
    for (int k0 = 0; k0 < a.K; k0 += kSimtBK) {
      const int kn = min(kSimtBK, a.K - k0);
      for (int idx = threadIdx.x; idx < kSimtBM * kSimtBK; idx += kSimtThreads) {
        const int r = idx / kSimtBK, c = idx % kSimtBK;
        xs[r][c] = m0 + r < a.M && c < kn ? __ldg(x + (m0 + r) * a.ldx + k0 + c) : 0.f;
      }
      for (int idx = threadIdx.x; idx < kSimtBN * kSimtBK; idx += kSimtThreads) {
        const int r = idx / kSimtBK, c = idx % kSimtBK;
        ws[r][c] = n0 + r < a.N && c < kn ? __ldg(w + (n0 + r) * a.ldw + k0 + c) : 0.f;
      }
      __syncthreads();
      for (int kk = 0; kk < kn; ++kk) {  // k in order: the accumulation order depends on K only
        const float x0 = xs[ty][kk], x1 = xs[ty + 8][kk];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float wv = ws[tx + 16 * j][kk];
          acc[0][j] = fmaf(x0, wv, acc[0][j]);
          acc[1][j] = fmaf(x1, wv, acc[1][j]);
        }
      }
      __syncthreads();  // the tiles are refilled next
    }
    if (nt + gridDim.y >= n_tiles) GridDependentsMayLaunch();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int64_t m = m0 + ty + 8 * i;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t n = n0 + tx + 16 * j;
        if (m < a.M && n < a.N) out[m * a.ldo + n] = acc[i][j];
      }
    }
  }
}

// ---- host ------------------------------------------------------------------------------------
constexpr int64_t kMaxGridY = 65535;  // column tiles beyond it loop inside the blocks

template <class... Params>
Status Launch(void (*kernel)(Params...), int64_t m_tiles, int64_t n_tiles, int threads, int smem,
              const LinearArgs& a, const DeviceLimits& lim, cudaStream_t stream) {
  if (m_tiles > 0x7fffffff) return Status::kUnsupported;
  const dim3 grid(static_cast<unsigned>(m_tiles), static_cast<unsigned>(std::min(n_tiles, kMaxGridY)));
  const Status st = LaunchKernel(kernel, grid, dim3(threads), static_cast<size_t>(smem), stream,
                                 DependentLaunches(lim, kernel), a);
  return st != Status::kOk ? st : LaunchStatus();
}

template <class T>
Status LaunchMma(const LinearParams& p, const LinearArgs& a, const DeviceLimits& lim, cudaStream_t stream) {
  if (lim.cc_major < 8) return Status::kUnsupported;  // mma.sync m16n8k16, ldmatrix, cp.async
  // 16-byte copies need 16-byte aligned rows: base pointers and strides (in 8-element units).
  const bool vec = p.K % 8 == 0 && p.ldx % 8 == 0 && p.ldw % 8 == 0 && Aligned(p.x, 16) && Aligned(p.w, 16);
  const int64_t m_tiles = CeilDiv(p.M, kBM), n_tiles = CeilDiv(p.N, kBN);
  return vec ? Launch(LinearMmaKernel<T, true>, m_tiles, n_tiles, kMmaThreads, kMmaSmem, a, lim, stream)
             : Launch(LinearMmaKernel<T, false>, m_tiles, n_tiles, kMmaThreads, kMmaSmem, a, lim, stream);
}

Status CheckLinear(const LinearParams& p) {
  if (p.M < 0 || p.N < 0 || p.K < 0 || p.ldx < 0 || p.ldw < 0 || p.ldo < 0) return Status::kBadArgument;
  if (p.M == 0 || p.N == 0) return Status::kOk;
  if (p.ldo < p.N || p.ldx < p.K || p.ldw < p.K || !p.out) return Status::kBadArgument;
  if (p.K > 0 && (!p.x || !p.w)) return Status::kBadArgument;
  if (p.K > 0x7fffffff - kBK) return Status::kUnsupported;  // k is a 32-bit index in the kernels
  return Status::kOk;
}

}  // namespace
}  // namespace dspark::cuda

namespace dspark {

Status LinearCuda(const LinearParams& p, void* stream) {
  using namespace dspark::cuda;
  if (Status s = CheckLinear(p); s != Status::kOk || p.M == 0 || p.N == 0) return s;
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    return Status::kUnsupported;  // float64 included: the CPU kernel and the reference take it
  }
  const cudaStream_t s = AsStream(stream);
  DeviceGuard guard(s);
  DeviceLimits lim;
  if (Status st = CurrentDeviceLimits(&lim); st != Status::kOk) return st;
  LinearArgs a{};
  a.x = p.x;
  a.w = p.w;
  a.out = p.out;
  a.M = p.M;
  a.N = p.N;
  a.K = static_cast<int>(p.K);
  a.ldx = p.ldx;
  a.ldw = p.ldw;
  a.ldo = p.ldo;
  // K == 0 runs too: no k-tile, every output is the rounding of 0.
  switch (p.dtype) {
    case DType::kFloat16: return LaunchMma<__half>(p, a, lim, s);
    case DType::kBFloat16: return LaunchMma<__nv_bfloat16>(p, a, lim, s);
    default:
      return Launch(LinearSimtKernel, CeilDiv(p.M, kSimtBM), CeilDiv(p.N, kSimtBN), kSimtThreads, 0, a, lim, s);
  }
}

}  // namespace dspark
