// csrc/torch/grad_buckets.cpp as a module of its own, for tests/test_overlap.py on machines without a GPU.
#include <torch/extension.h>

#include "torch/grad_buckets.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { ls_torch::bind_grad_buckets(m); }
