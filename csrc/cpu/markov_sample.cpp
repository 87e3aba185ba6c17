// markov_sample on the CPU: the sequential drafting stage (reference.py::markov_sample).
//
// Per step k, for all requests at once:
//   1. head step (per request): e = w1[x_{k-1}], the rank-vector u the head projects
//      (e, g * e or tanh(o)), the RNN state update and the confidence logit;
//   2. one sweep over V in fixed slices of kSlice rows of w2: for every request of the batch,
//      z[v] = U[v] + dot(w2[v, :], u) is written back, and the same pass keeps the slice's
//      log-sum-exp partial of z / T and its argmax of z / T + gumbel (or of z when greedy);
//      each w2 slice is read once per step for the whole batch and nothing of size V x rank
//      is materialised;
//   3. per request, the slice partials merge in slice order (thread-count independent) into
//      x_k, lse_k and logprob_k.
// A grammar's token bitmask (p.token_bitmask, null: none) masks step 1 only: its forbidden
// entries of z are set to -inf in the sweep, before the slice's partials, so x_1, lse_1 and
// the z the acceptance reads back all describe the masked proposal.
// Dot products accumulate in T: for float32 the reference itself forms the bias with a float32
// GEMM, so a double accumulator would not bring the two closer than their float32 rounding;
// float64 accumulates in double.
// The selector head (DFlash2's candidate selector) has no sweep: each row's top_k candidates of
// U are chosen before the first step (U does not depend on the drafted tokens), the row is set
// to -inf, and each step scores, normalises and samples only the candidates.
// bfloat16 weights under float32 logits (weight_dtype != dtype) are widened on load: the small
// head weights and hidden once per call, w1 one row per request and step, w2 in registers as
// the sweep streams it (2 bytes per element). The projected vector u is rounded to bfloat16
// first, as the reference and the CUDA kernel do.
// Out of place (p.u): U is copied into z first, widened exactly from bfloat16 where it is in the
// weight dtype, and the stage then runs in place on z.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/kernel_util.h"
#include "markov_sample.h"

namespace dspark {
namespace {
using namespace cpu;

constexpr int64_t kSlice = 512;  // V rows of w2 per work item (a multiple of 4: Philox blocks)

// src [n] as T: src itself when the weights are in T, else bfloat16 widened into buf.
template <class T>
const T* Widened(const void* src, int64_t n, bool widen, std::vector<T>& buf) {
  if (!widen || !src) return static_cast<const T*>(src);
  const uint16_t* b = static_cast<const uint16_t*>(src);
  buf.resize(n);
  for (int64_t i = 0; i < n; ++i) buf[i] = Bf16ToFloat(b[i]);
  return buf.data();
}

template <class T>
struct Ctx {
  const MarkovSampleParams& p;
  T* logits;
  const T *hidden, *gate_w, *gate_b, *joint_w, *joint_b, *conf_w, *conf_b;
  const void *w1, *w2;        // in the weight dtype
  bool widen = false;         // weights are bfloat16, T is float
  std::vector<T> widened[7];  // owners of the widened small weights
  std::vector<T> e;           // [R, rank] w1[x_{k-1}] widened (widen only)
  std::vector<int64_t> prev;  // [R] x_{k-1}
  std::vector<T> proj;        // [R, rank] the vector w2 projects this step
  std::vector<T> state;       // [R, rank] RNN state
  std::vector<T> gates;       // [R, 3 rank] RNN pre-activations
  std::vector<LsePart> lse;   // [R, n_slices]
  std::vector<ArgPart> arg;   // [R, n_slices]
  int64_t n_slices = 0;
  std::vector<int64_t> cand;  // selector: [R, gamma, top_k] candidates, ascending index
  std::vector<T> cand_u;      // selector: U at the candidates

  explicit Ctx(const MarkovSampleParams& q) : p(q) {}
  PhiloxKey Key(int64_t r) const {
    return PhiloxKey{p.seed[r], static_cast<uint32_t>(p.stream[r]),
                     static_cast<uint32_t>(p.round[r])};
  }
  double Temp(int64_t r) const {  // 1 for greedy rows, as the reference's Tsafe
    const double t = static_cast<double>(p.temperature[r]);
    return t == 0.0 ? 1.0 : t;
  }
};

// Step 1 for request r at step k.
template <class T>
DSPARK_ALWAYS_INLINE void HeadStepImpl(Ctx<T>& c, int64_t r, int64_t k) {
  const MarkovSampleParams& p = c.p;
  const int64_t rank = p.rank, d = p.d;
  const T* h = c.hidden + (r * p.gamma + k) * d;
  const T* e = static_cast<const T*>(c.w1);
  if (e && c.widen) {
    T* row = c.e.data() + r * rank;
    const uint16_t* src = static_cast<const uint16_t*>(c.w1) + c.prev[r] * rank;
    for (int64_t i = 0; i < rank; ++i) row[i] = Bf16ToFloat(src[i]);
    e = row;
  } else if (e) {
    e += c.prev[r] * rank;
  }
  T* u = c.proj.data() + r * rank;
  switch (p.head) {
    case MarkovHead::kNone:
      break;
    case MarkovHead::kVanilla:
      std::copy(e, e + rank, u);
      break;
    case MarkovHead::kGated:  // g = sigmoid(gate_w [h; e] + gate_b); u = g * e
      for (int64_t i = 0; i < rank; ++i) {
        const T* row = c.gate_w + i * (d + rank);
        const T a = Dot(row, h, d) + Dot(row + d, e, rank) + c.gate_b[i];
        u[i] = Sigmoid(a) * e[i];
      }
      break;
    case MarkovHead::kSelector:  // g = gate_w h (no bias); u = g * e
      for (int64_t i = 0; i < rank; ++i) u[i] = Dot(c.gate_w + i * d, h, d) * e[i];
      break;
    case MarkovHead::kRnn: {  // a = joint_w [s; e; h] + joint_b = (gate, cand, out)
      T* s = c.state.data() + r * rank;
      T* a = c.gates.data() + r * 3 * rank;
      for (int64_t i = 0; i < 3 * rank; ++i) {
        const T* row = c.joint_w + i * (2 * rank + d);
        a[i] = Dot(row, s, rank) + Dot(row + rank, e, rank) + Dot(row + 2 * rank, h, d) +
               c.joint_b[i];
      }
      for (int64_t i = 0; i < rank; ++i) {  // every a[] used the old state; update it now
        const T sg = Sigmoid(a[i]);
        s[i] = sg * s[i] + (T(1) - sg) * std::tanh(a[rank + i]);
        u[i] = std::tanh(a[2 * rank + i]);
      }
      break;
    }
  }
  if (c.widen && p.head != MarkovHead::kNone) {  // the projection reads u in the weight dtype
    for (int64_t i = 0; i < rank; ++i) u[i] = RoundToBf16(static_cast<float>(u[i]));
  }
  if (p.confidence) {
    T cl = Dot(c.conf_w, h, d) + c.conf_b[0];
    if (p.confidence_markov) cl += Dot(c.conf_w + d, e, rank);
    static_cast<T*>(p.conf_logit)[r * p.gamma + k] = cl;
  }
}

// z[j] += dot(w2[j, :], u) for the n rows of a slice (w2 in T, or bfloat16 widened on load).
template <class W, class T>
DSPARK_ALWAYS_INLINE void AddBias(const W* w2, const T* u, T* z, int64_t n, int64_t rank) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    T b[8];
    DotRows8(w2 + j * rank, rank, u, rank, b);
    for (int l = 0; l < 8; ++l) z[j + l] = z[j + l] + b[l];
  }
  for (; j < n; ++j) z[j] = z[j] + Dot(w2 + j * rank, u, rank);
}

// Step 2 for slice `sl` of V at step k, all requests.
template <class T>
DSPARK_ALWAYS_INLINE void SliceImpl(Ctx<T>& c, int64_t sl, int64_t k) {
  const MarkovSampleParams& p = c.p;
  const int64_t v0 = sl * kSlice, n = std::min(kSlice, p.V - v0), rank = p.rank;
  const bool bias = p.head != MarkovHead::kNone;
  double zt[kSlice], w[kSlice];
  for (int64_t r = 0; r < p.R; ++r) {
    T* z = c.logits + (r * p.gamma + k) * p.V + v0;
    const T* u = c.proj.data() + r * rank;
    if (bias && !c.widen) AddBias(static_cast<const T*>(c.w2) + v0 * rank, u, z, n, rank);
    if constexpr (std::is_same_v<T, float>) {  // bfloat16 w2 under float32 logits
      if (bias && c.widen) AddBias(static_cast<const uint16_t*>(c.w2) + v0 * rank, u, z, n, rank);
    }
    if (k == 0 && p.token_bitmask) {  // the grammar's mask of draft position 1: z = -inf off it
      const int32_t* m = p.token_bitmask + r * ((p.V + 31) / 32);
      for (int64_t j = 0; j < n; ++j) {
        if (!TokenAllowed(m, v0 + j)) z[j] = -std::numeric_limits<T>::infinity();
      }
    }
    const bool greedy = p.temperature[r] == 0.0f;
    // z / T in double by division, exactly as the reference forms it (scores must agree).
    const double t = c.Temp(r);
    for (int64_t j = 0; j < n; ++j) zt[j] = static_cast<double>(z[j]) / t;
    const LsePart part = LseSlice(zt, n, w);
    ArgPart best;
    if (greedy) {
      for (int64_t j = 0; j < n; ++j) best.Offer(zt[j], v0 + j);
    } else {
      const NoiseSite site = SiteOf(c.Key(r), p.coupled && p.coupled[r], kPurposeDraft, k + 1);
      GumbelArgmax(site.key, site.purpose, site.position, v0, n, w, part.m,
                   [&](int64_t j) { return zt[j]; }, best);
    }
    c.lse[r * c.n_slices + sl] = part;
    c.arg[r * c.n_slices + sl] = best;
  }
}

// Selector: the top_k candidates of row `row` of U (NaN ranks as -inf; equal values keep the
// lower index), stored in ascending index order with their U values; the row becomes -inf.
template <class T>
void SelectCandidates(Ctx<T>& c, int64_t row) {
  const int64_t V = c.p.V, K = c.p.top_k;
  T* z = c.logits + row * V;
  int64_t* out = c.cand.data() + row * K;
  auto key = [](T x) { return x != x ? -std::numeric_limits<double>::infinity() : double(x); };
  if (K >= V) {
    for (int64_t v = 0; v < V; ++v) out[v] = v;
  } else {
    // A running top-K list in rank order; a later index displaces only a strictly larger value.
    std::vector<std::pair<double, int64_t>> top;
    top.reserve(K + 1);
    for (int64_t v = 0; v < V; ++v) {
      const double x = key(z[v]);
      if (static_cast<int64_t>(top.size()) == K && !(x > top.back().first)) continue;
      auto at = std::upper_bound(top.begin(), top.end(), x,
                                 [](double a, const std::pair<double, int64_t>& b) { return a > b.first; });
      top.insert(at, {x, v});
      if (static_cast<int64_t>(top.size()) > K) top.pop_back();
    }
    for (int64_t j = 0; j < K; ++j) out[j] = top[j].second;
    std::sort(out, out + K);
  }
  T* u = c.cand_u.data() + row * K;
  for (int64_t j = 0; j < K; ++j) u[j] = z[out[j]];
  std::fill(z, z + V, -std::numeric_limits<T>::infinity());
}

// Selector step k of request r after HeadStep: z on the candidates, x_k, lse_k, logprob_k.
template <class T>
DSPARK_ALWAYS_INLINE void SelectorStepImpl(Ctx<T>& c, int64_t r, int64_t k) {
  const MarkovSampleParams& p = c.p;
  const int64_t K = p.top_k, rank = p.rank, row = r * p.gamma + k;
  const int64_t* cand = c.cand.data() + row * K;
  const T* cu = c.cand_u.data() + row * K;
  const T* u = c.proj.data() + r * rank;
  T* z = c.logits + row * p.V;
  std::vector<double> zt(K), w(K);
  const double t = c.Temp(r);
  for (int64_t j = 0; j < K; ++j) {
    const int64_t v = cand[j];
    const T b = c.widen ? Dot(static_cast<const uint16_t*>(c.w2) + v * rank, u, rank)
                        : Dot(static_cast<const T*>(c.w2) + v * rank, u, rank);
    z[v] = cu[j] + b;
    if (k == 0 && p.token_bitmask && !TokenAllowed(p.token_bitmask + r * ((p.V + 31) / 32), v)) {
      z[v] = -std::numeric_limits<T>::infinity();  // the grammar's mask of draft position 1
    }
    zt[j] = static_cast<double>(z[v]) / t;
  }
  const LsePart part = LseSlice(zt.data(), K, w.data());
  ArgPart best;
  if (p.temperature[r] == 0.0f) {
    for (int64_t j = 0; j < K; ++j) best.Offer(zt[j], cand[j]);
  } else {
    const NoiseSite site = SiteOf(c.Key(r), p.coupled && p.coupled[r], kPurposeDraft, k + 1);
    uint32_t words[4];
    for (int64_t j = 0; j < K; ++j) {
      const int64_t v = cand[j];
      PhiloxBlock(site.key, site.purpose, site.position, static_cast<uint64_t>(v) >> 2, words);
      best.Offer(zt[j] + -std::log(-std::log(WordToUniform(words[v & 3]))), v);
    }
  }
  const int64_t x = best.Index();
  const double lv = part.Value();
  p.tokens[row] = x;
  static_cast<T*>(p.lse)[row] = static_cast<T>(lv);
  static_cast<T*>(p.logprob)[row] = static_cast<T>(static_cast<double>(z[x]) / t - lv);
  c.prev[r] = x;
}

DSPARK_CPU_CLONES void SelectorStep(Ctx<float>& c, int64_t r, int64_t k) { SelectorStepImpl(c, r, k); }
DSPARK_CPU_CLONES void SelectorStep(Ctx<double>& c, int64_t r, int64_t k) { SelectorStepImpl(c, r, k); }
DSPARK_CPU_CLONES void HeadStep(Ctx<float>& c, int64_t r, int64_t k) { HeadStepImpl(c, r, k); }
DSPARK_CPU_CLONES void HeadStep(Ctx<double>& c, int64_t r, int64_t k) { HeadStepImpl(c, r, k); }
DSPARK_CPU_CLONES void Slice(Ctx<float>& c, int64_t sl, int64_t k) { SliceImpl(c, sl, k); }
DSPARK_CPU_CLONES void Slice(Ctx<double>& c, int64_t sl, int64_t k) { SliceImpl(c, sl, k); }

template <class T>
Status Run(const MarkovSampleParams& p) {
  Ctx<T> c(p);
  const int64_t R = p.R, rank = p.rank, d = p.d;
  const bool wd = c.widen = p.weight_dtype != p.dtype;
  c.logits = static_cast<T*>(p.logits);
  if (p.u && p.u != p.logits) {
    const int64_t V = p.V;
    ParallelFor(R * p.gamma, R * p.gamma * V > (1 << 16), [&](int64_t row) {
      T* z = c.logits + row * V;
      if (p.u_dtype == p.dtype) {
        std::memcpy(z, static_cast<const T*>(p.u) + row * V, sizeof(T) * V);
      } else {
        const uint16_t* u = static_cast<const uint16_t*>(p.u) + row * V;
        for (int64_t v = 0; v < V; ++v) z[v] = static_cast<T>(Bf16ToFloat(u[v]));
      }
    });
  }
  c.w1 = p.w1;
  c.w2 = p.w2;
  c.hidden = Widened<T>(p.hidden, R * p.gamma * d, wd, c.widened[0]);
  const bool selector = p.head == MarkovHead::kSelector;
  c.gate_w = Widened<T>(p.gate_w, rank * (selector ? d : d + rank), wd, c.widened[1]);
  c.gate_b = Widened<T>(p.gate_b, rank, wd, c.widened[2]);
  c.joint_w = Widened<T>(p.joint_w, 3 * rank * (2 * rank + d), wd, c.widened[3]);
  c.joint_b = Widened<T>(p.joint_b, 3 * rank, wd, c.widened[4]);
  c.conf_w = Widened<T>(p.conf_w, d + (p.confidence_markov ? rank : 0), wd, c.widened[5]);
  c.conf_b = Widened<T>(p.conf_b, 1, wd, c.widened[6]);
  c.e.assign(wd ? R * rank : 0, T(0));
  c.prev.assign(p.anchor, p.anchor + R);
  c.proj.assign(R * rank, T(0));
  c.state.assign(p.head == MarkovHead::kRnn ? R * rank : 0, T(0));
  c.gates.assign(p.head == MarkovHead::kRnn ? R * 3 * rank : 0, T(0));
  c.n_slices = (p.V + kSlice - 1) / kSlice;
  c.lse.resize(R * c.n_slices);
  c.arg.resize(R * c.n_slices);
  T* logprob = static_cast<T*>(p.logprob);
  T* lse = static_cast<T*>(p.lse);
  T* conf = static_cast<T*>(p.conf_logit);
  if (!p.confidence) std::fill(conf, conf + R * p.gamma, T(0));

  if (selector) {
    c.cand.resize(R * p.gamma * p.top_k);
    c.cand_u.resize(R * p.gamma * p.top_k);
    ParallelFor(R * p.gamma, R * p.gamma * p.V > (1 << 16), [&](int64_t row) { SelectCandidates(c, row); });
    const bool par = R * rank * (p.d + p.top_k) > (1 << 16);
    for (int64_t k = 0; k < p.gamma; ++k) {
      ParallelFor(R, par, [&](int64_t r) {
        HeadStep(c, r, k);
        SelectorStep(c, r, k);
      });
    }
    return Status::kOk;
  }
  int64_t head_work = 0;  // multiply-adds of one head step, to decide whether to fan out
  if (p.head == MarkovHead::kGated) head_work = rank * (p.d + rank);
  if (p.head == MarkovHead::kRnn) head_work = 3 * rank * (2 * rank + p.d);
  const bool par_slices = R * p.V * std::max<int64_t>(rank, 8) > (1 << 16);
  for (int64_t k = 0; k < p.gamma; ++k) {
    ParallelFor(R, R * head_work > (1 << 16), [&](int64_t r) { HeadStep(c, r, k); });
    ParallelFor(c.n_slices, par_slices, [&](int64_t sl) { Slice(c, sl, k); });
    for (int64_t r = 0; r < R; ++r) {
      LsePart l;
      ArgPart a;
      for (int64_t sl = 0; sl < c.n_slices; ++sl) {
        l.Merge(c.lse[r * c.n_slices + sl]);
        a.Merge(c.arg[r * c.n_slices + sl]);
      }
      const int64_t x = a.Index();
      const double lv = l.Value();
      const double zx = static_cast<double>(c.logits[(r * p.gamma + k) * p.V + x]) / c.Temp(r);
      p.tokens[r * p.gamma + k] = x;
      lse[r * p.gamma + k] = static_cast<T>(lv);
      logprob[r * p.gamma + k] = static_cast<T>(zx - lv);
      c.prev[r] = x;
    }
  }
  return Status::kOk;
}

Status Validate(const MarkovSampleParams& p) {
  if (p.R < 0 || p.gamma < 0 || p.V < 0 || p.rank < 0 || p.d < 0) return Status::kBadArgument;
  const int head = static_cast<int>(p.head);
  if (head < 0 || head > static_cast<int>(MarkovHead::kSelector)) return Status::kBadArgument;
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kFloat64) return Status::kUnsupported;
  if (p.weight_dtype != p.dtype &&
      !(p.dtype == DType::kFloat32 && p.weight_dtype == DType::kBFloat16)) {
    return Status::kUnsupported;
  }
  if (p.out_dtype != p.dtype) return Status::kBadArgument;  // float64 iff dtype is float64
  if (p.u && p.u_dtype != p.dtype && !(p.u_dtype == p.weight_dtype && p.weight_dtype != p.dtype)) {
    return Status::kUnsupported;  // U in the logits dtype, or in the (bf16) weight dtype
  }
  if (p.R == 0 || p.gamma == 0) return Status::kOk;
  if (p.V < 1 || !p.logits || !p.anchor || !p.temperature || !p.seed || !p.stream || !p.round ||
      !p.tokens || !p.logprob || !p.lse || !p.conf_logit || (p.d > 0 && !p.hidden)) {
    return Status::kBadArgument;
  }
  const bool needs_w = p.head != MarkovHead::kNone || p.confidence_markov;
  if (needs_w && (p.rank < 1 || !p.w1 || !p.w2)) return Status::kBadArgument;
  if (p.head == MarkovHead::kGated && (!p.gate_w || !p.gate_b)) return Status::kBadArgument;
  if (p.head == MarkovHead::kRnn && (!p.joint_w || !p.joint_b)) return Status::kBadArgument;
  if (p.head == MarkovHead::kSelector && ((p.d > 0 && !p.gate_w) || p.top_k < 1 || p.top_k > p.V)) {
    return Status::kBadArgument;
  }
  if (p.confidence && (!p.conf_b || (!p.conf_w && p.d + (p.confidence_markov ? p.rank : 0) > 0))) {
    return Status::kBadArgument;
  }
  if (p.confidence_markov && !p.confidence) return Status::kBadArgument;
  for (int64_t r = 0; r < p.R; ++r) {
    if (p.anchor[r] < 0 || p.anchor[r] >= p.V) return Status::kBadArgument;
  }
  return Status::kOk;
}

}  // namespace

Status MarkovSampleCpu(const MarkovSampleParams& p) {
  const Status s = Validate(p);
  if (s != Status::kOk || p.R == 0 || p.gamma == 0) return s;
  // Without a head and without the Markov confidence feature, w1 (if passed) is never read.
  MarkovSampleParams q = p;
  if (q.head == MarkovHead::kNone && !q.confidence_markov) q.rank = 0;
  return p.dtype == DType::kFloat64 ? Run<double>(q) : Run<float>(q);
}

}  // namespace dspark
