"""The host-side integer helpers give what Triton's constexpr functions give."""

import triton

from loraplex.kernels.host_math import cdiv, next_power_of_2


def test_same_as_triton():
    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 7, 16, 64, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    for n in (2**31 - 1, 2**31, 2**40 + 3):
        assert next_power_of_2(n) == triton.next_power_of_2(n) and cdiv(n, 16) == triton.cdiv(n, 16)
