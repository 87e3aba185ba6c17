// prefix_topk on the CPU: verify lengths of the top-K draft candidates
// (reference.py::prefix_topk).
//
// Candidates are keyed j-major (key j * R + r) and ordered by survival descending, then key
// ascending: a strict total order, so the admitted set is unique and nth_element (linear time)
// finds it without a full sort. NaN counts as -inf.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "prefix_topk.h"

namespace dspark {

Status PrefixTopkCpu(const PrefixTopkParams& p) {
  if (p.R < 0 || p.gamma < 0 || p.K < 0) return Status::kBadArgument;
  if (p.R == 0) return Status::kOk;
  if (!p.lengths || (p.gamma > 0 && !p.survival)) return Status::kBadArgument;
  const int64_t R = p.R, gamma = p.gamma, n = R * gamma;
  const int64_t K = std::min(p.K, n);
  if (K == n) {  // everything admitted (also gamma = 0)
    std::fill(p.lengths, p.lengths + R, static_cast<int32_t>(gamma));
    return Status::kOk;
  }
  struct Cand {
    float a;
    int64_t key;
  };
  std::vector<Cand> cand(n);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < gamma; ++j) {
      const float a = p.survival[r * gamma + j];
      cand[j * R + r] = {std::isnan(a) ? -std::numeric_limits<float>::infinity() : a,
                         j * R + r};
    }
  }
  auto before = [](const Cand& x, const Cand& y) {
    return x.a > y.a || (x.a == y.a && x.key < y.key);
  };
  if (K > 0) std::nth_element(cand.begin(), cand.begin() + (K - 1), cand.end(), before);
  std::vector<char> admitted(n, 0);  // j-major, like the keys
  for (int64_t i = 0; i < K; ++i) admitted[cand[i].key] = 1;
  for (int64_t r = 0; r < R; ++r) {
    int32_t l = 0;
    while (l < gamma && admitted[l * R + r]) ++l;
    p.lengths[r] = l;
  }
  return Status::kOk;
}

}  // namespace dspark
