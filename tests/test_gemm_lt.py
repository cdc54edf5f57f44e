"""The layers' products through cuBLASLt, on the CPU: nothing turns on without it, the token counts the preload
takes from the bucket plan (the GPU side is tests/gpu/test_gemm_lt_gpu.py)."""

import pytest
import torch

from ls_fairseq.fairseq_ext.graph import gemm_lt
from ls_fairseq.fairseq_ext.graph.packed_buckets import PackedBucket
from ls_fairseq.fairseq_ext.graph.shape_buckets import Bucket


def test_not_on_without_cublaslt():
    if torch.cuda.is_available():
        pytest.skip("a CUDA build: tests/gpu/test_gemm_lt_gpu.py covers it")
    assert not gemm_lt.available()
    assert gemm_lt.enable() is False
    assert not gemm_lt.is_on()
    assert gemm_lt.describe() == "off"
    assert gemm_lt.preload([128, 256]) == {"shapes": 0, "runs": 0, "classes": 0}


def test_bucket_token_counts():
    padded = [Bucket(sentences=4, src_len=16, tgt_len=24), Bucket(sentences=8, src_len=8, tgt_len=8)]
    assert gemm_lt.bucket_token_counts(padded) == [64, 96]
    packed = [PackedBucket(sentences=10, src_rows=512, tgt_rows=528, max_len=64),
              PackedBucket(sentences=20, src_rows=528, tgt_rows=1024, max_len=64)]
    assert gemm_lt.bucket_token_counts(packed) == [512, 528, 1024]
    assert gemm_lt.bucket_token_counts([]) == []
