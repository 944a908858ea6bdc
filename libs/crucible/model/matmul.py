"""Dense and grouped (per-expert) matmuls at a chosen precision.

Master weights, norms and the residual stream are fp32. "bf16" rounds both operands to bf16 and returns
the product in bf16, as a bf16 GEMM with fp32 accumulation does (the next fp32 op promotes it). On CPU
the product itself runs in fp32 on the bf16-rounded operands: products of two bf16 values are exact in
fp32, so the result is the same up to summation order, and CPUs without bf16 units are many times
faster in fp32. "mxfp8" runs the emulated MX GEMMs (forward and both backward GEMMs) and returns fp32;
"fp32" is the plain product, for tests and references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from crucible.model.config import PRECISIONS
from crucible.model.mx_gemm import mx_grouped_mm, mx_linear

_BF16_COPIES = WeakIdKeyDictionary()


def bf16_operand(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bf16, held in the dtype the bf16 product runs in on t's device."""
    t = t.to(torch.bfloat16)
    return t.float() if t.device.type == "cpu" else t


def bf16_weight(w: torch.Tensor) -> torch.Tensor:
    """bf16_operand(w); under inference mode (the rollout's decoding) the copy is kept and reused until w
    changes. Nowhere else: FSDP refills unsharded parameters without bumping their version counter, so a
    cache keyed on it could serve stale weights to a no_grad forward of a sharded model."""
    if not torch.is_inference_mode_enabled():
        return bf16_operand(w)
    key = (w._version, w.data_ptr())
    hit = _BF16_COPIES.get(w)
    if hit is not None and hit[0] == key:
        return hit[1]
    copy = bf16_operand(w.detach())
    _BF16_COPIES[w] = (key, copy)
    return copy


def _native_grouped_mm(x_MK: torch.Tensor, w_ENK: torch.Tensor) -> bool:
    """One grouped-GEMM kernel on CUDA (rows 16-byte aligned in bf16); elsewhere a loop over experts."""
    return x_MK.is_cuda and x_MK.shape[1] % 8 == 0 and w_ENK.shape[1] % 8 == 0


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def linear(x: torch.Tensor, w: torch.Tensor, *, precision: str) -> torch.Tensor:
    """x[..., in] @ w[out, in].T."""
    if precision == "fp32":
        return F.linear(x, w)
    if precision == "bf16":
        return F.linear(bf16_operand(x), bf16_weight(w)).to(torch.bfloat16)
    if precision == "mxfp8":
        return mx_linear(x, w)
    raise ValueError(f"unknown precision {precision!r}")


def grouped_linear(
    x_MK: torch.Tensor, w_ENK: torch.Tensor, counts: list[int], *, precision: str
) -> torch.Tensor:
    """Rows of x grouped by expert (`counts[e]` rows for expert e), each group times w[e].T."""
    if len(counts) != w_ENK.shape[0] or sum(counts) != x_MK.shape[0]:
        raise ValueError(f"counts {counts} do not match {x_MK.shape[0]} rows and {w_ENK.shape[0]} experts")
    if precision == "mxfp8":
        return mx_grouped_mm(x_MK, w_ENK, counts)
    if precision == "bf16" and _native_grouped_mm(x_MK, w_ENK):
        offs = torch.tensor(counts, device=x_MK.device).cumsum(0).to(torch.int32)
        return F.grouped_mm(x_MK.to(torch.bfloat16), bf16_weight(w_ENK).transpose(-2, -1), offs=offs)
    if precision == "bf16":
        x_MK, w_ENK = bf16_operand(x_MK), bf16_weight(w_ENK)
    elif precision != "fp32":
        raise ValueError(f"unknown precision {precision!r}")
    out = [F.linear(g, w_ENK[e]) for e, g in enumerate(x_MK.split(counts)) if counts[e]]
    y = torch.cat(out) if out else x_MK.new_zeros(0, w_ENK.shape[1])
    return y.to(torch.bfloat16) if precision == "bf16" else y


def gathered_linear(
    x_MK: torch.Tensor, w_ENK: torch.Tensor, expert_M: torch.Tensor, *, precision: str
) -> torch.Tensor:
    """Row m times w[expert_M[m]].T by gathering each row's weights: for a handful of rows (decoding),
    where sorting rows into groups costs more than the products. fp32 and bf16 only."""
    if precision == "bf16":
        x_MK, w_ENK = bf16_operand(x_MK), bf16_weight(w_ENK)
    elif precision != "fp32":
        raise ValueError(f"gathered_linear does not run at precision {precision!r}")
    y = torch.bmm(w_ENK[expert_M], x_MK.unsqueeze(-1)).squeeze(-1)
    return y.to(torch.bfloat16) if precision == "bf16" else y
