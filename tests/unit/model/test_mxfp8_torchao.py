"""torchao's MX formats checked against Crucible's exact quantizer (see docs/decisions/0002)."""

import math

import pytest
import torch

from crucible.model.mx_gemm import mx_grouped_mm
from crucible.model.mxfp8 import quantize_mxfp8

mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
grouped = pytest.importorskip("torchao.prototype.moe_training.mxfp8_grouped_mm")
from torchao.prototype.mx_formats.config import KernelPreference  # noqa: E402  (after the skips above)


def _torchao(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales, data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, mx_tensor.ScaleCalculationMode.RCEIL)
    return data.view(torch.uint8), scales.view(torch.uint8).reshape(x.shape[0])


def _ours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    data, scales = quantize_mxfp8(x)
    return data.view(torch.uint8), scales.view(torch.uint8)[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_agrees_bit_for_bit_on_ordinary_data(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 32, generator=g) * torch.exp2(
        torch.randint(-60, 60, (2000, 1), generator=g).float()
    )
    x = x.to(dtype)
    (td, ts), (od, os_) = _torchao(x), _ours(x)
    assert torch.equal(ts, os_) and torch.equal(td, od)


def test_torchao_differs_only_in_the_documented_blocks():
    """Near-binade maxima (scale one binade low, elements clamped), tiny blocks (scale 2^-127, which
    torchao applies as 1.0) and blocks with an Inf (scale 254, elements clamped to 448)."""
    rows = []
    for k in range(-135, 120):
        at = torch.tensor(448.0 * 2.0**k)
        for amax in (at, torch.nextafter(at, torch.tensor(math.inf)), torch.nextafter(at, torch.tensor(0.0))):
            if torch.isfinite(amax) and amax > 0:
                row = torch.zeros(32)
                row[0], row[1] = amax, -amax / 3
                rows.append(row)
    inf_row = torch.ones(32)
    inf_row[4] = math.inf
    rows.append(inf_row)
    x = torch.stack(rows)
    (td, ts), (od, os_) = _torchao(x), _ours(x)
    differs = (ts != os_) | (td != od).any(dim=1)
    amax = x.abs().amax(dim=1).double()
    one_binade_low = (ts.long() == os_.long() - 1) & (
        amax <= 448.0 * torch.exp2(os_.double() - 128) * (1 + 2**-20)
    )
    tiny = os_ == 0
    nonfinite = ~torch.isfinite(x).all(dim=1)
    assert not (differs & ~(one_binade_low | tiny | nonfinite)).any()
    assert (differs & one_binade_low).any(), "torchao's eager RCEIL now matches: revisit docs/decisions/0002"


def test_torchao_grouped_gemm_is_ours_rounded_to_bf16():
    """torchao's CPU emulation dequantizes to bf16 and returns bf16; ours keeps fp32. On bf16-exact
    inputs its forward output is exactly ours rounded to bf16, and its gradients are within bf16 rounding."""
    g = torch.Generator().manual_seed(1)
    counts, K, N = [32, 64, 32], 64, 32
    x = torch.randn(128, K, generator=g).bfloat16()
    w = torch.randn(3, N, K, generator=g).bfloat16()
    dy = torch.randn(128, N, generator=g).bfloat16()
    xa, wa = x.clone().requires_grad_(), w.transpose(-2, -1).clone().requires_grad_()
    offs = torch.tensor([32, 96, 128], dtype=torch.int32)
    ya = grouped._to_mxfp8_then_scaled_grouped_mm(
        xa, wa, offs=offs, out_dtype=torch.bfloat16, kernel_preference=KernelPreference.EMULATED
    )
    ya.backward(dy)
    xo, wo = x.float().requires_grad_(), w.float().requires_grad_()
    yo = mx_grouped_mm(xo, wo, counts)
    yo.backward(dy.float())
    assert yo.dtype == torch.float32 and ya.dtype == torch.bfloat16
    assert torch.equal(yo.bfloat16(), ya)
    torch.testing.assert_close(xa.grad.float(), xo.grad, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(wa.grad.transpose(-2, -1).float(), wo.grad, rtol=2**-8, atol=1e-6)
