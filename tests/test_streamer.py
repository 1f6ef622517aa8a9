"""The streamer's bookkeeping that needs no GPU: which pages to register, which copies to issue."""

import numpy as np

from ferry.weight import Weight
from ferry.quant import Q
from ferry.backends.streamer import PAGE, expert_runs, page_ranges


def test_neighbouring_experts_are_copied_as_one_run():
    assert expert_runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 6), (7, 9)]
    assert expert_runs([]) == [] and expert_runs([127]) == [(127, 128)]


def test_registered_ranges_cover_every_weight_byte_on_whole_pages_and_merge_neighbours():
    buf = np.zeros(10 * PAGE, dtype=np.uint8)
    base = buf.ctypes.data

    def w(start, size):
        return Weight("w", Q.Q8_0, (size,), buf[start:start + size])

    weights = [w(100, 50), w(PAGE + 10, 20), w(5 * PAGE + 3, 2 * PAGE)]  # the first two share no page but touch
    ranges = page_ranges(weights)
    for start, end in ranges:
        assert start % PAGE == 0 and end % PAGE == 0
    for x in weights:
        a, b = x.data.ctypes.data, x.data.ctypes.data + x.data.nbytes
        assert any(s <= a and b <= e for s, e in ranges)
    assert len(ranges) == 2 and ranges[0][0] <= base + 100 and ranges[1][0] <= base + 5 * PAGE + 3
