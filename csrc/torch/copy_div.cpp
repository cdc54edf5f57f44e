// ATen adapter: multi-tensor copy-and-divide (the overlapped gradient reduction's fold of a bucket).
#include "torch/adapter.h"
#include "torch/ops.h"

namespace ls_torch {

void copy_div(const std::vector<Tensor>& dst, const std::vector<Tensor>& src, double divisor) {
  const char* op = "copy_div";
  LS_CHECK(dst.size() == src.size(), op, ": ", (int64_t)dst.size(), " destinations for ", (int64_t)src.size(),
           " sources");
  LS_CHECK(divisor != 0.0, op, ": the divisor must not be zero");
  if (dst.empty()) return;
  const at::ScalarType st = dst[0].scalar_type();
  const ls::DType dt = to_dtype(op, dst[0]);
  std::vector<const void*> s;
  std::vector<void*> d;
  std::vector<int64_t> n;
  s.reserve(dst.size());
  d.reserve(dst.size());
  n.reserve(dst.size());
  for (size_t i = 0; i < dst.size(); ++i) {
    const Tensor& a = dst[i];
    const Tensor& b = src[i];
    LS_CHECK_INPUT(op, a);
    LS_CHECK_INPUT(op, b);
    LS_CHECK(a.device() == dst[0].device() && b.device() == dst[0].device(), op,
             ": every tensor must be on one device; pair ", (int64_t)i, " is on ", a.device(), " and ", b.device());
    LS_CHECK(a.scalar_type() == st && b.scalar_type() == st, op, ": every tensor must be ", st, "; pair ",
             (int64_t)i, " is ", a.scalar_type(), " and ", b.scalar_type());
    LS_CHECK(a.numel() == b.numel(), op, ": pair ", (int64_t)i, " has ", a.numel(), " destination and ",
             b.numel(), " source elements");
    const auto lo_a = reinterpret_cast<uintptr_t>(a.data_ptr()), lo_b = reinterpret_cast<uintptr_t>(b.data_ptr());
    const auto bytes = (uintptr_t)a.numel() * a.element_size();
    LS_CHECK(lo_a == lo_b || lo_a + bytes <= lo_b || lo_b + bytes <= lo_a, op, ": pair ", (int64_t)i,
             " overlaps partially (a source must be its destination or apart from it)");
    s.push_back(b.data_ptr());
    d.push_back(a.data_ptr());
    n.push_back(a.numel());
  }
  // PyTorch's CUDA division by a host number multiplies by its fp32 reciprocal: the same values
  const float scale = 1.0f / static_cast<float>(divisor);
  c10::cuda::CUDAGuard guard(dst[0].device());
  launch(op, [&] { ls::copy_scale(dt, s.data(), d.data(), n.data(), (int)n.size(), scale, stream()); });
}

}  // namespace ls_torch
