// Shared pieces of the ATen adapters: argument checks with clear messages (LS_CHECK), dtype mapping,
// current stream, and the Philox seed/offset from torch's default CUDA generator.
#pragma once

#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <pybind11/pybind11.h>

#include "kernels/launch.h"

namespace ls_torch {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// ---- Argument checks -----------------------------------------------------------------------------
// LS_CHECK(cond, parts...) throws std::invalid_argument with the parts concatenated. The message is
// built with std::string / std::to_string / snprintf only: no iostreams, no c10 formatting machinery
// (TORCH_CHECK formats through std::ostringstream; see the note in ls_fairseq/_build_flags.py).
// bindings.cpp turns every std::exception into a Python RuntimeError.
namespace detail {

inline void append(std::string& s, const char* v) { s += (v ? v : "(null)"); }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                           !std::is_same_v<T, char>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);  // same digits as an ostream's default formatting
  s += buf;
}
inline void append(std::string& s, float v) { append(s, static_cast<double>(v)); }
inline void append(std::string& s, at::ScalarType t) { s += c10::toString(t); }
inline void append(std::string& s, const c10::Device& d) {
  s += c10::DeviceTypeName(d.type(), /*lower_case=*/true);
  if (d.has_index()) s += ":" + std::to_string(static_cast<int>(d.index()));
}
inline void append(std::string& s, at::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}

template <typename... A>
inline std::string concat(const A&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}

template <typename... A>
[[noreturn]] inline void fail(const A&... parts) {
  throw std::invalid_argument(concat(parts...));
}

}  // namespace detail

// "[a, b, c]" for a shape.
inline std::string sizes_str(at::IntArrayRef v) { return detail::concat(v); }

#define LS_CHECK(cond, ...)                                  \
  do {                                                       \
    if (!(cond)) ::ls_torch::detail::fail(__VA_ARGS__);      \
  } while (0)

#define LS_CHECK_CUDA(op, t) LS_CHECK((t).is_cuda(), op, ": ", #t, " must be a CUDA tensor, got ", (t).device())
#define LS_CHECK_CONTIG(op, t) LS_CHECK((t).is_contiguous(), op, ": ", #t, " must be contiguous")
#define LS_CHECK_INPUT(op, t) \
  LS_CHECK_CUDA(op, t);       \
  LS_CHECK_CONTIG(op, t)
#define LS_CHECK_SAME_DEVICE(op, a, b) \
  LS_CHECK((a).device() == (b).device(), op, ": ", #a, " and ", #b, " are on different devices")
#define LS_CHECK_DTYPE(op, t, dt) \
  LS_CHECK((t).scalar_type() == (dt), op, ": ", #t, " must be ", (dt), ", got ", (t).scalar_type())

inline ls::DType to_dtype(const char* op, const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ls::DType::F32;
    case at::kHalf: return ls::DType::F16;
    case at::kBFloat16: return ls::DType::BF16;
    default: LS_CHECK(false, op, ": unsupported dtype ", t.scalar_type(), " (float32, float16, bfloat16 only)");
  }
  return ls::DType::F32;
}

inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline const void* ptr_or_null(const OptTensor& t) { return t.has_value() && t->defined() ? t->data_ptr() : nullptr; }

inline bool present(const OptTensor& t) { return t.has_value() && t->defined(); }

// Checks an optional per-channel parameter ([C]) and returns it contiguous in x's dtype.
inline OptTensor channel_param(const char* op, const char* name, const OptTensor& p, const Tensor& x, int64_t C) {
  if (!present(p)) return std::nullopt;
  LS_CHECK(p->is_cuda() && p->device() == x.device(), op, ": ", name, " must be on ", x.device());
  LS_CHECK(p->dim() == 1 && p->size(0) == C, op, ": ", name, " must have shape [", C, "], got ", p->sizes());
  if (p->scalar_type() == x.scalar_type() && p->is_contiguous()) return *p;  // the usual case: no dispatch
  return p->to(x.scalar_type()).contiguous();
}

// Philox state for one dropout launch (reserves kPhiloxIncrement counter values per element group).
inline ls::PhiloxArgs philox_args() {
  auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
  at::PhiloxCudaState st;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    st = gen->philox_cuda_state(ls::kPhiloxIncrement);
  }
  ls::PhiloxArgs a;
  a.captured = st.captured_;
  if (st.captured_) {
    a.seed_ptr = st.seed_.ptr;
    a.offset_ptr = st.offset_.ptr;
    a.offset_intragraph = st.offset_intragraph_;
  } else {
    a.seed = st.seed_.val;
    a.offset = st.offset_.val;
  }
  return a;
}

inline void check_p(const char* op, double p) {
  LS_CHECK(p >= 0.0 && p < 1.0, op, ": dropout probability must be in [0, 1), got ", p);
}

inline int checked_int(const char* op, const char* what, int64_t v) {
  LS_CHECK(v >= 0 && v <= 0x7fffffffLL, op, ": ", what, " = ", v, " is out of the supported range");
  return static_cast<int>(v);
}

// Runs a launcher with the GIL released; its std::runtime_error is rethrown with the op name once the
// GIL is held again (all argument checks also run with the GIL held).
template <typename F>
inline void launch(const char* op, F&& f) {
  std::string err;
  // Called from Python the GIL is held and released here; called from an autograd node's backward
  // (the engine's thread, autograd.cpp) it is not held and there is nothing to release.
  if (PyGILState_Check()) {
    pybind11::gil_scoped_release nogil;
    try {
      f();
    } catch (const std::runtime_error& e) {
      err = e.what();
    }
  } else {
    try {
      f();
    } catch (const std::runtime_error& e) {
      err = e.what();
    }
  }
  if (!err.empty()) throw std::runtime_error(detail::concat(op, ": ", err));
}

}  // namespace ls_torch
