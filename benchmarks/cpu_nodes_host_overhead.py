"""Host time of a transformer-big-shaped forward and backward on the CPU: C++ autograd nodes against the
Python autograd.Functions, no GPU needed.

The model has the layer count and the op sequence of ls_transformer_wmt_en_de_big_t2t (6 + 6 layers, pre-LN)
with tiny widths, so that the time is mostly host work: Python, autograd, the dispatcher. The ops take their
"kernel" paths (C++ nodes, or the Python Functions calling the adapters), here over the ATen CPU stand-ins of
the CUDA adapters in tests/cpp (the same stand-ins tests/test_cpp_nodes.py builds). Attention takes torch's
reference on the CPU in every variant. Three variants, ROUNDS times in turn:

  cpp=1    every C++ node (LS_FAIRSEQ_CPP_AUTOGRAD=1, the default on the GPU)
  cpp=ops  the op nodes, F.linear for the projections
  cpp=0    the Python Functions and F.linear

    python benchmarks/cpu_nodes_host_overhead.py [ROUNDS]     (builds the module first: about a minute)

It measures host overhead only: kernel launches, the CUDA caching allocator and GPU work are not in it.
"""

import collections
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

def build_module():
    from tests._models import build_cpu_nodes_module

    # the module tests/test_cpp_nodes.py builds, with the compiler optimising
    return build_cpu_nodes_module("ls_fairseq_nodes_bench", tempfile.mkdtemp(prefix="ls_nodes_bench_"))


def use_module(mod):
    """The ops take their kernel paths on CPU tensors, over ``mod``."""
    import torch.nn.functional as F

    import ls_fairseq.ops as ops
    from ls_fairseq import _ext
    from ls_fairseq.ops import _dispatch

    _ext._state.update(tried=True, module=mod, reason=None, source="stand-ins")

    def kernel_module(op, *tensors):
        entry = _dispatch.KERNEL_ENTRY.get(op)
        return mod if entry is not None and hasattr(mod, entry) else None

    for name, m in list(sys.modules.items()):
        if name.startswith("ls_fairseq.ops") and m is not None and hasattr(m, "kernel_module"):
            m.kernel_module = kernel_module

    def linear(x, weight, bias=None):  # ops.linear without its CUDA condition
        nodes = _dispatch.cpp_nodes(mod, linear=True)
        return nodes.ag_linear(x, weight, bias) if nodes is not None else F.linear(x, weight, bias)

    ops.linear = linear


def main():
    import torch

    from ls_fairseq.ops import _dispatch
    from tests._models import build_model, make_dict, random_batch

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    use_module(build_module())
    torch.set_num_threads(1)
    d = make_dict(50)
    model = build_model("ls_transformer_wmt_en_de_big_t2t", d, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, share_all_embeddings=True, encoder_embed_dim=16,
                        decoder_embed_dim=16, encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32,
                        encoder_attention_heads=2, decoder_attention_heads=2)
    model.train()
    src, lengths, prev, _ = random_batch(d, B=2, S=6, T=5)

    def measure(n=40, warm=5):
        fwd = bwd = 0.0
        for i in range(n + warm):
            t0 = time.perf_counter()
            out = model(src, lengths, prev)[0]
            t1 = time.perf_counter()
            out.float().sum().backward()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if i >= warm:
                fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
        return fwd / n * 1e3, bwd / n * 1e3

    variants = {"1": (True, True), "ops": (True, False), "0": (False, False)}
    res = collections.defaultdict(list)
    for _ in range(rounds):
        for name, (op_nodes, linear_node) in variants.items():
            _dispatch._CPP_AUTOGRAD, _dispatch._CPP_LINEAR = op_nodes, linear_node
            res[name].append(measure())
    for name, runs in res.items():
        print(f"cpp={name:3s} host ms, forward / backward: " + ", ".join(f"{f:.2f} / {b:.2f}" for f, b in runs))


if __name__ == "__main__":
    main()
