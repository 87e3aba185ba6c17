// rejection_sample on the CPU: lossless acceptance for a batch (reference.py::rejection_sample).
//
// One request per work item. Nothing of size V is materialised: row k's softmax is known
// through its log-sum-exp alone (one pass), P_k(x) and q_k(x) are single exps, and only the
// final emit makes one more pass over V (the residual max(0, P - q), or the bonus row) with
// the pruned Gumbel-max scan of kernel_util.h. All scores are float64, like the reference's.
// Target logits may be bfloat16 under float32 drafts (widened on load, exactly). Every verified
// row is checked for NaN / +inf first (the request's `failed`): one branch-free pass per row,
// the bytes a separate check over the logits would read, spread over the request's thread.
// A sampled draft row whose q is not finite (a drafter's NaN / inf) is rejected in full before
// its acceptance test, and its residual is P itself: the output law stays the target's.
// A grammar's token bitmask (null: none) is applied as each target row is read: a forbidden
// entry reads as -inf everywhere (Load), so every rule below runs on P' = P * mask / Z.
#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/kernel_util.h"
#include "rejection_sample.h"

namespace dspark {
namespace {
using namespace cpu;

constexpr int64_t kSlice = 512;  // elements per pass slice (a multiple of 4: Philox blocks)

// Entry v of a target row as the rules read it: widened, -inf where the mask row forbids it.
template <class T>
DSPARK_ALWAYS_INLINE double Load(const T* row, const int32_t* mask, int64_t v) {
  return TokenAllowed(mask, v) ? static_cast<double>(Widen(row[v]))
                               : -std::numeric_limits<double>::infinity();
}

template <class T>
DSPARK_ALWAYS_INLINE int64_t RowArgmax(const T* row, const int32_t* mask, int64_t V) {
  ArgPart a;
  for (int64_t v = 0; v < V; ++v) a.Offer(Load(row, mask, v), v);
  return a.Index();
}

// logsumexp(row / t) over V, slice partials merged in order.
template <class T>
DSPARK_ALWAYS_INLINE double RowLse(const T* row, const int32_t* mask, int64_t V, double t) {
  double zt[kSlice], w[kSlice];
  LsePart total;
  for (int64_t v0 = 0; v0 < V; v0 += kSlice) {
    const int64_t n = std::min(kSlice, V - v0);
    for (int64_t j = 0; j < n; ++j) zt[j] = Load(row, mask, v0 + j) / t;
    total.Merge(LseSlice(zt, n, w));
  }
  return total.Value();
}

// argmax_v(row[v] / t + gumbel(site, v)): the bonus token, or a coupled row's token.
template <class T>
DSPARK_ALWAYS_INLINE int64_t EmitFromRow(const NoiseSite& site, const T* row, const int32_t* mask,
                                         int64_t V, double t) {
  double zt[kSlice], w[kSlice];
  ArgPart best;
  for (int64_t v0 = 0; v0 < V; v0 += kSlice) {
    const int64_t n = std::min(kSlice, V - v0);
    for (int64_t j = 0; j < n; ++j) zt[j] = Load(row, mask, v0 + j) / t;
    const LsePart part = LseSlice(zt, n, w);
    GumbelArgmax(site.key, site.purpose, site.position, v0, n, w, part.m,
                 [&](int64_t j) { return zt[j]; }, best);
  }
  return best.Index();
}

// argmax_v(log max(0, P(v) - q(v)) + gumbel(emit, position, v)) with
// P = exp(row / t - lse_p), q = exp(draft / t - lse_q): the token after a rejection. A draft
// row rejected in full (q not finite) passes draft = nullptr: q = 0, the residual is P.
template <class T, class D>
DSPARK_ALWAYS_INLINE int64_t EmitFromResidual(const PhiloxKey& key, uint32_t position,
                                              const T* row, const int32_t* mask, double lse_p,
                                              const D* draft, double lse_q, int64_t V, double t) {
  double resid[kSlice];
  ArgPart best;
  for (int64_t v0 = 0; v0 < V; v0 += kSlice) {
    const int64_t n = std::min(kSlice, V - v0);
    for (int64_t j = 0; j < n; ++j) {
      const double pv = ExpD(Load(row, mask, v0 + j) / t - lse_p);
      const double qv = draft ? ExpD(static_cast<double>(draft[v0 + j]) / t - lse_q) : 0.0;
      const double d = pv - qv;
      resid[j] = d > 0.0 ? d : 0.0;  // NaN -> 0: log 0 = -inf never wins, like NaN
    }
    // Weights are the residuals themselves (c = 0): exp(log resid - B) = resid * exp(-B).
    GumbelArgmax(key, kPurposeEmit, position, v0, n, resid, 0.0,
                 [&](int64_t j) { return std::log(resid[j]); }, best);
  }
  return best.Index();
}

// Whether a row holds NaN or +inf (its maximum is then not below +inf), or, under a mask,
// allows no token at all. One branch-free pass.
template <class T>
DSPARK_ALWAYS_INLINE bool RowFails(const T* row, const int32_t* mask, int64_t V) {
  bool bad = false;
  if (!mask) {
    for (int64_t v = 0; v < V; ++v) bad |= !(Widen(row[v]) < std::numeric_limits<float>::infinity());
    return bad;
  }
  bool any = false;
  for (int64_t v = 0; v < V; ++v) {
    const bool ok = TokenAllowed(mask, v);
    any |= ok;
    bad |= ok & !(Widen(row[v]) < std::numeric_limits<float>::infinity());
  }
  return bad | !any;
}

// Whether a draft row's q = exp(z / t - lse) is not finite: lse NaN or +-inf, or z holding
// NaN or +inf (-inf is a masked entry). Such a row is a rejection, never a token (reference.py
// nonfinite_q). One branch-free pass, only over rows an acceptance test reaches.
template <class D>
DSPARK_ALWAYS_INLINE bool DraftRowFails(const D* z, double lse, int64_t V) {
  bool bad = !(std::fabs(lse) < std::numeric_limits<double>::infinity());
  for (int64_t v = 0; v < V; ++v) bad |= !(static_cast<double>(z[v]) < std::numeric_limits<double>::infinity());
  return bad;
}

// Request r: target rows of element type T (float, double or bfloat16 bits), draft logits and
// draft_lse of type D (float64 iff the target's is).
template <class T, class D>
DSPARK_ALWAYS_INLINE void RequestImpl(const RejectionSampleParams& p, int64_t r) {
  const int64_t V = p.V, gamma = p.gamma;
  const int64_t lo = p.cu_rows[r], ell = p.cu_rows[r + 1] - lo - 1;
  const T* rows = static_cast<const T*>(p.target_logits) + lo * V;
  const int64_t words = (V + 31) / 32;
  // the mask row of target row k (null: no grammar)
  auto mask = [&](int64_t k) { return p.token_bitmask ? p.token_bitmask + (lo + k) * words : nullptr; };
  bool failed = false;
  for (int64_t k = 0; k <= ell; ++k) failed |= RowFails(rows + k * V, mask(k), V);
  p.failed[r] = failed;
  const int64_t* drafts = p.draft_tokens + r * gamma;
  int64_t* out = p.out_tokens + r * (gamma + 1);
  int64_t a = 0, y = 0;
  if (p.temperature[r] == 0.0f) {
    while (a < ell && drafts[a] == RowArgmax(rows + a * V, mask(a), V)) ++a;
    y = RowArgmax(rows + a * V, mask(a), V);
  } else if (p.coupled && p.coupled[r]) {
    // Coupled (DESIGN §2): y_k = argmax(row_{k-1} / T + g_{n0+k}), the draft shares the noise;
    // accept x_k iff it equals y_k, and y at the first disagreement (or after l) is emitted.
    const double t = static_cast<double>(p.temperature[r]);
    const PhiloxKey key{p.seed[r], static_cast<uint32_t>(p.stream[r]),
                        static_cast<uint32_t>(p.round[r])};
    for (;; ++a) {
      y = EmitFromRow(SiteOf(key, true, 0, a + 1), rows + a * V, mask(a), V, t);
      if (a == ell || drafts[a] != y) break;
    }
  } else {
    const double t = static_cast<double>(p.temperature[r]);
    const PhiloxKey key{p.seed[r], static_cast<uint32_t>(p.stream[r]),
                        static_cast<uint32_t>(p.round[r])};
    bool rejected = false;
    for (; a < ell; ++a) {
      const T* row = rows + a * V;
      const D* draft = static_cast<const D*>(p.draft_logits) + (r * gamma + a) * V;
      const double lse_q = static_cast<double>(static_cast<const D*>(p.draft_lse)[r * gamma + a]);
      const double lse_p = RowLse(row, mask(a), V, t);
      const int64_t x = drafts[a];
      const uint32_t pos = static_cast<uint32_t>(a + 1);
      if (DraftRowFails(draft, lse_q, V)) {  // rejected in full: y ~ P itself
        y = EmitFromResidual<T, D>(key, pos, row, mask(a), lse_p, nullptr, lse_q, V, t);
        rejected = true;
        break;
      }
      const double px = std::exp(Load(row, mask(a), x) / t - lse_p);  // 0 where forbidden
      const double qx = std::exp(static_cast<double>(draft[x]) / t - lse_q);
      const double u = WordToUniform(PhiloxWord(key, kPurposeAccept, pos, 0));
      if (u * qx < px) continue;
      y = EmitFromResidual(key, pos, row, mask(a), lse_p, draft, lse_q, V, t);
      rejected = true;
      break;
    }
    if (!rejected) y = EmitFromRow(SiteOf(key, false, kPurposeEmit, ell + 1), rows + ell * V, mask(ell), V, t);
  }
  std::copy(drafts, drafts + a, out);
  out[a] = y;
  std::fill(out + a + 1, out + gamma + 1, int64_t{-1});
  p.num_accepted[r] = static_cast<int32_t>(a);
}

DSPARK_CPU_CLONES void Request32(const RejectionSampleParams& p, int64_t r) {
  RequestImpl<float, float>(p, r);
}
DSPARK_CPU_CLONES void Request64(const RejectionSampleParams& p, int64_t r) {
  RequestImpl<double, double>(p, r);
}
DSPARK_CPU_CLONES void RequestBf16(const RejectionSampleParams& p, int64_t r) {
  RequestImpl<uint16_t, float>(p, r);
}

Status Validate(const RejectionSampleParams& p) {
  if (p.R < 0 || p.gamma < 0 || p.V < 0) return Status::kBadArgument;
  const bool same = p.dtype == p.draft_dtype &&
                    (p.dtype == DType::kFloat32 || p.dtype == DType::kFloat64);
  if (!same && !(p.dtype == DType::kBFloat16 && p.draft_dtype == DType::kFloat32)) {
    return Status::kUnsupported;
  }
  if (p.lse_dtype != p.draft_dtype) return Status::kBadArgument;  // the draft logits' type
  if (p.R == 0) return Status::kOk;
  if (p.V < 1 || !p.target_logits || !p.cu_rows || !p.temperature || !p.seed || !p.stream ||
      !p.round || !p.num_accepted || !p.out_tokens || !p.failed) {
    return Status::kBadArgument;
  }
  if (p.gamma > 0 && (!p.draft_tokens || !p.draft_logits || !p.draft_lse)) {
    return Status::kBadArgument;
  }
  if (p.cu_rows[0] != 0) return Status::kBadArgument;
  for (int64_t r = 0; r < p.R; ++r) {
    const int64_t rows = int64_t{p.cu_rows[r + 1]} - p.cu_rows[r];
    if (rows < 1 || rows > p.gamma + 1) return Status::kBadArgument;
    for (int64_t k = 0; k + 1 < rows; ++k) {
      const int64_t x = p.draft_tokens[r * p.gamma + k];
      if (x < 0 || x >= p.V) return Status::kBadArgument;
    }
  }
  return Status::kOk;
}

}  // namespace

Status RejectionSampleCpu(const RejectionSampleParams& p) {
  const Status s = Validate(p);
  if (s != Status::kOk || p.R == 0) return s;
  const bool par = p.V * (p.gamma + 1) > (1 << 12);
  if (p.dtype == DType::kFloat64) {
    ParallelFor(p.R, par, [&](int64_t r) { Request64(p, r); });
  } else if (p.dtype == DType::kBFloat16) {
    ParallelFor(p.R, par, [&](int64_t r) { RequestBf16(p, r); });
  } else {
    ParallelFor(p.R, par, [&](int64_t r) { Request32(p, r); });
  }
  return Status::kOk;
}

}  // namespace dspark
