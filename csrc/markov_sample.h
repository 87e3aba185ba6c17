// markov_sample: the whole sequential drafting stage for R requests and gamma positions
// (DESIGN §2 steps 2-3). Semantics are defined by dspark_rt/ops/reference.py::markov_sample.
#pragma once
#include "common.h"

namespace dspark {

enum class MarkovHead : int { kNone = 0, kVanilla = 1, kGated = 2, kRnn = 3, kSelector = 4 };

struct MarkovSampleParams {
  int64_t R = 0, gamma = 0, V = 0;
  int64_t rank = 0;    // r: Markov rank (0 with head kNone)
  int64_t d = 0;       // hidden size of h_k
  MarkovHead head = MarkovHead::kNone;
  int64_t top_k = 0;   // kSelector: candidates per step (1 <= top_k <= V)
  bool confidence = false;         // a confidence head exists
  bool confidence_markov = false;  // its input is [h_k; W1[x_{k-1}]] instead of h_k
  DType dtype = DType::kFloat32;   // logits U / z: the compute dtype of the head
  DType weight_dtype = DType::kFloat32;  // hidden and every weight: dtype, or a 16-bit type under
                                         // float32 logits (a bf16 model's head, fp32 logits)
  DType out_dtype = DType::kFloat32;  // logprob, lse, conf_logit: float64 iff dtype is float64

  void* logits = nullptr;          // [R, gamma, V] in: base logits U; out: z = U + bias
                                   // (selector: -inf outside the step's top_k candidates)
  const void* u = nullptr;         // [R, gamma, V] or null: U is read from here and `logits`
                                   // only written (out of place; must not overlap it)
  DType u_dtype = DType::kFloat32; // of u: dtype, or the 16-bit weight_dtype under float32
                                   // logits (a 16-bit model's LM head output, widened on load)
  const void* hidden = nullptr;    // [R, gamma, d]
  const int64_t* anchor = nullptr; // [R] x0
  const void* w1 = nullptr;        // [V, rank]  markov_w1.weight (embedding)
  const void* w2 = nullptr;        // [V, rank]  markov_w2.weight (Linear rank -> V)
  const void* gate_w = nullptr;    // [rank, d + rank] gated head, input [h_k; e];
                                   // [rank, d] selector head (linear gate of h_k, no bias)
  const void* gate_b = nullptr;    // [rank]
  const void* joint_w = nullptr;   // [3 rank, rank + rank + d] rnn head, input [s; e; h_k]
  const void* joint_b = nullptr;   // [3 rank]
  const void* conf_w = nullptr;    // [d] or [d + rank]
  const void* conf_b = nullptr;    // [1]

  const float* temperature = nullptr;  // [R]; 0 means greedy
  const uint64_t* seed = nullptr;      // [R]
  const int64_t* stream = nullptr;     // [R] random stream id (philox.h)
  const int64_t* round = nullptr;      // [R] the request's round counter (coupled: n0)
  const uint8_t* coupled = nullptr;    // [R] nonzero: Gumbel-coupled rule, round = n0 the
                                       // tokens emitted so far (philox.h); null: none
  const int32_t* token_bitmask = nullptr;  // [R, ceil(V / 32)] draft position 1 of each request: bit v % 32 of
                                           // word v / 32 set = token v allowed (a grammar; null:
                                           // none); forbidden logits read as -inf

  int64_t* tokens = nullptr;       // [R, gamma] x_1..x_gamma
  void* logprob = nullptr;         // [R, gamma] log q_k(x_k)  (greedy: log softmax(z)(x_k))
  void* lse = nullptr;             // [R, gamma] logsumexp(z / T) (greedy: T = 1)
  void* conf_logit = nullptr;      // [R, gamma] raw confidence logit (0 without a head)
};

Status MarkovSampleCpu(const MarkovSampleParams& p);
Status MarkovSampleCuda(const MarkovSampleParams& p, void* stream);

}  // namespace dspark
