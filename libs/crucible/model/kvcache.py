"""Key/value caches for incremental decoding: `KVCache`, sequences of a batch in lockstep (one shared
length), and `SlotCache`, independent sequences each at its own length (continuous batching)."""

from __future__ import annotations

from collections.abc import Callable
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

    def advance(self, n: int) -> None:
        self.length += n

    def mask(self, n: int) -> torch.Tensor | None:
        """Which keys each of the next `n` queries sees, [n, length + n]; None when that is plain causal
        attention (the first chunk, or a single query that sees everything)."""
        if self.length == 0 or n == 1:
            return None
        q_pos = torch.arange(self.length, self.length + n, device=self.k.device)
        return torch.arange(self.length + n, device=self.k.device)[None, :] <= q_pos[:, None]


@dataclass(eq=False)
class SlotCache:
    """Keys and values of independent sequences, one slot each, each at its own length: the cache of the
    continuous-batching engine (crucible.model.batcher).

    k and v are [n_layers, slots, n_kv_heads, max_len, head_dim], preallocated; positions [0, lengths[s])
    of slot s are valid. A forward runs on `SlotBatch`es, each a run of consecutive slots fed the same
    number of tokens: decoding writes in place and attends to a view of the cache, so nothing is copied
    per step (a gather of scattered slots would copy every row's keys and values, per layer)."""

    k: torch.Tensor
    v: torch.Tensor
    lengths: list[int]

    @classmethod
    def of(cls, cache: KVCache) -> SlotCache:
        """An empty slot per batch row of `cache` (a model's `new_cache`), sharing its buffers."""
        return cls(k=cache.k, v=cache.v, lengths=[0] * cache.batch_size)

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def grow(self, slots: int) -> None:
        """Room for `slots` sequences; the existing ones keep their slot and contents (one copy)."""
        if slots <= self.slots:
            return
        extra = slots - self.slots
        self.k = torch.cat([self.k, self.k.new_zeros((self.k.shape[0], extra, *self.k.shape[2:]))], dim=1)
        self.v = torch.cat([self.v, self.v.new_zeros((self.v.shape[0], extra, *self.v.shape[2:]))], dim=1)
        self.lengths += [0] * extra

    def copy_prefix(self, *, source: int, target: int, start: int, end: int) -> None:
        """Give `target` the keys and values of `source`'s positions [start, end) (a shared prefix)."""
        if not (0 <= start <= end <= self.lengths[source] and self.lengths[target] == start):
            raise ValueError(
                f"cannot copy positions [{start}, {end}) of a slot of length {self.lengths[source]} "
                f"to one of length {self.lengths[target]}"
            )
        self.k[:, target, :, start:end] = self.k[:, source, :, start:end]
        self.v[:, target, :, start:end] = self.v[:, source, :, start:end]
        self.lengths[target] = end

    def batch(self, rows: list[int]) -> SlotBatch:
        return SlotBatch(self, rows)

    def batches(self, slots: list[int]) -> list[SlotBatch]:
        """Slots in increasing order as batches of consecutive ones, in that order."""
        runs = [[slots[0]]]
        for slot in slots[1:]:
            if slot == runs[-1][-1] + 1:
                runs[-1].append(slot)
            else:
                runs.append([slot])
        return [SlotBatch(self, run) for run in runs]


class SlotBatch:
    """The slots one forward runs on, consecutive (batch row b is slot rows[b]), each continuing at its own
    length."""

    def __init__(self, cache: SlotCache, rows: list[int]) -> None:
        if not rows or rows != list(range(rows[0], rows[0] + len(rows))):
            raise ValueError(f"a batch needs a run of consecutive slots, got {rows}")
        self.cache = cache
        self.rows = rows
        device = cache.k.device
        self.rows_B = torch.tensor(rows, device=device)
        self.starts_B = torch.tensor([cache.lengths[r] for r in rows], device=device)
        self.length = max(cache.lengths[r] for r in rows)  # the longest row, before this forward
        self.uniform = all(cache.lengths[r] == self.length for r in rows)
        self._mask: tuple[int, torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def positions(self, n: int) -> torch.Tensor:
        """[B, n]: the positions of each row's next n tokens."""
        return self.starts_B[:, None] + torch.arange(n, device=self.starts_B.device)

    def write(
        self, layer: int, k_BHTd: torch.Tensor, v_BHTd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store each row's new keys and values at its own positions; return the rows' keys and values
        up to the longest row's end (positions past a row's own end are masked by `mask`)."""
        T = k_BHTd.shape[2]
        pos = self.positions(T)
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]  # [slots, H, max_len, d]
        k_cache[self.rows_B[:, None], :, pos] = k_BHTd.transpose(1, 2).to(k_cache.dtype)
        v_cache[self.rows_B[:, None], :, pos] = v_BHTd.transpose(1, 2).to(v_cache.dtype)
        end, first = self.length + T, self.rows[0]
        k = k_cache[first : first + len(self.rows), :, :end]
        v = v_cache[first : first + len(self.rows), :, :end]
        return k.to(k_BHTd.dtype), v.to(v_BHTd.dtype)

    def mask(self, n: int) -> torch.Tensor | None:
        """[B, 1, n, length + n]: each row's queries see its own keys up to their position; None when
        every query sees every key (one token per row, every row at the same length)."""
        if n == 1 and self.uniform:
            return None
        if self._mask is None or self._mask[0] != n:
            keys = torch.arange(self.length + n, device=self.starts_B.device)
            self._mask = (n, (keys[None, None, :] <= self.positions(n)[:, :, None])[:, None])
        return self._mask[1]

    def advance(self, n: int) -> None:
        for r in self.rows:
            self.cache.lengths[r] += n


class RaggedBatch:
    """Slot batches fed in one forward, each fed its own number of tokens per row (a continuous-batching
    step's decode rows, one token each, and its prefill chunks): the tokens of every part are packed into
    one row, [1, N], so each linear layer runs once over all of them; attention runs part by part, each
    part's rows at their own lengths (`split`, then `join`)."""

    def __init__(self, parts: list[tuple[SlotBatch, int]]) -> None:
        if not parts or any(n < 1 for _, n in parts):
            raise ValueError("a ragged batch needs parts of at least one token per row")
        rows = [r for batch, _ in parts for r in batch.rows]
        if len(set(rows)) != len(rows):
            raise ValueError(f"a ragged batch's parts need distinct slots, got {rows}")
        self.parts = parts
        self.sizes = [batch.batch_size * n for batch, n in parts]
        self.tokens = sum(self.sizes)
        self.end = max(batch.length + n for batch, n in parts)  # past the longest row's new tokens
        self.max_len = parts[0][0].max_len

    def positions(self, n: int) -> torch.Tensor:
        """[1, N]: the position of every packed token."""
        assert n == self.tokens, f"a ragged batch feeds {self.tokens} tokens, not {n}"
        return torch.cat([batch.positions(k).reshape(-1) for batch, k in self.parts])[None]

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[1, N, ...] to each part's [B, n, ...]."""
        chunks = x[0].split(self.sizes)
        return [
            c.reshape(batch.batch_size, n, *c.shape[1:])
            for c, (batch, n) in zip(chunks, self.parts, strict=True)
        ]

    def join(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """Each part's [B, n, ...] back to [1, N, ...]."""
        return torch.cat([x.reshape(-1, *x.shape[2:]) for x in xs])[None]

    def each(self, attend: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        """`attend(*pieces, batch)` for every part, on its [B, n, ...] pieces of each [1, N, ...] of xs,
        the results joined back to [1, N, ...]."""
        pieces = [self.split(x) for x in xs]
        return self.join([attend(*(p[i] for p in pieces), batch) for i, (batch, _) in enumerate(self.parts)])

    def last(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N, ...] to [rows, 1, ...]: each row's last token, rows in the parts' order."""
        return torch.cat([part[:, -1:] for part in self.split(x)])

    def advance(self, n: int) -> None:
        for batch, k in self.parts:
            batch.advance(k)


Cache = KVCache | SlotBatch | RaggedBatch
"""What a model's forward continues from (crucible.model.transformer)."""
