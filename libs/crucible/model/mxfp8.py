"""Exact MXFP8 (OCP MX) quantization: FP8 E4M3 elements in blocks sharing one E8M0 power-of-two scale.

Scale rule (RCEIL): the block exponent is e = ceil(log2(amax / 448)), the smallest power of two that
puts every scaled element inside E4M3's range. It is computed from the float's bits, not with a float
division and log2 (those land one binade off near 448 * 2^k), and it never saturates: every finite
fp32 or bf16 amax has an exponent in [-127, 120]. Elements are x * 2^-e (exact in fp32) rounded to
nearest even by the E4M3 cast. Special blocks:

- all zeros: scale 2^-127 (the smallest E8M0 value); elements keep their sign.
- any NaN or +-Inf: scale NaN (0xFF), so the whole block decodes as NaN; elements are NaN too.
  E4M3 has no Inf and no finite scale can hold one, so Inf poisons its block the way NaN does.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
_E4M3_NAN = 0x7F
_F32_FRAC_BITS = 23
_FRAC_OF_1_75 = 0x600000  # 448 = 1.75 * 2^8: the fraction bits of 1.75


def _check(x: torch.Tensor, block_size: int, dim: int) -> int:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_mxfp8 takes float32, bfloat16 or float16, not {x.dtype}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if x.dim() == 0:
        raise ValueError("quantize_mxfp8 needs at least one dimension")
    dim = dim % x.dim()
    if x.shape[dim] % block_size:
        raise ValueError(f"dimension {dim} of shape {tuple(x.shape)} is not a multiple of {block_size}")
    return dim


def rceil_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Unbiased RCEIL scale exponent of finite non-negative fp32 block maxima, as int32 in [-127, 120]."""
    bits = amax.contiguous().view(torch.int32)
    biased = torch.bitwise_right_shift(bits, _F32_FRAC_BITS)
    frac = torch.bitwise_and(bits, (1 << _F32_FRAC_BITS) - 1)
    # amax = 1.f * 2^(biased-127) <= 1.75 * 2^(8+e)  <=>  e >= biased - 135 + [1.f > 1.75]
    exp = biased - (E8M0_BIAS + 8) + (frac > _FRAC_OF_1_75).to(torch.int32)
    # zero and subnormal maxima need a scale below 2^-127: clamp to the smallest E8M0 value
    exp = torch.where(biased == 0, -E8M0_BIAS, exp)
    return exp.clamp(min=-E8M0_BIAS)


def pow2(exp: torch.Tensor) -> torch.Tensor:
    """2^exp as exact fp32 for int32 exponents in [-127, 127] (2^-127 is subnormal)."""
    normal = torch.bitwise_left_shift(exp.clamp(min=-126) + E8M0_BIAS, _F32_FRAC_BITS)
    bits = torch.where(exp == -E8M0_BIAS, torch.full_like(exp, 1 << 22), normal)
    return bits.view(torch.float32)


def quantize_mxfp8(
    x: torch.Tensor, *, block_size: int = 32, dim: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` in blocks of `block_size` along `dim`.

    Returns (data, scales): data is float8_e4m3fn with x's shape, scales is float8_e8m0fnu with x's
    shape except `dim`, which is divided by the block size.
    """
    dim = _check(x, block_size, dim)
    xt = x.movedim(dim, -1).to(torch.float32).contiguous()
    blocks = xt.view(*xt.shape[:-1], xt.shape[-1] // block_size, block_size)
    amax = blocks.abs().amax(dim=-1)  # NaN and Inf propagate
    finite = torch.isfinite(amax)
    exp = rceil_exponent(torch.where(finite, amax, 0.0))
    scaled = blocks * pow2(-exp).unsqueeze(-1)
    data = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    data = torch.where(finite.unsqueeze(-1), data, torch.full_like(data, _E4M3_NAN))
    scale_bits = torch.where(finite, exp + E8M0_BIAS, torch.full_like(exp, E8M0_NAN)).to(torch.uint8)
    data = data.reshape(xt.shape).view(torch.float8_e4m3fn).movedim(-1, dim)
    scales = scale_bits.view(torch.float8_e8m0fnu).movedim(-1, dim)
    return data, scales


def dequantize_mxfp8(
    data: torch.Tensor, scales: torch.Tensor, *, block_size: int = 32, dim: int = -1
) -> torch.Tensor:
    """Inverse of quantize_mxfp8, exact in float32 (a NaN scale gives a NaN block)."""
    if data.dtype != torch.float8_e4m3fn or scales.dtype != torch.float8_e8m0fnu:
        raise TypeError(
            f"expected float8_e4m3fn data and float8_e8m0fnu scales, got {data.dtype}, {scales.dtype}"
        )
    dim = dim % data.dim()
    expected = list(data.shape)
    expected[dim] //= block_size
    if data.shape[dim] % block_size or list(scales.shape) != expected:
        raise ValueError(
            f"scales {tuple(scales.shape)} do not match data {tuple(data.shape)} in blocks of {block_size}"
        )
    d = data.movedim(dim, -1).to(torch.float32)
    s_bits = scales.movedim(dim, -1).view(torch.uint8).to(torch.int32)
    s = torch.where(s_bits == E8M0_NAN, torch.nan, pow2(s_bits.clamp(max=254) - E8M0_BIAS))
    out = d.reshape(*d.shape[:-1], d.shape[-1] // block_size, block_size) * s.unsqueeze(-1)
    return out.reshape(d.shape).movedim(-1, dim)


def fake_quantize_mxfp8(x: torch.Tensor, *, dim: int = -1, block_size: int = 32) -> torch.Tensor:
    """dequantize(quantize(x)) in fp32, bit for bit, without materialising the encodings; `dim` is
    zero-padded to a whole number of blocks and cut back."""
    dim = dim % x.dim()
    size = x.shape[dim]
    pad = -size % block_size
    xt = x.movedim(dim, -1).to(torch.float32)
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    xt = xt.contiguous()
    blocks = xt.view(*xt.shape[:-1], xt.shape[-1] // block_size, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(amax)
    exp = rceil_exponent(torch.where(finite, amax, 0.0))
    q = (blocks * pow2(-exp)).to(torch.float8_e4m3fn).to(torch.float32) * pow2(exp)
    q = torch.where(finite, q, torch.nan).view(xt.shape)
    if pad:
        q = q[..., :size]
    return q.movedim(-1, dim)
