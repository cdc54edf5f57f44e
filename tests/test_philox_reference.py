"""The NumPy Philox of the dropout masks' bit-for-bit GPU tests (tests/_philox.py) against the published known
answers of Philox4x32-10, and its keep bits' layout."""

import numpy as np

from _philox import dropout_threshold, keep_mask, philox4x32_10

# counter, key, output: the known-answer vectors of the Random123 library for Philox4x32-10
KNOWN = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


def test_philox_gives_the_known_answers():
    for counter, key, out in KNOWN:
        assert [int(w) for w in philox4x32_10(counter, key)] == out
    # vectorised over counters: each element as if drawn alone
    ctrs = np.array([[0, 0, 0, 0], [0xFFFFFFFF] * 4, [5, 0, 0, 0]], dtype=np.uint64).T
    words = philox4x32_10(list(ctrs), [0, 0])
    assert [int(w[0]) for w in words] == KNOWN[0][2]
    assert [int(w[2]) for w in words] == [int(w) for w in philox4x32_10([5, 0, 0, 0], [0, 0])]


def test_keep_mask_takes_each_groups_halves_in_order_against_the_rounded_threshold():
    seed, offset = 0x1234_5678_9ABC, 8
    n = 8 * 5 + 3  # a last, partial group
    m = keep_mask(n, 0.3, seed, offset)
    assert m.shape == (n,) and m.dtype == bool
    t = dropout_threshold(0.3)
    assert t == 19661  # 0.3 * 65536 = 19660.8, rounded
    for e in (0, 1, 7, 8, 21, n - 1):
        g, k = divmod(e, 8)
        w = philox4x32_10([g, 0, offset, 0], [seed & 0xFFFFFFFF, seed >> 32])[k // 2]
        half = (int(w) >> (16 * (k % 2))) & 0xFFFF
        assert m[e] == (half >= t)
    assert keep_mask(n, 0.0, seed, offset).all()
    assert dropout_threshold(1 - 2**-22) == 65536 and not keep_mask(n, 1 - 2**-22, seed, offset).any()
    assert dropout_threshold(1 - 2**-16) == 65535
    big = keep_mask(80_000, 0.25, seed, 0)
    assert abs(big.mean() - 0.75) < 0.01
    assert not np.array_equal(keep_mask(800, 0.5, seed, 0), keep_mask(800, 0.5, seed, 4))  # the offset matters
