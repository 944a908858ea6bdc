"""Grouped-query self-attention with rotary positions and an optional KV cache.

Projections run at the model's precision; the attention core (scores, softmax, weighted sum) runs in
fp32.
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
        self.wq = Linear(cfg.dim, cfg.n_heads * cfg.head_dim)
        self.wk = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim)
        self.wv = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim)

    def forward(
        self, x_BTD: torch.Tensor, cos_Th: torch.Tensor, sin_Th: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q = self.wq(x_BTD).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos_Th, sin_Th), apply_rotary(k, cos_Th, sin_Th)
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
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
