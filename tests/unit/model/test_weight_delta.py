"""Exact weight deltas (crucible.model.weight_delta): bit-exact round trips for every dtype and size,
compression of a sparse change, and refusal of deltas that do not fit their base."""

from __future__ import annotations

import pytest
import torch

from crucible.model import weight_delta
from crucible.model.weight_delta import DeltaError, apply_delta, encode_delta, tensor_sha256


def tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: not a multiple of 8
        torch.randn(5, 7, generator=g),
        torch.randn(2, 3, generator=g).to(torch.float16),
        torch.randint(0, 100, (3,), generator=g),
        torch.tensor(True),
        torch.tensor(1.5, dtype=torch.float64),
        torch.empty(0, 4),
    ]


def test_applying_a_delta_rebuilds_every_tensor_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_delta, "CHUNK_BYTES", 16)  # chunks that split tensors at odd offsets
    base, new = tensors(0), tensors(1)
    new[1][2, 3] = float("nan")
    new[1][0, 0] = -0.0
    for (rebuilt, sha256), want in zip(apply_delta(encode_delta(new, base), base), new, strict=True):
        assert (rebuilt.dtype, rebuilt.shape) == (want.dtype, want.shape)
        assert sha256 == tensor_sha256(rebuilt) == tensor_sha256(want)


def test_a_sparse_change_compresses_to_a_small_fraction() -> None:
    base = torch.randn(1024, 1024).to(torch.bfloat16)
    new = base.clone()
    new.view(-1)[torch.randperm(new.numel())[: new.numel() // 250]] += 0.5  # 0.4% of the elements
    delta = encode_delta([new], [base])
    assert len(delta) < 0.02 * base.numel() * base.element_size()
    assert torch.equal(apply_delta(delta, [base])[0][0], new)


def test_a_delta_that_does_not_fit_its_base_is_refused() -> None:
    base, new = tensors(0), tensors(1)
    delta = encode_delta(new, base)
    with pytest.raises(DeltaError, match="ends before"):
        apply_delta(delta, [*base, torch.zeros(4)])
    with pytest.raises(DeltaError, match="holds more"):
        apply_delta(delta, base[:-2])
    with pytest.raises(DeltaError, match="zstd"):
        apply_delta(b"not a zstd frame at all", base)
    with pytest.raises(DeltaError):
        encode_delta(new, base[:-1])
