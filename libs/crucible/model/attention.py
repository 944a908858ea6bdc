"""Grouped-query self-attention with rotary positions and an optional KV cache
(`KVCache` or a continuous batch's `SlotBatch`: the cache says which keys each query sees; a
`RaggedBatch` packs several slot batches' tokens, so the projections run once and the core per part).

Projections run at the model's precision (queries, keys and values as one fused `wqkv` weight, rows
in that order, with an optional bias); queries and keys may be RMS-normalised per head (`qk_norm="head"`,
Qwen3) or over the whole projection (`"full"`, OLMoE) before the rotation; the attention core (scores,
softmax, weighted sum) runs in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from crucible.model.config import ModelConfig
from crucible.model.kvcache import Cache, KVCache, RaggedBatch, SlotBatch
from crucible.model.layers import Linear, RMSNorm, apply_rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":
            q_width, k_width = (cfg.head_dim, cfg.head_dim) if cfg.qk_norm == "head" else (
                cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim)  # fmt: skip
            self.q_norm = RMSNorm(q_width, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(k_width, eps=cfg.norm_eps)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_Td: torch.Tensor,
        sin_Td: torch.Tensor,
        cache: Cache | None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(x_BTD).split([H * hd, KV * hd, KV * hd], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(B, T, H, hd), k.view(B, T, KV, hd), v.view(B, T, KV, hd)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos_Td, sin_Td), apply_rotary(k, cos_Td, sin_Td)
        if isinstance(cache, RaggedBatch):
            o = cache.each(self._attend, q, k, v)
        else:
            o = self._attend(q, k, v, cache)
        return self.wo(o.reshape(B, T, -1))

    def _attend(
        self,
        q_BTHd: torch.Tensor,
        k_BTHd: torch.Tensor,
        v_BTHd: torch.Tensor,
        cache: KVCache | SlotBatch | None,
    ) -> torch.Tensor:
        """The attention core of rows fed the same number of tokens: [B, T, H, d] out."""
        T = q_BTHd.shape[1]
        q, k, v = q_BTHd.transpose(1, 2), k_BTHd.transpose(1, 2), v_BTHd.transpose(1, 2).float()
        mask = None
        if cache is not None:
            mask = cache.mask(T)
            k, v = cache.write(self.layer_id, k, v)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, enable_gqa=True
        )
        return o.transpose(1, 2)
