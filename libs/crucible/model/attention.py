"""Grouped-query self-attention with rotary positions and an optional KV cache.

Projections run at the model's precision (queries, keys and values as one fused `wqkv` weight, rows
in that order); the attention core (scores, softmax, weighted sum) runs in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from crucible.model.config import ModelConfig
from crucible.model.kvcache import KVCache
from crucible.model.layers import Linear, apply_rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim)

    def forward(
        self, x_BTD: torch.Tensor, cos_Td: torch.Tensor, sin_Td: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        qkv = self.wqkv(x_BTD).view(B, T, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        qk, v = qkv.split([self.n_heads + self.n_kv_heads, self.n_kv_heads], dim=2)
        q, k = apply_rotary(qk, cos_Td, sin_Td).transpose(1, 2).split([self.n_heads, self.n_kv_heads], dim=1)
        v = v.transpose(1, 2).float()
        start = 0
        if cache is not None:
            start = cache.length
            k, v = cache.write(self.layer_id, k, v)
        if start == 0 or T == 1:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0 and T > 1, enable_gqa=True)
        else:
            # queries sit at positions start..start+T-1 and see every key up to their own position
            q_pos = torch.arange(start, start + T, device=x_BTD.device)
            mask = torch.arange(start + T, device=x_BTD.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(B, T, -1))
