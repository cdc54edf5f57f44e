// GradReady: the per-parameter bookkeeping of ls_fairseq.optim.overlap.OverlappedReducer in C++.
//
// The reducer needs to know, during the backward pass, when every parameter of a bucket has its
// gradient accumulated. With Python post-accumulate-grad hooks that is one Python call per parameter
// per backward (about 190 for the big Transformer), on the autograd thread that the step waits for.
// GradReady puts a C++ post hook on each parameter's gradient accumulator instead. The hook does the
// counting and calls back into Python only for what needs Python:
//   event 0 "start"  (slot)   the first gradient of an armed round;
//   event 1 "task"   (id)     the first gradient seen from an autograd graph task (the reducer queues
//                             its end-of-backward callback there; a reentrant backward is a task too);
//   event 2 "bucket" (n)      bucket n is complete;
//   event 3 "error"  (slot)   a gradient written again into a round (the callback raises).
// Armed = ``owner.arm.accumulate_grads`` is False (read at every hook, as the Python hook reads it; the
// owner, the reducer, is held weakly: without it nothing is armed); the round lasts until reset(). Gradients that arrive undefined do not count
// (AccumulateGrad accumulates nothing then, and the Python hooks do not fire either).
//
// The hooks hold the state weakly: when the Python object goes, they do nothing (and its destructor
// takes them off). Every hook takes the GIL before it looks at the state, so the state (and its Python
// references) is only ever released with the GIL held. Nothing here touches CUDA: tests/test_overlap.py builds this file on the CPU.
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "torch/grad_ready.h"

namespace py = pybind11;

namespace ls_torch {
namespace {

using torch::autograd::variable_list;
using Accumulator = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

enum Event { kStart = 0, kTask = 1, kBucket = 2, kError = 3 };

class GradReady {
 public:
  GradReady(std::vector<int64_t> bucket_of_slot, std::vector<int64_t> sizes, py::object owner, py::object callback)
      : bucket_(std::move(bucket_of_slot)),
        sizes_(std::move(sizes)),
        owner_(py::weakref(owner)),
        callback_(std::move(callback)),
        done_(bucket_.size(), 0),
        pending_(sizes_) {
    for (int64_t b : bucket_) {
      if (b < 0 || b >= static_cast<int64_t>(sizes_.size())) throw std::invalid_argument("GradReady: bucket index out of range");
    }
    std::vector<int64_t> count(sizes_.size(), 0);
    for (int64_t b : bucket_) ++count[b];
    if (count != sizes_) throw std::invalid_argument("GradReady: bucket sizes do not match the slots' buckets");
  }

  ~GradReady() { remove(); }

  // Hook the gradient accumulator of ``param`` as ``slot`` (a leaf that requires grad).
  static void attach(const std::shared_ptr<GradReady>& self, const at::Tensor& param, int64_t slot) {
    if (slot < 0 || slot >= static_cast<int64_t>(self->bucket_.size())) throw std::invalid_argument("GradReady: slot out of range");
    if (!param.requires_grad() || !param.is_leaf()) throw std::invalid_argument("GradReady: a parameter must be a leaf that requires grad");
    auto acc = torch::autograd::impl::grad_accumulator(param);
    if (!acc) throw std::invalid_argument("GradReady: the parameter has no gradient accumulator");
    std::weak_ptr<GradReady> weak = self;
    auto hook = std::make_unique<Hook>(weak, slot);
    uintptr_t key = acc->add_post_hook(std::move(hook));
    self->hooks_.push_back({std::move(acc), key});
  }

  void remove() {
    for (auto& h : hooks_) h.first->del_post_hook(h.second);
    hooks_.clear();
  }

  // Which slots have their gradient in this round (one byte each), for the reducer's end-of-backward fill.
  py::bytearray done() const { return py::bytearray(reinterpret_cast<const char*>(done_.data()), done_.size()); }

  // The fill ran: every slot counts as done, nothing is pending; a later gradient is an error.
  void end() {
    std::fill(done_.begin(), done_.end(), 1);
    std::fill(pending_.begin(), pending_.end(), 0);
    ended_ = true;
  }

  // The round is over (after the reducer's finish()).
  void reset() {
    active_ = ended_ = false;
    std::fill(done_.begin(), done_.end(), 0);
    pending_ = sizes_;
    tasks_.clear();
  }

  bool active() const { return active_; }
  size_t num_hooks() const { return hooks_.size(); }

 private:
  struct Hook : torch::autograd::FunctionPostHook {
    Hook(std::weak_ptr<GradReady> owner, int64_t slot) : owner_(std::move(owner)), slot_(slot) {}
    variable_list operator()(const variable_list& outputs, const variable_list& inputs) override {
      if (inputs.empty() || !inputs[0].defined()) return outputs;  // nothing was accumulated
      py::gil_scoped_acquire gil;
      auto owner = owner_.lock();  // released before the GIL is
      if (owner) owner->ready(slot_);
      return outputs;
    }
    std::weak_ptr<GradReady> owner_;
    int64_t slot_;
  };

  bool armed() {
    py::object owner = owner_();
    if (owner.is_none()) return false;
    return !py::cast<bool>(owner.attr("arm").attr("accumulate_grads"));
  }

  void call(Event kind, int64_t value) {
    try {
      callback_(static_cast<int>(kind), value);
    } catch (py::error_already_set& e) {
      std::string what = e.what();
      throw std::runtime_error(what);
    }
  }

  void ready(int64_t slot) {  // with the GIL
    if (!active_) {
      if (!armed()) return;  // not armed: the gradient accumulates locally
      active_ = true;
      call(kStart, slot);
    } else if (ended_ || done_[slot] || !armed()) {
      call(kError, slot);
      throw std::runtime_error("ls_fairseq GradReady: a gradient was written again after it had been reduced");
    }
    const int64_t task = torch::autograd::get_current_graph_task_id();
    if (std::find(tasks_.begin(), tasks_.end(), task) == tasks_.end()) {
      tasks_.push_back(task);
      call(kTask, task);
    }
    const int64_t n = bucket_[slot];
    done_[slot] = 1;
    if (--pending_[n] == 0) call(kBucket, n);
  }

  std::vector<int64_t> bucket_, sizes_;
  py::weakref owner_;
  py::object callback_;
  std::vector<uint8_t> done_;
  std::vector<int64_t> pending_;
  std::vector<int64_t> tasks_;
  bool active_ = false, ended_ = false;
  std::vector<std::pair<Accumulator, uintptr_t>> hooks_;
};

}  // namespace

void bind_grad_ready(py::module_& m) {
  py::class_<GradReady, std::shared_ptr<GradReady>>(
      m, "GradReady", "per-parameter gradient-ready counting for the overlapped all-reduce (see grad_ready.cpp)")
      .def(py::init<std::vector<int64_t>, std::vector<int64_t>, py::object, py::object>(), py::arg("bucket_of_slot"),
           py::arg("sizes"), py::arg("owner"), py::arg("callback"))
      .def("attach", &GradReady::attach, py::arg("param"), py::arg("slot"))
      .def("remove", &GradReady::remove)
      .def("done", &GradReady::done)
      .def("end", &GradReady::end)
      .def("reset", &GradReady::reset)
      .def_property_readonly("active", &GradReady::active)
      .def_property_readonly("num_hooks", &GradReady::num_hooks);
}

}  // namespace ls_torch
