// The CUDA side of the ATen adapters: dtype mapping, current stream, per-channel parameters, the Philox
// seed/offset from torch's default CUDA generator and the kernel launch with the GIL released.
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
#include "kernels/launch.h"
#include "torch/checks.h"
#include "torch/gil.h"

namespace ls_torch {

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

// The kernels' activation for its name (relu, gelu, none).
inline ls::Act parse_act(const char* op, const std::string& a) {
  if (a == "relu") return ls::Act::Relu;
  if (a == "gelu") return ls::Act::Gelu;
  if (a == "none") return ls::Act::None;
  LS_CHECK(false, op, ": unknown activation '", a, "' (relu, gelu, none)");
  return ls::Act::None;
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
  {
    // Called from Python the GIL is held and released here; called from an autograd node's backward
    // (the engine's thread, autograd.cpp) it is not held and there is nothing to release.
    ReleaseGilIfHeld nogil;
    try {
      f();
    } catch (const std::runtime_error& e) {
      err = e.what();
    }
  }  // the GIL is held again from here
  if (!err.empty()) throw std::runtime_error(detail::concat(op, ": ", err));
}

}  // namespace ls_torch
