"""Rounding for the quantized KV caches inside Triton kernels: float8 e4m3 (``torch.float8_e4m3fn``) and int8 rows
with their own scales (``quantize_int8_rows``, twin ``attention_ref.quantize_int8_rows``).

``round_to_e4m3(x)`` returns, in fp32, the e4m3 value a cast to ``torch.float8_e4m3fn`` gives (round to nearest
even, saturating at +-448 instead of the plain cast's NaN), so the store that follows casts an exactly
representable value. On the GPU that cast would round correctly by itself and the extra ALU work of this helper
is lost in the store's memory traffic; Triton's CPU interpreter, however, drops the mantissa's carry when it
rounds (1.96 became 1.0 instead of 2.0), and the interpreter is where the kernels are tested against their
twins. Rounding before the cast gives the same bits on both.
"""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX = 448.0


@triton.jit
def round_to_e4m3(x):
    """fp32 ``x`` rounded to the nearest e4m3 value (ties to even), saturated at +-448."""
    x = x.to(tl.float32)
    a = tl.minimum(tl.abs(x), 448.0)
    biased = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # one e4m3 ulp at a's binade: 2^(e - 3) for normals (e >= -6), 2^-9 for the subnormals below
    ulp_exp = tl.maximum(biased, 127 - 6) - 3
    ulp = (ulp_exp << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds |y| < 2^22 to an integer, ties to even
    steps = (a / ulp + magic) - magic
    r = tl.minimum(steps * ulp, 448.0)
    # x's sign bit onto r by bits, so a negative x that rounds to zero gives -0 as torch's cast does (a select of
    # -r / r may be compiled into a +0 for it)
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize_int8_rows(x):
    """Rows of ``x`` [R, C] as int8 with one fp32 scale each: s = max|x| / 127, q = round(x / s) (ties to even,
    as torch.round); an all-zero row gets s = 0 and q = 0. Returns (q, s)."""
    x = x.to(tl.float32)
    s = tl.max(tl.abs(x), 1) / 127.0
    inv = tl.where(s > 0.0, 1.0 / tl.where(s > 0.0, s, 1.0), 0.0)
    magic = 12582912.0  # 1.5 * 2^23: rounds |y| <= 127 to an integer, ties to even
    q = (x * inv[:, None] + magic) - magic
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    return q.to(tl.int8), s
