"""MXFP8 training GEMMs (emulated): each of a linear layer's three GEMMs quantizes its operands along
its own reduction dimension, as MX hardware requires.

For y = x @ w.T with x [M, K] and w [N, K]:
  output       y  = q_K(x)  @ q_K(w).T     (blocks along K)
  grad-input   dx = q_N(dy) @ q_N(w)       (blocks along N)
  grad-weight  dw = q_M(dy).T @ q_M(x)     (blocks along M, the tokens)

Emulation dequantizes to fp32 and multiplies in fp32: products of two E4M3 values with power-of-two
scales are exact in fp32, so only the fp32 accumulation rounds, as on MX tensor cores — unless the two
blocks' scales together fall below 2^-126, where a product turns subnormal or zero in fp32 while the
hardware applies the scales to the block's sum. Every matmul emulates today; no path dispatches to
real MX kernels yet. The expert
grouped GEMM pads every token group to a multiple of 32 rows so grad-weight blocks never straddle two
experts. Inputs and master weights stay fp32; outputs are fp32.
"""

from __future__ import annotations

import torch

from crucible.model.mxfp8 import fake_quantize_mxfp8 as fq

BLOCK = 32


class _MXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_MK, w_NK)
        return fq(x_MK, dim=1) @ fq(w_NK, dim=1).T

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):  # pyright: ignore[reportIncompatibleMethodOverride]  (torch's documented form)
        x_MK, w_NK = ctx.saved_tensors
        dy_MN = dy_MN.float()
        dx = fq(dy_MN, dim=1) @ fq(w_NK, dim=0) if ctx.needs_input_grad[0] else None
        dw = fq(dy_MN, dim=0).T @ fq(x_MK, dim=0) if ctx.needs_input_grad[1] else None
        return dx, dw


def mx_linear(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """x[..., K] @ w.T in emulated MXFP8 with MX-quantized backward GEMMs."""
    lead = x.shape[:-1]
    y = _MXLinear.apply(x.reshape(-1, x.shape[-1]).float(), w_NK.float())
    return y.reshape(*lead, w_NK.shape[0])


def padded_rows(counts: list[int], *, multiple: int = BLOCK) -> torch.Tensor:
    """Row index of each token in a layout where every group starts at a multiple of `multiple`."""
    start, index = 0, []
    for c in counts:
        index.append(torch.arange(start, start + c))
        start += -(-c // multiple) * multiple
    return torch.cat(index) if index else torch.zeros(0, dtype=torch.long)


def _pad_groups(x_MK: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    out = x_MK.new_zeros(total, x_MK.shape[1])
    out[rows] = x_MK
    return out


class _MXGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_ENK: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ctx.save_for_backward(x_MK, w_ENK)
        ctx.counts = counts
        xq = fq(x_MK, dim=1).split(counts)
        wq = fq(w_ENK, dim=2)
        return torch.cat([xg @ wq[e].T for e, xg in enumerate(xq)])

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):  # pyright: ignore[reportIncompatibleMethodOverride]  (torch's documented form)
        x_MK, w_ENK = ctx.saved_tensors
        counts = ctx.counts
        dy_MN = dy_MN.float()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq = fq(dy_MN, dim=1).split(counts)
            wq = fq(w_ENK, dim=1)
            dx = torch.cat([g @ wq[e] for e, g in enumerate(dyq)])
        if ctx.needs_input_grad[1]:
            rows = padded_rows(counts).to(x_MK.device)
            padded = [-(-c // BLOCK) * BLOCK for c in counts]
            total = sum(padded)
            dyq = fq(_pad_groups(dy_MN, rows, total), dim=0).split(padded)
            xq = fq(_pad_groups(x_MK, rows, total), dim=0).split(padded)
            dw = torch.stack([dyq[e].T @ xq[e] for e in range(len(counts))])
        return dx, dw, None


def mx_grouped_mm(x_MK: torch.Tensor, w_ENK: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of x sorted by expert (`counts[e]` rows for expert e) times each expert's w[e].T, in MXFP8."""
    return _MXGroupedMM.apply(x_MK.float(), w_ENK.float(), counts)
