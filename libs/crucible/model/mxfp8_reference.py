"""Exact MXFP8 reference in plain Python fractions, independent of torch's casts and of any device.

The ruler for `crucible.model.mxfp8` (unit tests, GPU checks): the block scale is the RCEIL exponent
found by exact comparison, elements are rounded to nearest even on the E4M3 grid. Slow; for checks only.
"""

from __future__ import annotations

import math
from fractions import Fraction

E4M3_MAX = Fraction(448)


def rceil_exponent(amax: Fraction) -> int:
    """Smallest e in [-127, 127] with amax <= 448 * 2^e."""
    if amax == 0:
        return -127
    e = math.floor(math.log2(amax / E4M3_MAX)) - 1
    while amax > E4M3_MAX * Fraction(2) ** e:
        e += 1
    while amax <= E4M3_MAX * Fraction(2) ** (e - 1):
        e -= 1
    return max(e, -127)


def e4m3_bits(q: Fraction, negative: bool) -> int:
    """Round |q| <= 448 to nearest even on the E4M3 grid and encode it."""
    mag = abs(q)
    exp = -6 if mag < Fraction(1, 64) else math.floor(math.log2(mag))
    while Fraction(2) ** exp > mag and exp > -6:
        exp -= 1
    while Fraction(2) ** (exp + 1) <= mag:
        exp += 1
    step = Fraction(2) ** (exp - 3)
    units = mag / step
    n = math.floor(units)
    rest = units - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2):
        n += 1
    value = n * step
    if value == 0:
        bits = 0
    elif value < Fraction(1, 64):
        bits = int(value / Fraction(2) ** -9)
    else:
        e = math.floor(math.log2(value))
        while Fraction(2) ** e > value:
            e -= 1
        while Fraction(2) ** (e + 1) <= value:
            e += 1
        bits = ((e + 7) << 3) | int((value / Fraction(2) ** e - 1) * 8)
    assert bits <= 0x7E, "scaled element outside E4M3 range"
    return bits | (0x80 if negative else 0)


def quantize_block(values: list[float]) -> tuple[list[int], int]:
    """(element bits, scale bits) of one block of Python floats (exact copies of fp32/bf16 values)."""
    if any(not math.isfinite(v) for v in values):
        return [0x7F] * len(values), 255
    amax = max(Fraction(abs(v)) for v in values)
    e = rceil_exponent(amax)
    scale = Fraction(2) ** e
    data = [e4m3_bits(Fraction(v) / scale, math.copysign(1.0, v) < 0) for v in values]
    return data, e + 127


def dequantize_value(bits: int, scale_bits: int) -> float:
    if scale_bits == 255 or bits & 0x7F == 0x7F:
        return math.nan
    sign = -1 if bits & 0x80 else 1
    exp, mant = (bits >> 3) & 0xF, bits & 7
    value = (
        Fraction(mant, 8) * Fraction(2) ** -6
        if exp == 0
        else (1 + Fraction(mant, 8)) * Fraction(2) ** (exp - 7)
    )
    return float(sign * value * Fraction(2) ** (scale_bits - 127))
