// Device helpers every CUDA kernel family shares: element conversion for float / half / bf16,
// vector loads, warp reductions, launch checks, stream-ordered scratch memory, device limits.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <utility>

#include "common.h"

namespace dspark::cuda {

constexpr float kInfF = __builtin_huge_valf();
constexpr float kNaNF = __builtin_nanf("");
constexpr double kInfD = __builtin_huge_val();

// ---- element conversion ----------------------------------------------------------------------

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T FromFloat(float x);
template <> __device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <> __device__ __forceinline__ __half FromFloat<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// x rounded to T and back: how the PyTorch reference stores every intermediate of a 16-bit op.
template <class T> __device__ __forceinline__ float RoundTo(float x) { return ToFloat(FromFloat<T>(x)); }

// Four consecutive elements as floats. NOTE: the vector form needs 4-element alignment of p
// (8 bytes for 16-bit types, 16 for float); callers check it once per row.
__device__ __forceinline__ float4 Load4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ float4 Load4(const __half* p) {
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 Load4(const __nv_bfloat16* p) {
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

// Same, but a plain (coherent) load: for buffers this launch or an earlier kernel wrote.
__device__ __forceinline__ float4 Load4Coherent(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 Load4Coherent(const __half* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 Load4Coherent(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

__device__ __forceinline__ void Store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void Store4(__half* p, float4 v) {
  __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w);
  uint2 u;
  u.x = *reinterpret_cast<uint32_t*>(&a);
  u.y = *reinterpret_cast<uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ void Store4(__nv_bfloat16* p, float4 v) {
  __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
  uint2 u;
  u.x = *reinterpret_cast<uint32_t*>(&a);
  u.y = *reinterpret_cast<uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = u;
}

// ---- warp reductions -------------------------------------------------------------------------

// A grammar's mask over the quad v .. v + 3 (v a multiple of 4, so one bitmask word holds its
// four bits): forbidden entries become -inf; a null mask row changes nothing.
__device__ __forceinline__ float4 MaskQuad(float4 x, const int32_t* mask_row, int v) {
  if (!mask_row) return x;
  const uint32_t bits = static_cast<uint32_t>(mask_row[v >> 5]) >> (v & 31);
  if (!(bits & 1u)) x.x = -kInfF;
  if (!(bits & 2u)) x.y = -kInfF;
  if (!(bits & 4u)) x.z = -kInfF;
  if (!(bits & 8u)) x.w = -kInfF;
  return x;
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// acc[i][q] += w_i . h_q over d elements for 4 weight rows w_i and 8 vectors h_q, this lane's
// share (every 32nd element, or every 32nd group of 4 when vec: 16-byte aligned rows); the
// caller sums acc over the warp. The matvec of a head's small weights against many rows.
template <class W>
__device__ __forceinline__ void RowDots4x8(const W* const wp[4], const W* const hp[8], int d, bool vec,
                                           int lane, float acc[4][8]) {
  if (vec) {
    for (int j = lane * 4; j < d; j += 128) {
      float4 w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = Load4(wp[i] + j);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const float4 h = Load4(hp[q] + j);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[i][q] = fmaf(w[i].x, h.x, fmaf(w[i].y, h.y, fmaf(w[i].z, h.z, fmaf(w[i].w, h.w, acc[i][q]))));
        }
      }
    }
  } else {
    for (int j = lane; j < d; j += 32) {
      float w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = ToFloat(wp[i][j]);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const float h = ToFloat(hp[q][j]);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i][q] = fmaf(w[i], h, acc[i][q]);
      }
    }
  }
}
__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024); every thread gets the result.
// NOTE: `scratch` holds 32 floats; the trailing barrier lets the caller reuse it at once.
__device__ __forceinline__ float BlockSum(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  x = WarpSum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < nwarps ? scratch[lane] : 0.f;
  x = WarpSum(x);
  __syncthreads();
  return x;
}

// ---- host side -------------------------------------------------------------------------------

inline cudaStream_t AsStream(void* s) { return static_cast<cudaStream_t>(s); }

// Status after launches: a launch error (bad configuration, no kernel image for this GPU) is
// reported as kCudaError and left for the bindings to read with cudaGetLastError... except that
// reading clears it, so we peek.
inline Status LaunchStatus() {
  return cudaPeekAtLastError() == cudaSuccess ? Status::kOk : Status::kCudaError;
}

struct DeviceLimits {
  int device = 0;
  int sm_count = 0;
  int smem_optin = 0;  // bytes of shared memory a block may opt into
  int cc_major = 0;    // compute capability
};

// Limits of the current device, read once per device.
inline Status CurrentDeviceLimits(DeviceLimits* out) {
  static DeviceLimits cache[64];
  static bool have[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return Status::kCudaError;
  if (dev < 64 && have[dev]) {
    *out = cache[dev];
    return Status::kOk;
  }
  DeviceLimits l;
  l.device = dev;
  if (cudaDeviceGetAttribute(&l.sm_count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&l.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&l.cc_major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    return Status::kCudaError;
  }
  if (dev < 64) {
    cache[dev] = l;
    have[dev] = true;
  }
  *out = l;
  return Status::kOk;
}

// ---- programmatic dependent launch (sm_90+) ------------------------------------------------------
// A kernel launched with LaunchKernel(..., dependent = true) may start while the previous kernel
// in the stream is still running: it must call GridDependencyWait() before it reads anything
// that kernel writes or writes anything that kernel reads (work on its own shared memory and
// prefetches of read-only inputs may come first). GridDependentsMayLaunch() lets the next
// dependent kernel start early. Both are no-ops below sm_90 and when the kernel was launched
// plainly; the wait also makes the previous kernel's writes visible.
__device__ __forceinline__ void GridDependencyWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void GridDependentsMayLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether `kernel` may be launched as a programmatic dependent launch: an sm_90+ device running
// code compiled for sm_90+ (a newer GPU that JIT-compiles the compute_80 PTX of a default build
// gets a kernel whose wait was compiled out), unless DSPARK_CUDA_PDL=0 (read at every launcher
// call, so a process can compare both).
template <class... Params>
bool DependentLaunches(const DeviceLimits& lim, void (*kernel)(Params...)) {
  const char* v = std::getenv("DSPARK_CUDA_PDL");
  if (lim.cc_major < 9 || (v && v[0] == '0' && v[1] == '\0')) return false;
  cudaFuncAttributes fa;
  if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return fa.ptxVersion >= 90;
}

template <class... Params, class... Args>
Status LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                    bool dependent, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...) == cudaSuccess ? Status::kOk
                                                                                      : Status::kCudaError;
}

// Launches run on the device that owns `stream` (the caller's current device may differ when a
// tensor lives on another GPU); the guard switches for the duration of the launcher.
class DeviceGuard {
 public:
  explicit DeviceGuard(cudaStream_t stream) {
    int want = -1;
    if (cudaGetDevice(&prev_) != cudaSuccess) return;
    if (stream == nullptr || cudaStreamGetDevice(stream, &want) != cudaSuccess) {
      cudaGetLastError();  // a legacy/default stream has no device of its own: keep the current
      return;
    }
    if (want != prev_ && cudaSetDevice(want) == cudaSuccess) switched_ = true;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool switched_ = false;
};

// Stream-ordered scratch memory (cudaMallocAsync): allocated on `stream`, freed on it when the
// launcher returns, so it lives exactly as long as the kernels that use it and works under
// CUDA-graph capture. NOTE: the first use raises the device pool's release threshold to 256 MB so
// per-call scratch is recycled instead of being returned to the driver at every synchronisation.
class Scratch {
 public:
  explicit Scratch(cudaStream_t stream) : stream_(stream) {}
  ~Scratch() {
    for (int i = 0; i < n_; ++i) cudaFreeAsync(ptr_[i], stream_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  template <class T>
  Status Get(size_t count, T** out) {
    *out = nullptr;
    if (count == 0) return Status::kOk;
    if (n_ == kMax) return Status::kBadArgument;
    KeepPoolWarm();
    void* p = nullptr;
    if (cudaMallocAsync(&p, count * sizeof(T), stream_) != cudaSuccess) return Status::kCudaError;
    ptr_[n_++] = p;
    *out = static_cast<T*>(p);
    return Status::kOk;
  }

 private:
  static void KeepPoolWarm() {
    static bool done[64] = {};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64 || done[dev]) return;
    done[dev] = true;
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, dev) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    uint64_t threshold = 0;
    cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
    if (threshold < (256ull << 20)) {
      threshold = 256ull << 20;
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
    }
    cudaGetLastError();
  }

  static constexpr int kMax = 8;
  cudaStream_t stream_;
  void* ptr_[kMax] = {};
  int n_ = 0;
};

inline bool Aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace dspark::cuda

// Runs `body` with `scalar_t` bound to the element type of a float32 / float16 / bfloat16 dtype;
// float64 (and anything else) returns kUnsupported from the enclosing launcher.
#define DSPARK_DISPATCH_FLOAT(dtype, ...)                                         \
  switch (dtype) {                                                                \
    case ::dspark::DType::kFloat32: { using scalar_t = float; __VA_ARGS__ } break; \
    case ::dspark::DType::kFloat16: { using scalar_t = __half; __VA_ARGS__ } break; \
    case ::dspark::DType::kBFloat16: {                                            \
      using scalar_t = __nv_bfloat16;                                             \
      __VA_ARGS__                                                                 \
    } break;                                                                      \
    default: return ::dspark::Status::kUnsupported;                               \
  }
