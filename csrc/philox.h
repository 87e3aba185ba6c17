// Counter-based randomness shared bit for bit by the PyTorch reference, the C++ CPU kernels and
// the CUDA kernels (DESIGN §5): every random number is a pure function of
// (seed, purpose, stream, round, position, index).
//
//   key     = (seed & 0xffffffff, seed >> 32)
//   counter = (index >> 2, position | purpose << 16, round, stream)
//   word    = Philox4x32-10(counter, key)[index & 3]
//   uniform = ((word >> 8) + 0.5) * 2^-24          (in double: exact, strictly inside (0, 1))
//   gumbel  = -log(-log(uniform))                    (in double)
//
// `stream` is the request's random stream id (0 for a request with its own seed, so the tokens
// do not depend on where the request sits in the batch); `round` counts the request's rounds.
//
// Coupled sampling (DESIGN §2) keys the Gumbel noise by output index alone: the noise of a
// request's n-th emitted token has round = n, purpose kPurposeCoupled, position 0, and the draft
// and the target share it. Callers then pass n0 (tokens emitted so far) as `round`; NoiseSite
// gives the counter fields for block position k under either rule.
#pragma once
#include "common.h"

namespace dspark {

// Purposes keep the draws of one round independent of each other.
enum Purpose : uint32_t {
  kPurposeDraft = 1, kPurposeAccept = 2, kPurposeEmit = 3, kPurposeCoupled = 4
};

struct PhiloxKey {
  uint64_t seed;
  uint32_t stream;
  uint32_t round;
};

DSPARK_HD void PhiloxMulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Philox4x32 with 10 rounds (Salmon et al., SC'11), the variant cuRAND and PyTorch use.
DSPARK_HD void Philox4x32x10(uint32_t c[4], uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < 10; ++i) {
    uint32_t hi0, lo0, hi1, lo1;
    PhiloxMulHiLo(kM0, c[0], &hi0, &lo0);
    PhiloxMulHiLo(kM1, c[2], &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    k0 += kW0;
    k1 += kW1;
  }
}

// The 32-bit word for one (purpose, position, index) of a request's round.
DSPARK_HD uint32_t PhiloxWord(const PhiloxKey& key, uint32_t purpose, uint32_t position,
                              uint64_t index) {
  uint32_t c[4] = {static_cast<uint32_t>(index >> 2), position | (purpose << 16), key.round,
                   key.stream};
  Philox4x32x10(c, static_cast<uint32_t>(key.seed), static_cast<uint32_t>(key.seed >> 32));
  return c[index & 3];
}

// Where the noise of block position k (1-based) of a round lives: by default (key, purpose,
// position k); for a coupled request (key.round = n0) output index n0 + k alone:
// (round n0 + k, kPurposeCoupled, position 0).
struct NoiseSite {
  PhiloxKey key;
  uint32_t purpose;
  uint32_t position;
};

DSPARK_HD NoiseSite SiteOf(PhiloxKey key, bool coupled, uint32_t purpose, int64_t k) {
  if (!coupled) return NoiseSite{key, purpose, static_cast<uint32_t>(k)};
  key.round += static_cast<uint32_t>(k);
  return NoiseSite{key, kPurposeCoupled, 0};
}

DSPARK_HD double WordToUniform(uint32_t word) {
  return (static_cast<double>(word >> 8) + 0.5) * (1.0 / 16777216.0);
}

}  // namespace dspark
