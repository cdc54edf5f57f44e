// Releasing the GIL around work that needs no Python, for entry points called both from Python (the GIL
// held) and from autograd's device threads (not held): the adapters' kernel launches (adapter.h) and the
// whole-layer calls (layers.cpp).
#pragma once

#include <optional>

#include <pybind11/pybind11.h>

namespace ls_torch {

// Releases the GIL for its scope when the calling thread holds it; otherwise does nothing.
struct ReleaseGilIfHeld {
  std::optional<pybind11::gil_scoped_release> release;
  ReleaseGilIfHeld() {
    if (PyGILState_Check()) release.emplace();
  }
};

}  // namespace ls_torch
