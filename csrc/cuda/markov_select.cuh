// markov_sample's selector head on the GPU (DFlash2's candidate selector; markov_select.cu).
// Semantics: reference.markov_sample, head "selector". Called by MarkovSampleCuda once the
// common arguments are checked.
#pragma once
#include <cuda_runtime.h>

#include "markov_sample.h"

namespace dspark::cuda {

// Largest top_k the kernels take (per-warp candidate lists live in registers, 8 per lane);
// above it MarkovSelectLaunch returns kUnsupported.
constexpr int kSelectMaxTopK = 256;
// Largest rank: e and g * e of a request live in static shared arrays of the step kernel.
constexpr int kSelectMaxRank = 1024;

// The whole selector drafting stage (top-k candidates, gate, bias, sampling) for p.R requests
// and p.gamma steps on `stream`, logits T and weights W (the pairs MarkovSampleCuda dispatches:
// W = T, or bf16 / fp16 weights under float32 logits; instantiated in markov_select.cu).
template <class T, class W>
Status MarkovSelectLaunch(const MarkovSampleParams& p, cudaStream_t stream);

}  // namespace dspark::cuda
