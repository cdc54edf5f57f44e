"""copy_div_ on CUDA: the kernel gives the values of a copy followed by PyTorch's in-place division,
bit for bit, over every pair of a long list (several launches), in place or not, aligned or not."""

import pytest
import torch

from ls_fairseq import _ext
from ls_fairseq.ops import copy_div_
from ls_fairseq.ops.copy_div import copy_div_reference_

pytestmark = pytest.mark.gpu

# sizes that cover empty pairs, tails shorter than a vector, a chunk boundary (16384 elements), more
# pairs than a launch holds (32) and one pair of more chunks than a launch holds (640), so the list
# is split over several launches, once in the middle of a pair
SIZES = [0, 1, 7, 8, 9, 1000, 16383, 16384, 16385, 300_001] * 5 + [640 * 16384 + 13]


def _pairs(dtype, offset, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(n + offset for n in SIZES) + 16
    flat = torch.zeros(total, dtype=dtype, device="cuda")
    dst, src, at = [], [], 0
    for i, n in enumerate(SIZES):
        at += offset  # offset 1: every view starts off a 16-byte boundary (the element-wise path)
        dst.append(flat[at:at + n])
        at += n
        x = (torch.randn(n, device="cuda", generator=g) * 1e3).to(dtype)
        if n > 3:
            x[:3] = torch.tensor([6e-8, -3e-5, 65000.0]).to(dtype)  # subnormal (fp16), tiny, near fp16's top
        if i % 4 == 3:  # in place: the source is its destination
            dst[-1].copy_(x)
            src.append(dst[-1])
        else:
            src.append(x)
    return flat, dst, src


@pytest.mark.parametrize("divisor", [2, 3, 4, 8])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_copy_div_equals_copy_then_division(dtype, offset, divisor):
    flat, dst, src = _pairs(dtype, offset, seed=divisor)
    ref_flat, ref_dst, ref_src = _pairs(dtype, offset, seed=divisor)
    copy_div_(dst, src, divisor)
    copy_div_reference_(ref_dst, ref_src, divisor)
    assert torch.equal(flat, ref_flat)  # every pair, and nothing between the pairs written


def test_copy_div_refuses_bad_pairs_in_the_extension():
    mod = _ext.get()
    a = torch.zeros(100, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="overlaps partially"):
        mod.copy_div([a[0:50]], [a[10:60]], 2.0)
    with pytest.raises(RuntimeError, match="destination and"):
        mod.copy_div([a[0:50]], [a[50:90]], 2.0)
    with pytest.raises(RuntimeError, match="must be"):
        mod.copy_div([a[0:50]], [torch.zeros(50, device="cuda")], 2.0)
    with pytest.raises(RuntimeError, match="divisor must not be zero"):
        mod.copy_div([a[0:50]], [a[50:100]], 0.0)
