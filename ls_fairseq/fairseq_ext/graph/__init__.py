"""The CUDA-graph micro-batch: each forward and backward replayed from graphs captured per shape bucket.

``graph_step.py`` (the engine: eligibility, the micro-batch, capture pacing) uses ``capture.py`` (the
graphs' fixed buffers, their capture and instantiation), ``shape_buckets.py`` / ``packed_buckets.py`` (the
batch shapes), ``split_step.py`` (the body / head split the graphs hold), ``graph_grads.py`` (where the
replayed gradients land), ``gemm_lt.py`` (the layers' products through cuBLASLt) and ``prewarm.py`` (the
first update's kernels loaded while the optimizer is built). docs/graph_step.md says what a user sees and,
in "Inside the graph step", how it works.
"""
