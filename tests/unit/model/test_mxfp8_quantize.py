"""The MXFP8 quantizer against the exact Python reference, bit for bit."""

import math

import pytest
import torch

from crucible.model.mxfp8 import dequantize_mxfp8, fake_quantize_mxfp8, quantize_mxfp8
from crucible.model.mxfp8_reference import dequantize_value, quantize_block

F32 = torch.float32


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_matches_reference(x: torch.Tensor) -> None:
    """x is [blocks, 32]; every block's data and scale bits must equal the reference's."""
    data, scales = quantize_mxfp8(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (x.shape[0], 1)
    got_d, got_s = _bits(data).tolist(), _bits(scales)[:, 0].tolist()
    for i, row in enumerate(x.float().tolist()):
        want_d, want_s = quantize_block(row)
        assert (got_s[i], got_d[i]) == (want_s, want_d), f"block {i}: {row}"
    deq = dequantize_mxfp8(data, scales)
    # the exact MX values, rounded once to fp32 (the largest blocks can round up past fp32's max)
    want = torch.tensor(
        [[dequantize_value(d, got_s[i]) for d in row] for i, row in enumerate(got_d)], dtype=F32
    )
    assert torch.equal(deq.isnan(), want.isnan())
    assert torch.equal(deq.masked_fill(deq.isnan(), 0), want.masked_fill(want.isnan(), 0))


def _block(first: float, rest: torch.Tensor, dtype=F32) -> torch.Tensor:
    row = torch.cat([torch.tensor([first], dtype=F32), rest.to(F32)]).to(dtype)
    return row


def amax_edge_blocks(dtype=F32) -> torch.Tensor:
    """Blocks whose maximum sits at, just above and just below 448 * 2^k, for every k fp32 can hold."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for k in range(-140, 120):
        at = torch.tensor(448.0 * 2.0**k, dtype=F32).to(dtype)
        if at == 0 or not torch.isfinite(at):
            continue
        up = torch.nextafter(at, torch.tensor(math.inf, dtype=dtype))
        down = torch.nextafter(at, torch.tensor(0.0, dtype=dtype))
        for amax in (at, up, down):
            if not torch.isfinite(amax):
                continue
            rest = torch.cat([(torch.rand(7, generator=g) * 2 - 1) * amax.float(), torch.zeros(24)])
            rows.append(_block(amax.item(), rest, dtype))
    return torch.stack(rows)


def test_amax_at_and_around_448_times_powers_of_two():
    assert_matches_reference(amax_edge_blocks())


def test_amax_edges_in_bf16_input():
    x = amax_edge_blocks(torch.bfloat16)
    assert_matches_reference(x)
    d16, s16 = quantize_mxfp8(x)
    d32, s32 = quantize_mxfp8(x.float())
    assert torch.equal(_bits(d16), _bits(d32)) and torch.equal(_bits(s16), _bits(s32))


def test_extreme_fp32_maxima_never_saturate():
    big = torch.finfo(F32).max
    x = torch.stack(
        [
            _block(big, torch.full((31,), -big)),
            _block(2.0**-126, torch.full((31,), 2.0**-127)),
            _block(2.0**-149, torch.full((31,), -(2.0**-149))),
        ]
    )
    assert_matches_reference(x)
    _, scales = quantize_mxfp8(x)
    assert _bits(scales)[0, 0] == 127 + 120  # the largest exponent any fp32 needs, below E8M0's 254
    assert _bits(scales)[1:, 0].tolist() == [0, 0]


def test_round_to_nearest_even_ties():
    """Every midpoint between adjacent E4M3 values (normal and subnormal), at several block scales."""
    ties = [(n + 0.5) * 2.0**-9 for n in range(8)]
    ties += [
        (8 + m + 0.5) * 2.0 ** (e - 3)
        for e in range(-6, 9)
        for m in range(8)
        if (8 + m + 0.5) * 2.0 ** (e - 3) < 448
    ]
    ties = torch.tensor(ties, dtype=F32)
    rows = []
    for k in (-30, 0, 7, 50):
        scaled = ties * 2.0**k
        for start in range(0, len(scaled), 30):
            chunk = scaled[start : start + 30]
            signs = torch.where(torch.arange(len(chunk)) % 2 == 0, 1.0, -1.0)
            rest = torch.cat([chunk * signs, torch.zeros(31 - len(chunk))])
            rows.append(_block(448.0 * 2.0**k, rest))
    assert_matches_reference(torch.stack(rows))
    # spot checks of the rule itself: 1.0625 -> 1.0, 1.1875 -> 1.25, 432 -> 448, 2^-10 -> 0
    block = torch.zeros(1, 32)
    block[0, :5] = torch.tensor([448.0, 1.0625, 1.1875, 432.0, 2.0**-10])
    data, _ = quantize_mxfp8(block)
    assert data.float()[0, :5].tolist() == [448.0, 1.0, 1.25, 448.0, 0.0]


def test_signed_zero_and_all_zero_blocks():
    x = torch.zeros(3, 32)
    x[0] = -0.0
    x[1, ::2] = -0.0
    x[2, 0], x[2, 1], x[2, 2] = 448.0, -0.0, -(2.0**-12)  # the last rounds to zero and keeps its sign
    assert_matches_reference(x)
    data, scales = quantize_mxfp8(x)
    assert _bits(scales)[:2, 0].tolist() == [0, 0]  # all-zero blocks take the smallest scale, 2^-127
    assert _bits(data)[0].tolist() == [0x80] * 32
    assert _bits(data)[2, 1:3].tolist() == [0x80, 0x80]
    assert torch.equal(torch.signbit(dequantize_mxfp8(data, scales)), torch.signbit(x))


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_nonfinite_values_poison_only_their_block(poison):
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    x[1, 7] = poison
    assert_matches_reference(x)
    data, scales = quantize_mxfp8(x)
    assert _bits(scales)[:, 0].tolist()[1] == 255
    out = dequantize_mxfp8(data, scales)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


def test_subnormal_blocks():
    g = torch.Generator().manual_seed(3)
    tiny = (torch.rand(8, 32, generator=g) * 2 - 1) * 2.0**-126  # fp32 subnormals
    mixed = (torch.rand(8, 32, generator=g) * 2 - 1) * 2.0**-118  # around the smallest scale's reach
    assert_matches_reference(torch.cat([tiny, mixed]))
    assert_matches_reference(torch.cat([tiny, mixed]).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_data_across_scales(dtype):
    g = torch.Generator().manual_seed(4)
    span = 12 if dtype == torch.float16 else 100
    x = torch.randn(300, 32, generator=g) * torch.exp2(
        torch.randint(-span, span, (300, 1), generator=g).float()
    )
    x[::7, 3] = x[::7].abs().amax(dim=1) * -1.0  # negative maxima
    assert_matches_reference(x.to(dtype))


def test_blocks_along_any_dimension():
    x = torch.randn(4, 64, 96, generator=torch.Generator().manual_seed(5))
    data, scales = quantize_mxfp8(x, dim=1, block_size=16)
    assert data.shape == x.shape and scales.shape == (4, 4, 96)
    ref_d, ref_s = quantize_mxfp8(x.transpose(1, 2).contiguous(), block_size=16)
    assert torch.equal(_bits(data), _bits(ref_d.transpose(1, 2)))
    assert torch.equal(_bits(scales), _bits(ref_s.transpose(1, 2)))
    back = dequantize_mxfp8(data, scales, dim=1, block_size=16)
    assert back.dtype == torch.float32
    # Within half an E4M3 step: |x|/16 for normal elements, half a subnormal step (2^-10 of the block's
    # scale) for elements that land in E4M3's subnormal range.
    block_scale = scales.float().repeat_interleave(16, dim=1)
    assert ((back - x).abs() <= torch.maximum(x.abs() / 16, block_scale * 2**-10) + 1e-30).all()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.zeros(4, 40))
    with pytest.raises(TypeError, match="float32"):
        quantize_mxfp8(torch.zeros(4, 32, dtype=torch.int32))
    data, scales = quantize_mxfp8(torch.zeros(4, 32))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp8(data, scales, block_size=16)
    with pytest.raises(TypeError):
        dequantize_mxfp8(data.float(), scales)


def test_reference_on_hand_computed_blocks():
    # 448 fits scale 2^0 exactly: E4M3 0x7E is 1.75 * 2^8
    assert quantize_block([448.0] + [0.0] * 31) == ([0x7E] + [0] * 31, 127)
    # 449 needs 2^1; 449 / 2 = 224.5 lies between 224 (0x76) and 240 (0x77): nearest is 224
    data, scale = quantize_block([449.0, -1.0] + [0.0] * 30)
    assert (scale, data[0], data[1]) == (128, 0x76, 0x80 | 0x30)  # -1 / 2 = -0.5 = 2^-1 -> exponent 6
    assert dequantize_value(0x76, 128) == 448.0 and dequantize_value(0x01, 127) == 2.0**-9


def test_fake_quantize_is_dequantize_of_quantize_and_pads_ragged_dims():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 64, 40, generator=g) * torch.exp2(
        torch.randint(-130, 100, (5, 64, 1), generator=g).float()
    )
    x[0, 0, 0], x[1, 2, 3], x[2, 0, :] = math.nan, -math.inf, 0.0
    for dim in (0, 1, 2):
        got = fake_quantize_mxfp8(x, dim=dim)
        size = x.shape[dim]
        padded = torch.nn.functional.pad(x.movedim(dim, -1), (0, -size % 32)).movedim(-1, dim)
        want = dequantize_mxfp8(*quantize_mxfp8(padded, dim=dim), dim=dim).narrow(dim, 0, size)
        assert got.shape == x.shape
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.masked_fill(got.isnan(), 0), want.masked_fill(want.isnan(), 0))
