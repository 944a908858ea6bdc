"""Key/value cache for incremental decoding: one preallocated buffer per layer, one shared length."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class KVCache:
    """Keys and values of the tokens seen so far, for every sequence of a batch in lockstep.

    k and v are [n_layers, batch, n_kv_heads, max_len, head_dim] (v's last dim may differ: latent
    attention caches its latent as k and its shared rotary key as v); positions [0, length) are valid.
    The model writes the new tokens' keys and values and then advances `length`.
    """

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    @classmethod
    def empty(
        cls,
        *,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        v_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> KVCache:
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"batch_size and max_len must be positive, got {batch_size}, {max_len}")
        shape = (n_layers, batch_size, n_kv_heads, max_len)
        return cls(
            k=torch.zeros((*shape, head_dim), dtype=dtype, device=device),
            v=torch.zeros((*shape, head_dim if v_dim is None else v_dim), dtype=dtype, device=device),
        )

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def reset(self) -> None:
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (e.g. to re-decode from an earlier point)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def write(
        self, layer: int, k_BHTd: torch.Tensor, v_BHTd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' keys and values; return all keys and values up to them."""
        start, end = self.length, self.length + k_BHTd.shape[2]
        self.k[layer, :, :, start:end] = k_BHTd.to(self.k.dtype)
        self.v[layer, :, :, start:end] = v_BHTd.to(self.v.dtype)
        k = self.k[layer, :, :, :end].to(k_BHTd.dtype)
        v = self.v[layer, :, :, :end].to(v_BHTd.dtype)
        return k, v
