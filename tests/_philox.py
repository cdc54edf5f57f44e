"""Philox4x32-10 in NumPy and the dropout keep bits the kernels draw from it (``dropout_bits`` in
csrc/kernels/common.cuh), for the tests that compare the kernels' masks bit for bit.

A dropout launch reserves its Philox offset from PyTorch's CUDA generator (its seed, and an offset that starts at 0
after ``torch.manual_seed`` and grows by 4 per launch). Element e of the launch's flat output belongs to group
e // 8, whose draw is Philox4x32-10 with the 128-bit counter (group, offset) and the 64-bit key seed; the eight
16-bit halves of the draw's four words, low half first, go to the group's eight elements, and an element is kept
when its half is at least round(p * 65536) (so p that rounds to 65536 keeps nothing).
"""

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)  # the multipliers
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)  # the key's increments between rounds
_LOW = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


def philox4x32_10(counter, key):
    """The four 32-bit output words of Philox4x32-10 for ``counter`` (four words, ints or arrays of one shape,
    least significant first) and ``key`` (two words), as uint32 arrays."""
    c = [np.asarray(w, dtype=np.uint64) & _LOW for w in counter]
    k0, k1 = np.uint64(key[0]) & _LOW, np.uint64(key[1]) & _LOW
    for _ in range(10):
        p0, p1 = _M0 * c[0], _M1 * c[2]  # 32 x 32 -> 64 bits: no overflow
        c = [(p1 >> _32) ^ c[1] ^ k0, p1 & _LOW, (p0 >> _32) ^ c[3] ^ k1, p0 & _LOW]
        k0, k1 = (k0 + _W0) & _LOW, (k1 + _W1) & _LOW
    return [w.astype(np.uint32) for w in np.broadcast_arrays(*c)]


def dropout_threshold(p: float) -> int:
    """round(p * 65536) as the launchers compute it (p as a float32, the product in double), in [0, 65536]."""
    return int(min(65536.0, max(0.0, float(np.float32(p)) * 65536.0 + 0.5)))


def keep_mask(n: int, p: float, seed: int, offset: int) -> np.ndarray:
    """The keep mask (bool [n]) of a dropout launch over n elements with PyTorch's CUDA generator at ``seed`` and
    ``offset``."""
    g = np.arange((n + 7) // 8, dtype=np.uint64)
    off = np.uint64(offset)
    words = philox4x32_10([g & _LOW, g >> _32, off & _LOW, off >> _32], [seed & 0xFFFFFFFF, seed >> 32])
    halves = np.stack([h for w in words for h in (w & 0xFFFF, w >> 16)], axis=1)  # [groups, 8], element order
    return halves.reshape(-1)[:n] >= dropout_threshold(p)
