// The pybind11 module dspark_rt._C: the only file that knows Python.
//
// Each kernel family is exposed as its params struct (attributes named exactly as the C++
// fields; pointers travel as Python ints, enums as ints) plus one function
// `op(params, backend: str, stream: int)`. Launchers return a Status; this file turns anything
// but kOk into a Python exception naming the op (kBadArgument -> ValueError, else RuntimeError).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "append_kv.h"
#include "attn_split.h"
#include "common.h"
#include "linear.h"
#include "markov_sample.h"
#include "prefix_topk.h"
#include "rejection_sample.h"
#include "verify_attention.h"

#ifdef DSPARK_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;
using namespace dspark;

namespace {

// Pointer field <-> Python int (what torch's data_ptr() returns).
template <class S, class P>
void DefPtr(py::class_<S>& c, const char* name, P S::*field) {
  c.def_property(
      name, [field](const S& s) { return reinterpret_cast<uintptr_t>(s.*field); },
      [field](S& s, uintptr_t v) { s.*field = reinterpret_cast<P>(v); });
}

// Enum field <-> Python int, validated so a kernel never sees an out-of-range enum.
template <class S, class E>
void DefEnum(py::class_<S>& c, const char* cls, const char* name, E S::*field, int lo, int hi) {
  const std::string where = std::string(cls) + "." + name;
  c.def_property(
      name, [field](const S& s) { return static_cast<int>(s.*field); },
      [field, where, lo, hi](S& s, int v) {
        if (v < lo || v > hi) {
          throw py::value_error(where + " must be an int in [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "], got " + std::to_string(v));
        }
        s.*field = static_cast<E>(v);
      });
}

constexpr int kMaxDType = static_cast<int>(DType::kBFloat16);

// Raises on a non-kOk status, naming the op.
void Raise(const char* op, const std::string& backend, Status s) {
  if (s == Status::kOk) return;
  std::string msg = std::string(op) + " (" + backend + " backend): " + StatusString(s);
#ifdef DSPARK_WITH_CUDA
  if (s == Status::kCudaError) msg += std::string(": ") + cudaGetErrorString(cudaGetLastError());
#endif
  if (s == Status::kBadArgument) throw py::value_error(msg);
  throw std::runtime_error(msg);
}

// Runs one launcher with the GIL released and raises on a non-kOk status.
template <class P>
void Launch(const char* op, Status (*cpu)(const P&), Status (*cuda)(const P&, void*),
            const P& params, const std::string& backend, uintptr_t stream) {
  const P p = params;  // a private copy: Python may touch the object while the GIL is released
  Status s;
  if (backend == "cpp") {
    py::gil_scoped_release nogil;
    s = cpu(p);
  } else if (backend == "cuda") {
#ifdef DSPARK_WITH_CUDA
    py::gil_scoped_release nogil;
    s = cuda(p, reinterpret_cast<void*>(stream));
#else
    (void)cuda;
    throw std::runtime_error(std::string(op) + ": this build has no CUDA kernels");
#endif
  } else {
    throw py::value_error(std::string(op) + ": backend must be 'cpp' or 'cuda', got '" +
                          backend + "'");
  }
  Raise(op, backend, s);
}

#ifdef DSPARK_WITH_CUDA
#define DSPARK_CUDA_FN(f) (f)
#else
// Without CUDA the Cuda launchers are not compiled; Launch never calls this placeholder.
#define DSPARK_CUDA_FN(f) nullptr
#endif

py::dict BuildInfo() {
  py::dict d;
#ifdef DSPARK_VERSION_INFO
  d["version"] = std::string(DSPARK_VERSION_INFO);
#else
  d["version"] = std::string("");
#endif
#ifdef DSPARK_WITH_CUDA
  d["cuda"] = true;
  d["cuda_archs"] = std::string(DSPARK_CUDA_ARCHS_INFO);
  d["cuda_version"] = std::string(DSPARK_CUDA_VERSION_INFO);
#else
  d["cuda"] = false;
  d["cuda_archs"] = std::string("");
  d["cuda_version"] = std::string("");
#endif
#ifdef __VERSION__
  d["compiler"] = std::string(__VERSION__);
#else
  d["compiler"] = std::string("unknown");
#endif
#ifdef _OPENMP
  d["openmp"] = true;
#else
  d["openmp"] = false;
#endif
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dspark_rt kernels (C++ CPU, optional CUDA); use dspark_rt.ops, not this module";

  {
    using P = MarkovSampleParams;
    const char* cls = "MarkovSampleParams";
    py::class_<P> c(m, cls);
    c.def(py::init<>());
    c.def_readwrite("R", &P::R).def_readwrite("gamma", &P::gamma).def_readwrite("V", &P::V);
    c.def_readwrite("rank", &P::rank).def_readwrite("d", &P::d).def_readwrite("top_k", &P::top_k);
    DefEnum(c, cls, "head", &P::head, 0, static_cast<int>(MarkovHead::kSelector));
    c.def_readwrite("confidence", &P::confidence);
    c.def_readwrite("confidence_markov", &P::confidence_markov);
    DefEnum(c, cls, "dtype", &P::dtype, 0, kMaxDType);
    DefEnum(c, cls, "weight_dtype", &P::weight_dtype, 0, kMaxDType);
    DefEnum(c, cls, "out_dtype", &P::out_dtype, 0, kMaxDType);
    DefPtr(c, "logits", &P::logits);
    DefPtr(c, "u", &P::u);
    DefEnum(c, cls, "u_dtype", &P::u_dtype, 0, kMaxDType);
    DefPtr(c, "hidden", &P::hidden);
    DefPtr(c, "anchor", &P::anchor);
    DefPtr(c, "w1", &P::w1);
    DefPtr(c, "w2", &P::w2);
    DefPtr(c, "gate_w", &P::gate_w);
    DefPtr(c, "gate_b", &P::gate_b);
    DefPtr(c, "joint_w", &P::joint_w);
    DefPtr(c, "joint_b", &P::joint_b);
    DefPtr(c, "conf_w", &P::conf_w);
    DefPtr(c, "conf_b", &P::conf_b);
    DefPtr(c, "temperature", &P::temperature);
    DefPtr(c, "seed", &P::seed);
    DefPtr(c, "stream", &P::stream);
    DefPtr(c, "round", &P::round);
    DefPtr(c, "coupled", &P::coupled);
    DefPtr(c, "token_bitmask", &P::token_bitmask);
    DefPtr(c, "tokens", &P::tokens);
    DefPtr(c, "logprob", &P::logprob);
    DefPtr(c, "lse", &P::lse);
    DefPtr(c, "conf_logit", &P::conf_logit);
    m.def(
        "markov_sample",
        [](const P& p, const std::string& backend, uintptr_t stream) {
          Launch<P>("markov_sample", MarkovSampleCpu, DSPARK_CUDA_FN(MarkovSampleCuda), p,
                    backend, stream);
        },
        py::arg("params"), py::arg("backend"), py::arg("stream"));
  }

  {
    using P = RejectionSampleParams;
    const char* cls = "RejectionSampleParams";
    py::class_<P> c(m, cls);
    c.def(py::init<>());
    c.def_readwrite("R", &P::R).def_readwrite("gamma", &P::gamma).def_readwrite("V", &P::V);
    DefEnum(c, cls, "dtype", &P::dtype, 0, kMaxDType);
    DefEnum(c, cls, "draft_dtype", &P::draft_dtype, 0, kMaxDType);
    DefEnum(c, cls, "lse_dtype", &P::lse_dtype, 0, kMaxDType);
    DefPtr(c, "target_logits", &P::target_logits);
    DefPtr(c, "cu_rows", &P::cu_rows);
    DefPtr(c, "draft_tokens", &P::draft_tokens);
    DefPtr(c, "draft_logits", &P::draft_logits);
    DefPtr(c, "draft_lse", &P::draft_lse);
    DefPtr(c, "temperature", &P::temperature);
    DefPtr(c, "seed", &P::seed);
    DefPtr(c, "stream", &P::stream);
    DefPtr(c, "round", &P::round);
    DefPtr(c, "coupled", &P::coupled);
    DefPtr(c, "token_bitmask", &P::token_bitmask);
    DefPtr(c, "num_accepted", &P::num_accepted);
    DefPtr(c, "out_tokens", &P::out_tokens);
    DefPtr(c, "failed", &P::failed);
    m.def(
        "rejection_sample",
        [](const P& p, const std::string& backend, uintptr_t stream) {
          Launch<P>("rejection_sample", RejectionSampleCpu, DSPARK_CUDA_FN(RejectionSampleCuda),
                    p, backend, stream);
        },
        py::arg("params"), py::arg("backend"), py::arg("stream"));
  }

  {
    using P = PrefixTopkParams;
    py::class_<P> c(m, "PrefixTopkParams");
    c.def(py::init<>());
    c.def_readwrite("R", &P::R).def_readwrite("gamma", &P::gamma).def_readwrite("K", &P::K);
    DefPtr(c, "survival", &P::survival);
    DefPtr(c, "lengths", &P::lengths);
    m.def(
        "prefix_topk",
        [](const P& p, const std::string& backend, uintptr_t stream) {
          Launch<P>("prefix_topk", PrefixTopkCpu, DSPARK_CUDA_FN(PrefixTopkCuda), p, backend,
                    stream);
        },
        py::arg("params"), py::arg("backend"), py::arg("stream"));
  }

  {
    using P = VerifyAttentionParams;
    const char* cls = "VerifyAttentionParams";
    py::class_<P> c(m, cls);
    c.def(py::init<>());
    c.def_readwrite("R", &P::R).def_readwrite("h_q", &P::h_q).def_readwrite("h_kv", &P::h_kv);
    c.def_readwrite("head_dim", &P::head_dim).def_readwrite("page_size", &P::page_size);
    c.def_readwrite("num_pages", &P::num_pages).def_readwrite("max_pages", &P::max_pages);
    DefEnum(c, cls, "dtype", &P::dtype, 0, kMaxDType);
    c.def_readwrite("causal", &P::causal).def_readwrite("scale", &P::scale).def_readwrite("window", &P::window);
    DefPtr(c, "q", &P::q);
    DefPtr(c, "cu_q", &P::cu_q);
    DefPtr(c, "k_cache", &P::k_cache);
    DefPtr(c, "v_cache", &P::v_cache);
    DefPtr(c, "block_tables", &P::block_tables);
    DefPtr(c, "kv_lens", &P::kv_lens);
    DefPtr(c, "out", &P::out);
    DefPtr(c, "work", &P::work);
    DefPtr(c, "part_o", &P::part_o);
    DefPtr(c, "part_lse", &P::part_lse);
    c.def_readwrite("plan_slots", &P::plan_slots);
    c.def_readwrite("batch_invariant", &P::batch_invariant);
    m.def(
        "verify_attention",
        [](const P& p, const std::string& backend, uintptr_t stream) {
          Launch<P>("verify_attention", VerifyAttentionCpu, DSPARK_CUDA_FN(VerifyAttentionCuda),
                    p, backend, stream);
        },
        py::arg("params"), py::arg("backend"), py::arg("stream"));
#ifdef DSPARK_WITH_CUDA
    // The plan of a forward (CUDA only: the C++ CPU kernel partitions its work per call).
    m.def(
        "verify_attention_plan_slots",
        [](const P& p, uintptr_t stream) {
          int64_t slots = 0;
          Raise("verify_attention_plan_slots", "cuda",
                VerifyAttentionPlanSlots(p, reinterpret_cast<void*>(stream), &slots));
          return slots;
        },
        py::arg("params"), py::arg("stream"));
    m.def(
        "verify_attention_plan",
        [](const P& p, uintptr_t stream) {
          Launch<P>("verify_attention_plan", nullptr, VerifyAttentionPlanCuda, p, "cuda", stream);
        },
        py::arg("params"), py::arg("stream"));
#endif
    // The CUDA planner's split-KV choice, its host twin (attn_split.h), for the tests.
    m.def(
        "attn_split_chunk",
        [](const std::vector<long long>& units, const std::vector<int>& tiles, int target) {
          if (units.size() != tiles.size() || target < 1) {
            throw std::invalid_argument("attn_split_chunk: units and tiles differ in length, or target < 1");
          }
          return ChooseSplitChunk(units.data(), tiles.data(), static_cast<int>(units.size()), target);
        },
        py::arg("units"), py::arg("tiles"), py::arg("target"));
  }

  m.def("build_info", &BuildInfo, "Build facts: version, cuda, cuda_archs, cuda_version, "
                                  "compiler, openmp");

  {
    using P = AppendKvParams;
    const char* cls = "AppendKvParams";
    py::class_<P> c(m, cls);
    c.def(py::init<>());
    c.def_readwrite("N", &P::N).def_readwrite("h_kv", &P::h_kv).def_readwrite("head_dim", &P::head_dim);
    c.def_readwrite("page_size", &P::page_size).def_readwrite("num_pages", &P::num_pages);
    DefEnum(c, cls, "dtype", &P::dtype, 0, kMaxDType);
    DefPtr(c, "k", &P::k);
    DefPtr(c, "v", &P::v);
    DefPtr(c, "k_cache", &P::k_cache);
    DefPtr(c, "v_cache", &P::v_cache);
    DefPtr(c, "slot_mapping", &P::slot_mapping);
    m.def(
        "append_kv",
        [](const P& p, const std::string& backend, uintptr_t stream) {
          Launch<P>("append_kv", AppendKvCpu, DSPARK_CUDA_FN(AppendKvCuda), p, backend, stream);
        },
        py::arg("params"), py::arg("backend"), py::arg("stream"));
  }

  {
    using P = LinearParams;
    const char* cls = "LinearParams";
    py::class_<P> c(m, cls);
    c.def(py::init<>());
    c.def_readwrite("M", &P::M).def_readwrite("N", &P::N).def_readwrite("K", &P::K);
    c.def_readwrite("ldx", &P::ldx).def_readwrite("ldw", &P::ldw).def_readwrite("ldo", &P::ldo);
    DefEnum(c, cls, "dtype", &P::dtype, 0, kMaxDType);
    DefPtr(c, "x", &P::x);
    DefPtr(c, "w", &P::w);
    DefPtr(c, "out", &P::out);
    m.def(
        "linear",
        [](const P& p, const std::string& backend, uintptr_t stream) {
          Launch<P>("linear", LinearCpu, DSPARK_CUDA_FN(LinearCuda), p, backend, stream);
        },
        py::arg("params"), py::arg("backend"), py::arg("stream"));
    // The same launch from plain ints (contiguous x, w, out): the door's fast path, called for
    // every projection of every forward, where building a params object costs more than a small
    // model's GEMM.
    m.def(
        "linear_contiguous",
        [](uintptr_t x, uintptr_t w, uintptr_t out, int64_t M, int64_t N, int64_t K, int dtype,
           const std::string& backend, uintptr_t stream) {
          if (dtype < 0 || dtype > kMaxDType) throw py::value_error("linear: bad dtype code");
          P p;
          p.M = M, p.N = N, p.K = K, p.ldx = K, p.ldw = K, p.ldo = N;
          p.dtype = static_cast<DType>(dtype);
          p.x = reinterpret_cast<const void*>(x);
          p.w = reinterpret_cast<const void*>(w);
          p.out = reinterpret_cast<void*>(out);
          Launch<P>("linear", LinearCpu, DSPARK_CUDA_FN(LinearCuda), p, backend, stream);
        },
        py::arg("x"), py::arg("w"), py::arg("out"), py::arg("M"), py::arg("N"), py::arg("K"),
        py::arg("dtype"), py::arg("backend"), py::arg("stream"));
  }
}
