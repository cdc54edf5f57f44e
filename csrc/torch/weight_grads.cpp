// Weight gradients written straight into the optimizer's gradient buffer.
// The CUDA-graph step captures each bucket's backward once and replays it; ls_adam keeps every gradient in
// one flat buffer per dtype. Left to autograd, a captured backward hands each weight gradient to autograd's
// accumulation as a new tensor of the graph pool, and a second pass must copy all of them into the flat buffer.
// Instead, while a backward is captured, the graph step names each body parameter's place in the flat buffer
// here (a "sink"), and the linear nodes' weight-gradient GEMMs write there themselves:
//   * write mode: C = A B overwrites the sink (the update's only micro-batch: nothing to add to);
//   * add mode:   C += A B (beta = 1 in the GEMM's epilogue) for updates of several micro-batches, whose
//                 buffers are zeroed once at the start of the update.
// A weight that two nodes use (tied weights) is overwritten by the first and added to by the second. The head's
// weights (add_weight_grad_sinks) are always added to: their slices hold the head's part before the backward
// runs. The embedding backward (embedding.cpp) writes into a sink too; the FP8 projections (fp8.cpp), whose GEMM
// cannot add into its output, in write mode only. The node then returns no gradient for the weight. Sinks are
// looked up by the weight's data pointer; one whose shape or dtype differs from the product is not used. Nothing
// here touches CUDA directly: the CPU tests build this file with the nodes (tests/_cpu_builds.py).
#include <torch/extension.h>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "torch/ops.h"

namespace ls_torch {

namespace {

struct Sinks {
  std::mutex mu;
  std::atomic<bool> armed{false};  // the common case (no capture under way) without taking the lock
  std::unordered_map<const void*, Tensor> dest;
  std::unordered_set<const void*> hits;        // the sinks written so far
  std::unordered_set<const void*> always_add;  // add_weight_grad_sinks' entries
  bool accumulate = false;
};

Sinks& sinks() {
  static Sinks s;
  return s;
}

void check_sinks(const char* op, const std::vector<Tensor>& params, const std::vector<Tensor>& dests) {
  LS_CHECK(params.size() == dests.size(), op, ": ", params.size(), " parameters but ", dests.size(),
           " destinations");
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor &p = params[i], &d = dests[i];
    LS_CHECK(p.defined() && d.defined(), op, ": entry ", i, " is undefined");
    LS_CHECK(p.sizes() == d.sizes() && p.scalar_type() == d.scalar_type() && p.device() == d.device(), op,
             ": entry ", i, ": destination ", d.sizes(), " of ", d.scalar_type(), " does not match parameter ",
             p.sizes(), " of ", p.scalar_type());
    LS_CHECK(d.is_contiguous(), op, ": entry ", i, ": the destination must be contiguous");
  }
}

}  // namespace

void set_weight_grad_sinks(const std::vector<Tensor>& params, const std::vector<Tensor>& dests, bool accumulate) {
  check_sinks("set_weight_grad_sinks", params, dests);
  Sinks& s = sinks();
  std::lock_guard<std::mutex> lock(s.mu);
  s.dest.clear();
  s.hits.clear();
  s.always_add.clear();
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].numel() > 0) s.dest[params[i].data_ptr()] = dests[i];
  s.accumulate = accumulate;
  s.armed.store(!s.dest.empty());
}

void add_weight_grad_sinks(const std::vector<Tensor>& params, const std::vector<Tensor>& dests) {
  check_sinks("add_weight_grad_sinks", params, dests);
  Sinks& s = sinks();
  std::lock_guard<std::mutex> lock(s.mu);
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    s.dest[params[i].data_ptr()] = dests[i];
    s.always_add.insert(params[i].data_ptr());
  }
  s.armed.store(!s.dest.empty());
}

std::vector<int64_t> take_weight_grad_sinks() {
  Sinks& s = sinks();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<int64_t> hit;
  hit.reserve(s.hits.size());
  for (const void* key : s.hits) hit.push_back(reinterpret_cast<int64_t>(key));
  s.dest.clear();
  s.hits.clear();
  s.always_add.clear();
  s.armed.store(false);
  return hit;
}

namespace {

// The sink of the weight at key for a [rows, cols] product of dtype, counted as written, or undefined (no capture
// under way, no sink, another shape or dtype). *add: whether the product must be added to it (add mode, the
// weight's second use, or an always-added sink). overwrite_only (a GEMM that cannot add, needing 16-byte aligned
// output): only a sink the product may overwrite.
Tensor claim_sink(const void* key, int64_t rows, int64_t cols, at::ScalarType dtype, bool overwrite_only, bool* add) {
  Sinks& s = sinks();
  if (key == nullptr || !s.armed.load()) return Tensor();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.dest.find(key);
  if (it == s.dest.end()) return Tensor();
  const Tensor& d = it->second;
  if (d.dim() != 2 || d.size(0) != rows || d.size(1) != cols || d.scalar_type() != dtype) return Tensor();
  *add = s.accumulate || s.hits.count(key) > 0 || s.always_add.count(key) > 0;
  if (overwrite_only && (*add || reinterpret_cast<uintptr_t>(d.data_ptr()) % 16 != 0)) return Tensor();
  s.hits.insert(key);
  return d;
}

}  // namespace

Tensor weight_grad_overwrite_sink(const void* key, int64_t rows, int64_t cols, at::ScalarType dtype) {
  bool add = false;
  return claim_sink(key, rows, cols, dtype, true, &add);
}

Tensor weight_grad_sink(const void* key, int64_t rows, int64_t cols, at::ScalarType dtype, bool* add) {
  return claim_sink(key, rows, cols, dtype, false, add);
}

Tensor weight_grad_mm(const Tensor& w, const Tensor& a, const Tensor& b) {
  bool add = false;
  Tensor dest = a.scalar_type() == b.scalar_type()
                    ? weight_grad_sink(w.data_ptr(), a.size(0), b.size(1), a.scalar_type(), &add)
                    : Tensor();
  if (!dest.defined()) return gemm_mm(a, b, std::nullopt, 1);
  gemm_mm_into(dest, a, b, add, 1);
  return Tensor();
}

}  // namespace ls_torch
