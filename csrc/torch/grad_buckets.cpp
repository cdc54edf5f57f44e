// GradBuckets: the per-parameter work of ls_fairseq.optim.overlap.OverlappedReducer in C++.
//
// During the backward pass, it knows when every parameter of a bucket has its gradient and then folds the
// bucket (the gradients copied into the bucket's range of the flat buffer, every ``p.grad`` made its view, the
// range divided by the world size): from Python that would be a call per parameter per backward on the autograd
// thread the optimizer step waits for. Each parameter's gradient accumulator carries a C++ post hook that counts
// and folds without the GIL and calls Python (``events(kind, value)``) only for kind 0 "task" (the first gradient
// of a backward: Python arms the round, or raises) and kind 1 "bucket" (bucket n folded: Python launches its
// collective). Slots are numbered bucket by bucket (bucket n: [first[n], first[n + 1])). One thread at a time
// touches the state (docs/optimizer.md, "Overlapped reduction"); nothing here touches CUDA directly:
// tests/test_overlap.py builds this file on the CPU.
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "torch/grad_buckets.h"

namespace py = pybind11;

namespace ls_torch {
namespace {

using torch::autograd::variable_list;
using Accumulator = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

enum Event { kTask = 0, kBucket = 1 };

class GradBuckets {
 public:
  GradBuckets(std::vector<at::Tensor> params, std::vector<at::Tensor> views, std::vector<int64_t> first,
              std::vector<at::Tensor> flats, int64_t divisor, py::object events, std::string written_again)
      : params_(std::move(params)),
        views_(std::move(views)),
        first_(std::move(first)),
        flats_(std::move(flats)),
        divisor_(divisor),
        events_(std::move(events)),
        written_again_(std::move(written_again)),
        done_(params_.size(), 0) {
    const int64_t slots = static_cast<int64_t>(params_.size());
    const int64_t buckets = static_cast<int64_t>(flats_.size());
    if (static_cast<int64_t>(views_.size()) != slots)
      throw std::invalid_argument("GradBuckets: one gradient view per parameter expected");
    if (static_cast<int64_t>(first_.size()) != buckets + 1 || first_.front() != 0 || first_.back() != slots)
      throw std::invalid_argument("GradBuckets: first must hold each bucket's first slot and the slot count");
    if (divisor_ < 1) throw std::invalid_argument("GradBuckets: the divisor must be at least 1");
    bucket_.resize(slots);
    sizes_.resize(buckets);
    for (int64_t n = 0; n < buckets; ++n) {
      if (first_[n + 1] <= first_[n]) throw std::invalid_argument("GradBuckets: every bucket needs a slot");
      sizes_[n] = first_[n + 1] - first_[n];
      for (int64_t s = first_[n]; s < first_[n + 1]; ++s) bucket_[s] = n;
    }
    for (int64_t s = 0; s < slots; ++s) {
      const at::Tensor &p = params_[s], &v = views_[s];
      if (!p.defined() || !v.defined() || p.sizes() != v.sizes() || p.device() != v.device())
        throw std::invalid_argument("GradBuckets: a gradient view must match its parameter's shape and device");
    }
    pending_ = sizes_;
  }

  ~GradBuckets() {
    remove();
    if (events_) {  // the last owner may be a hook on autograd's thread, which does not hold the GIL
      py::gil_scoped_acquire gil;
      events_ = py::object();
    }
  }

  // Hook the gradient accumulator of the parameter in ``slot`` (a leaf that requires grad).
  static void attach(const std::shared_ptr<GradBuckets>& self, int64_t slot) {
    if (slot < 0 || slot >= static_cast<int64_t>(self->params_.size()))
      throw std::invalid_argument("GradBuckets: slot out of range");
    const at::Tensor& p = self->params_[slot];
    if (!p.requires_grad() || !p.is_leaf())
      throw std::invalid_argument("GradBuckets: a hooked parameter must be a leaf that requires grad");
    auto acc = torch::autograd::impl::grad_accumulator(p);
    if (!acc) throw std::invalid_argument("GradBuckets: the parameter has no gradient accumulator");
    uintptr_t key = acc->add_post_hook(std::make_unique<Hook>(std::weak_ptr<GradBuckets>(self), slot));
    self->hooks_.emplace_back(std::move(acc), key);
  }

  void remove() {
    for (auto& h : hooks_) h.first->del_post_hook(h.second);
    hooks_.clear();
  }

  // Fold bucket n: each parameter's gradient goes into its view (one multi-tensor copy; a missing one
  // zeroes the view, one that already is the view stays), ``p.grad`` becomes the view, the bucket's range
  // is divided by the divisor. Returns how many of its trainable parameters had not reported a gradient.
  int64_t fold(int64_t n) {
    if (n < 0 || n >= static_cast<int64_t>(flats_.size())) throw std::invalid_argument("GradBuckets: no such bucket");
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> dst, src, zero;
    int64_t missed = 0;
    for (int64_t s = first_[n]; s < first_[n + 1]; ++s) {
      at::Tensor& p = params_[s];
      if (!done_[s] && p.requires_grad()) ++missed;
      done_[s] = 1;
      at::Tensor& g = p.mutable_grad();
      const at::Tensor& v = views_[s];
      if (!g.defined()) {
        zero.push_back(v);
        g = v;
      } else if (!g.is_sparse() && g.data_ptr() == v.data_ptr() && g.scalar_type() == v.scalar_type()) {
        // already its slice of the flat buffer (accumulated in place): nothing to move
      } else {
        dst.push_back(v);
        src.push_back(g.is_sparse() ? g.to_dense() : g);
        g = v;
      }
    }
    if (!dst.empty()) at::_foreach_copy_(dst, src);
    if (!zero.empty()) at::_foreach_zero_(zero);
    flats_[n].div_(divisor_);
    pending_[n] = 0;
    return missed;
  }

  // The end-of-backward fill ran: a gradient arriving later in the round is an error.
  void end() { ended_ = true; }

  // The round is over (the reducer's finish()): the next armed backward starts a new one.
  void reset() {
    ended_ = false;
    std::fill(done_.begin(), done_.end(), 0);
    pending_ = sizes_;
    last_task_ = -1;
    last_armed_ = false;
  }

  size_t num_hooks() const { return hooks_.size(); }

 private:
  struct Hook : torch::autograd::FunctionPostHook {
    Hook(std::weak_ptr<GradBuckets> owner, int64_t slot) : owner_(std::move(owner)), slot_(slot) {}
    variable_list operator()(const variable_list& outputs, const variable_list& inputs) override {
      if (inputs.empty() || !inputs[0].defined()) return outputs;  // nothing was accumulated
      if (auto owner = owner_.lock()) owner->ready(slot_);
      return outputs;
    }
    std::weak_ptr<GradBuckets> owner_;
    int64_t slot_;
  };

  // events(kind, value) with the GIL; its answer's truth value. A Python exception becomes a C++ one (the
  // engine hands it to the caller of backward() as a RuntimeError with the same message).
  bool call(Event kind, int64_t value) {
    std::string error;
    {
      py::gil_scoped_acquire gil;
      try {
        py::object answer = events_(static_cast<int>(kind), value);
        return PyObject_IsTrue(answer.ptr()) == 1;
      } catch (py::error_already_set& e) {
        error = e.what();
      }
    }
    throw std::runtime_error(error);
  }

  void ready(int64_t slot) {
    const int64_t task = torch::autograd::get_current_graph_task_id();
    if (task != last_task_) {
      last_armed_ = call(kTask, task);
      last_task_ = task;
    }
    if (!last_armed_) return;  // not armed: the gradient accumulates locally
    if (ended_ || done_[slot]) throw std::runtime_error(written_again_);
    done_[slot] = 1;
    const int64_t n = bucket_[slot];
    if (--pending_[n] == 0) {
      fold(n);
      call(kBucket, n);
    }
  }

  std::vector<at::Tensor> params_, views_;
  std::vector<int64_t> first_;
  std::vector<at::Tensor> flats_;
  int64_t divisor_;
  py::object events_;
  std::string written_again_;  // the error for a gradient that arrives twice in a round (the reducer's words)
  std::vector<uint8_t> done_;
  std::vector<int64_t> bucket_, sizes_, pending_;
  int64_t last_task_ = -1;
  bool last_armed_ = false, ended_ = false;
  std::vector<std::pair<Accumulator, uintptr_t>> hooks_;
};

}  // namespace

void bind_grad_buckets(py::module_& m) {
  py::class_<GradBuckets, std::shared_ptr<GradBuckets>>(
      m, "GradBuckets", "gradient-ready counting and bucket folding for the overlapped all-reduce (grad_buckets.cpp)")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                    int64_t, py::object, std::string>(),
           py::arg("params"), py::arg("views"), py::arg("first"), py::arg("flats"), py::arg("divisor"),
           py::arg("events"), py::arg("written_again"))
      .def("attach", &GradBuckets::attach, py::arg("slot"))
      .def("remove", &GradBuckets::remove)
      .def(
          "fold",
          [](GradBuckets& self, int64_t n) {
            try {
              return self.fold(n);
            } catch (const c10::Error& e) {  // as a RuntimeError of our own (see bindings.cpp)
              throw std::runtime_error(e.what_without_backtrace());
            }
          },
          py::arg("bucket"))
      .def("end", &GradBuckets::end)
      .def("reset", &GradBuckets::reset)
      .def_property_readonly("num_hooks", &GradBuckets::num_hooks);
}

}  // namespace ls_torch
