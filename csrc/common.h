// Shared vocabulary of every kernel family: element types, launcher status, host/device marks.
// Kernels receive raw pointers and sizes through one params struct per family; nothing here
// knows Python or torch.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define DSPARK_HD __host__ __device__ __forceinline__
#else
#define DSPARK_HD inline
#endif

namespace dspark {

// Element type of the floating-point tensors a params struct points to.
enum class DType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// Launchers return a status; the bindings turn anything but kOk into a Python exception that
// names the op. A status never aborts the process.
enum class Status : int {
  kOk = 0,
  kBadArgument = 1,   // a size or pointer the launcher cannot accept
  kUnsupported = 2,   // valid input this backend does not implement (dtype, head_dim, ...)
  kCudaError = 3,     // a CUDA runtime call failed; the bindings report cudaGetLastError
};

// Whether a grammar's token bitmask row (ceil(V / 32) int32 words, xgrammar's layout) allows
// token v: bit v % 32 of word v / 32. A null row allows everything.
DSPARK_HD bool TokenAllowed(const int32_t* mask_row, int64_t v) {
  return !mask_row || ((static_cast<uint32_t>(mask_row[v >> 5]) >> (v & 31)) & 1u);
}

inline const char* StatusString(Status s) {
  switch (s) {
    case Status::kOk: return "ok";
    case Status::kBadArgument: return "bad argument";
    case Status::kUnsupported: return "unsupported by this backend";
    case Status::kCudaError: return "CUDA error";
  }
  return "unknown status";
}

}  // namespace dspark
