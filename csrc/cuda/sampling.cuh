// Sampling pieces shared by markov_sample and rejection_sample: the Gumbel noise of a Philox
// word (a cheap float bound and the exact double value), the exact argmax state with its
// lowest-index tie rule, and the online log-sum-exp state.
//
// Exactness: the reference decides a sample with double scores (z / T + gumbel in float64).
// The kernels compute a float estimate of every score first and evaluate the exact double score
// only when the estimate comes within kScoreMargin of the running best, so the winner is the
// reference's winner (up to ties of the double scores themselves) at float cost per element.
#pragma once
#include <cuda_runtime.h>

#include "philox.h"
#include "cuda/common.cuh"

namespace dspark::cuda {

// ---- streaming memory access -------------------------------------------------------------------
// Logits are touched once per sweep; an L2 policy marks their lines evict-first so that the
// weights the sweeps share (markov's W2, several MB read by every request group and every step)
// stay resident in L2 instead of being displaced by 4-6 bytes of logits per vocabulary entry
// and request. NOTE: the L2::evict_first eviction-priority qualifier of ld needs .v8 operands
// on current ptxas, so the hint goes through a createpolicy cache hint (sm_80+).
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
// 16 / 8 bytes of a read-only input (no kernel of this launch writes it), not kept in L1.
__device__ __forceinline__ uint4 LdStream16(const void* p, uint64_t pol) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  return v;
}
// Coherent forms: for a row this launch writes back (markov's in-place z = U + bias).
__device__ __forceinline__ uint4 LdStream16Coherent(const void* p, uint64_t pol) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol) : "memory");
  return v;
}
__device__ __forceinline__ uint2 LdStream8Coherent(const void* p, uint64_t pol) {
  uint2 v;
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v2.u32 {%0,%1}, [%2], %3;"
               : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(pol) : "memory");
  return v;
}
__device__ __forceinline__ void StStream16(void* p, uint4 v, uint64_t pol) {
  asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol) : "memory");
}
__device__ __forceinline__ void StStream8(void* p, uint2 v, uint64_t pol) {
  asm volatile("st.global.L1::no_allocate.L2::cache_hint.v2.u32 [%0], {%1,%2}, %3;"
               :: "l"(p), "r"(v.x), "r"(v.y), "l"(pol) : "memory");
}

// 16-bit floats from / to the low half of a word.
template <class H> __device__ __forceinline__ H Bits16(uint32_t w);
template <> __device__ __forceinline__ __half Bits16<__half>(uint32_t w) {
  return __ushort_as_half(static_cast<unsigned short>(w));
}
template <> __device__ __forceinline__ __nv_bfloat16 Bits16<__nv_bfloat16>(uint32_t w) {
  return __ushort_as_bfloat16(static_cast<unsigned short>(w));
}
__device__ __forceinline__ uint32_t Pack16(__half h) { return __half_as_ushort(h); }
__device__ __forceinline__ uint32_t Pack16(__nv_bfloat16 h) { return __bfloat16_as_ushort(h); }

// Largest Gumbel value a 24-bit uniform can produce: -log(-log(1 - 2^-25)) = 17.33.
constexpr float kGumbelMax = 17.5f;

// Four Philox words of one (key, purpose, position) for indices 4q .. 4q + 3 (philox.h layout).
__device__ __forceinline__ uint4 PhiloxQuad(const PhiloxKey& key, uint32_t purpose,
                                            uint32_t position, uint32_t quad) {
  uint32_t c[4] = {quad, (position & 0xffffu) | (purpose << 16), key.round, key.stream};
  Philox4x32x10(c, static_cast<uint32_t>(key.seed), static_cast<uint32_t>(key.seed >> 32));
  return make_uint4(c[0], c[1], c[2], c[3]);
}

// The reference's Gumbel value of a word, bit for bit (philox.h).
__device__ __forceinline__ double GumbelExact(uint32_t word) {
  return -log(-log(WordToUniform(word)));
}

// A float estimate of GumbelExact within 1e-5 absolute. NOTE: for u >= 1/2 it works from
// t = 1 - u, which is exact in float there, and log1pf; the naive logf(u) would lose all digits
// of -log(u) as u -> 1, exactly where the largest (winning) Gumbel values live.
__device__ __forceinline__ float GumbelApprox(uint32_t word) {
  const uint32_t m = word >> 8;  // u = (m + 0.5) * 2^-24
  float nl;                      // -log(u) > 0
  if (m < (1u << 23)) {
    nl = -__logf((static_cast<float>(m) + 0.5f) * (1.0f / 16777216.0f));
  } else {
    const float t = static_cast<float>((1u << 25) - 2u * m - 1u) * (1.0f / 33554432.0f);
    nl = -log1pf(-t);
  }
  return -__logf(nl);
}

// Slack between a float score estimate and its exact double value: Gumbel estimate (1e-5),
// z / T in float (a few ulps of |score|) and the float rounding of the running best.
__device__ __forceinline__ float ScoreMargin(float s) { return 1e-3f + 1e-5f * fabsf(s); }

// Running argmax of exact double scores; ties go to the lower index, NaN never wins.
struct ArgMax {
  double best;
  int idx;

  __device__ __forceinline__ void Init() {
    best = -kInfD;
    idx = 0x7fffffff;
  }
  __device__ __forceinline__ void Offer(double s, int i) {
    if (s != s) s = -kInfD;
    if (s > best || (s == best && i < idx)) {
      best = s;
      idx = i;
    }
  }
  __device__ __forceinline__ void Merge(const ArgMax& o) { Offer(o.best, o.idx); }
  __device__ __forceinline__ void WarpMerge() {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      ArgMax other;
      other.best = __shfl_xor_sync(0xffffffffu, best, o);
      other.idx = __shfl_xor_sync(0xffffffffu, idx, o);
      Merge(other);
    }
  }
};

// Online log-sum-exp of x / T over raw values x: m = max x (float), s = sum exp((x - m) / T)
// accumulated in double (each term is a float exp, ~1e-7 relative). Working from the raw
// maximum keeps the exp arguments small, so the float terms stay accurate even when |x / T| is
// large. lse = m / T + log(s). NaN anywhere gives NaN (as torch.logsumexp); all -inf gives -inf;
// a +inf (and no NaN) gives +inf: once m = +inf, s only records NaNs (exp(inf - inf) would
// poison it), and Value returns m / T + log(s) = +inf for the s >= 1 left there.
struct LogSumExp {
  float m;
  double s;

  __device__ __forceinline__ void Init() {
    m = -kInfF;
    s = 0.0;
  }
  // Adds four values (invalid ones passed as -inf). inv_t = 1 / T.
  __device__ __forceinline__ void Add4(float4 x, float inv_t) {
    const float mx = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));  // fmaxf ignores NaN
    if (mx > m) {
      s *= static_cast<double>(__expf((m - mx) * inv_t));  // m = -inf: s is 0 anyway
      m = mx;
    }
    if (m == -kInfF || m == kInfF) {
      // Nothing finite yet, or a +inf seen: only a NaN can change the result. A first +inf
      // sets s = 1 (whatever the rescale above left, NaN kept).
      if (m == kInfF && s == s) s = 1.0;
      if (x.x != x.x || x.y != x.y || x.z != x.z || x.w != x.w) s = __int_as_float(0x7fc00000);
      return;
    }
    // NOTE: -inf terms give exp(-inf) = 0; a NaN term gives NaN and poisons s, as wanted.
    s += static_cast<double>(__expf((x.x - m) * inv_t)) + static_cast<double>(__expf((x.y - m) * inv_t)) +
         static_cast<double>(__expf((x.z - m) * inv_t)) + static_cast<double>(__expf((x.w - m) * inv_t));
  }
  // Add4 with the four exps summed in float first (one widening and one double add per quad;
  // two float roundings, ~1e-7 relative, below the exps' own error).
  __device__ __forceinline__ void Add4Pairwise(float4 x, float inv_t) {
    const float mx = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));
    if (mx > m) {
      s *= static_cast<double>(__expf((m - mx) * inv_t));
      m = mx;
    }
    if (m == -kInfF || m == kInfF) {
      if (m == kInfF && s == s) s = 1.0;
      if (x.x != x.x || x.y != x.y || x.z != x.z || x.w != x.w) s = __int_as_float(0x7fc00000);
      return;
    }
    s += static_cast<double>((__expf((x.x - m) * inv_t) + __expf((x.y - m) * inv_t)) +
                             (__expf((x.z - m) * inv_t) + __expf((x.w - m) * inv_t)));
  }
  __device__ __forceinline__ void Merge(const LogSumExp& o, float inv_t) {
    if (m == kInfF || o.m == kInfF) {  // +inf wins unless either side holds a NaN
      s = (s != s || o.s != o.s) ? s + o.s : 1.0;
      m = kInfF;
      return;
    }
    if (o.m > m) {
      s = s * static_cast<double>(__expf((m - o.m) * inv_t)) + o.s;
      m = o.m;
    } else if (o.m == m) {
      s += o.s;
    } else {
      s += o.s * static_cast<double>(__expf((o.m - m) * inv_t));
    }
    // NaN partials: o.s NaN propagates through the sums above.
  }
  __device__ __forceinline__ void WarpMerge(float inv_t) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      LogSumExp other;
      other.m = __shfl_xor_sync(0xffffffffu, m, o);
      other.s = __shfl_xor_sync(0xffffffffu, s, o);
      Merge(other, inv_t);
    }
  }
  __device__ __forceinline__ double Value(double t) const {
    return static_cast<double>(m) / t + log(s);
  }
};

// The greedy argmax over four consecutive entries v .. v + 3: exact float compares (a greedy
// score is the float logit widened), NaN as -inf, ties to the lower index, as ArgMax::Offer.
__device__ __forceinline__ void OfferMax4(float& best, int& idx, float4 x, int v, int nvalid) {
  const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float xv = xs[j] == xs[j] ? xs[j] : -kInfF;
    if (j < nvalid && (xv > best || (xv == best && v + j < idx))) {
      best = xv;
      idx = v + j;
    }
  }
}

// The sampled-score argmax over four consecutive vocabulary entries 4q .. 4q + 3:
// score = double(x) / double(T) + gumbel(word), with the float pre-filter described above.
// `x` holds the raw logits (invalid entries -inf, and `valid` masks them out entirely).
__device__ __forceinline__ void OfferGumbel4(ArgMax& am, float& best_f, float4 x, int v0, int nvalid,
                                             float inv_t, double t, const PhiloxKey& key,
                                             uint32_t purpose, uint32_t position) {
  const float xs[4] = {x.x, x.y, x.z, x.w};
  const float mx = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));  // NaN only if all four are NaN
  if (!(mx > -kInfF)) {
    // Every score is -inf (masked or NaN logits): no noise needed; they matter only for the
    // lowest-index rule while nothing finite has been seen.
    if (best_f == -kInfF) {
      for (int j = 0; j < nvalid; ++j) am.Offer(-kInfD, v0 + j);
    }
    return;
  }
  // Even the largest possible Gumbel cannot lift any of the four above the best: skip Philox.
  const float mt = mx * inv_t;
  if (mt + kGumbelMax + ScoreMargin(mt) < best_f) return;
  const uint4 w4 = PhiloxQuad(key, purpose, position, static_cast<uint32_t>(v0) >> 2);
  const uint32_t ws[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (j < nvalid) {
      if (!(xs[j] > -kInfF)) {  // -inf or NaN: score -inf whatever the noise
        if (best_f == -kInfF) am.Offer(-kInfD, v0 + j);
        continue;
      }
      const float sf = xs[j] * inv_t + GumbelApprox(ws[j]);
      if (!(sf + ScoreMargin(sf) < best_f)) {
        am.Offer(static_cast<double>(xs[j]) / t + GumbelExact(ws[j]), v0 + j);
        // best_f may come from another lane's offer (a seed): never lower it. Its float rounding
        // may lie above the exact best by half an ulp; ScoreMargin covers that.
        best_f = fmaxf(best_f, static_cast<float>(am.best));
      }
    }
  }
}

}  // namespace dspark::cuda
