"""MXFP8 training GEMMs: each GEMM quantizes along its own reduction dimension."""

import torch

from crucible.model.mx_gemm import mx_grouped_mm, mx_linear, padded_rows
from crucible.model.mxfp8 import dequantize_mxfp8, quantize_mxfp8


def q(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Quantize-dequantize in blocks of 32 along `dim` (size already a multiple of 32)."""
    return dequantize_mxfp8(*quantize_mxfp8(t, dim=dim), dim=dim)


def _grads(fn, x, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def test_linear_quantizes_each_gemm_along_its_reduction_dim():
    g = torch.Generator().manual_seed(0)
    M, K, N = 64, 96, 32
    x, w, dy = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(M, N, generator=g)
    w = w * torch.exp2(torch.randint(-6, 6, (N, 1), generator=g).float())  # rows of very different size
    y, dx, dw = _grads(mx_linear, x, w, dy)
    assert torch.equal(y, q(x, 1) @ q(w, 1).T)
    assert torch.equal(dx, q(dy, 1) @ q(w, 0))
    assert torch.equal(dw, q(dy, 0).T @ q(x, 0))
    # the dimension matters: quantizing w along K for the grad-input GEMM gives another answer
    assert not torch.equal(dx, q(dy, 1) @ q(w, 1))


def test_linear_pads_ragged_dims_with_zeros_and_tracks_fp32():
    g = torch.Generator().manual_seed(1)
    x, w, dy = (
        torch.randn(2, 25, 40, generator=g),
        torch.randn(24, 40, generator=g),
        torch.randn(2, 25, 24, generator=g),
    )
    y, dx, dw = _grads(mx_linear, x, w, dy)
    y32, dx32, dw32 = _grads(lambda a, b: a @ b.T, x, w, dy)
    assert y.shape == (2, 25, 24) and dx.shape == x.shape and dw.shape == w.shape
    for got, want in ((y, y32), (dx, dx32), (dw, dw32)):
        rel = (got - want).norm() / want.norm()
        assert 0 < rel < 0.05  # E4M3 keeps 3 mantissa bits: a few percent, never exact


def test_grouped_gemm_equals_per_expert_linears_with_groups_padded_to_32():
    g = torch.Generator().manual_seed(2)
    counts, K, N = [5, 0, 40, 32, 1], 64, 32
    x = torch.randn(sum(counts), K, generator=g)
    w = torch.randn(len(counts), N, K, generator=g)
    dy = torch.randn(sum(counts), N, generator=g)
    y, dx, dw = _grads(lambda a, b: mx_grouped_mm(a, b, counts), x, w, dy)
    start = 0
    for e, c in enumerate(counts):
        rows = slice(start, start + c)
        ye, dxe, dwe = _grads(mx_linear, x[rows], w[e], dy[rows])
        assert torch.equal(y[rows], ye) and torch.equal(dx[rows], dxe) and torch.equal(dw[e], dwe), e
        start += c


def test_padded_rows_start_every_group_on_a_block_boundary():
    assert padded_rows([3, 0, 33, 1]).tolist() == [0, 1, 2, *range(32, 65), 96]
