"""Multi-head latent attention (DeepSeek-V2/V3).

Queries come through a low-rank latent (`wq_a`, RMSNorm, `wq_b`) or a direct projection; keys and
values through one shared latent of `kv_lora_rank` features (`wkv_a`, RMSNorm, `wkv_b`), plus
`qk_rope_head_dim` key features shared by every head that carry the rotary position. Each head's query
and key are [nope | rope] features; values have `v_head_dim`. The KV cache keeps the latents, not the
expanded keys and values: its k is the normalised latent [B, 1, T, kv_lora_rank] and its v the rotated
shared key [B, 1, T, qk_rope_head_dim]. Projections at the model's precision, the core in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from crucible.model.config import ModelConfig
from crucible.model.kvcache import Cache, KVCache, RaggedBatch, SlotBatch
from crucible.model.layers import Linear, RMSNorm, apply_rotary

LATENT_NORM_EPS = 1e-6  # DeepSeek's latent norms use their own epsilon, not the model's


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1), (x2, x3), ... pairs to [x0, x2, ... | x1, x3, ...], the layout `apply_rotary` turns."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = cfg.n_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank, self.interleave = cfg.kv_lora_rank, cfg.rope_interleave
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.wq_a = Linear(cfg.dim, cfg.q_lora_rank)
            self.q_norm = RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = Linear(cfg.q_lora_rank, cfg.n_heads * qk)
        else:
            self.wq = Linear(cfg.dim, cfg.n_heads * qk)
        self.wkv_a = Linear(cfg.dim, self.kv_rank + self.rope)
        self.kv_norm = RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = Linear(self.kv_rank, cfg.n_heads * (self.nope + self.v_dim))
        self.wo = Linear(cfg.n_heads * self.v_dim, cfg.dim)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_Td: torch.Tensor,
        sin_Td: torch.Tensor,
        cache: Cache | None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H = self.n_heads
        q = self.wq_b(self.q_norm(self.wq_a(x_BTD))) if hasattr(self, "wq_a") else self.wq(x_BTD)
        q_nope, q_rope = q.float().view(B, T, H, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x_BTD).float().split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_norm(latent)
        k_rope = k_rope.view(B, T, 1, self.rope)
        if self.interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rotary(q_rope, cos_Td, sin_Td), apply_rotary(k_rope, cos_Td, sin_Td)
        if isinstance(cache, RaggedBatch):
            o = cache.each(self._attend, q_nope, q_rope, latent, k_rope)
        else:
            o = self._attend(q_nope, q_rope, latent, k_rope, cache)
        return self.wo(o.reshape(B, T, H * self.v_dim))

    def _attend(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent_BTr: torch.Tensor,
        k_rope_BT1r: torch.Tensor,
        cache: KVCache | SlotBatch | None,
    ) -> torch.Tensor:
        """The attention core of rows fed the same number of tokens: [B, T, H, v_dim] out."""
        B, T, H, _ = q_nope.shape
        latent, k_rope = latent_BTr.view(B, 1, T, self.kv_rank), k_rope_BT1r.transpose(1, 2)  # [B, 1, T, *]
        mask = None
        if cache is not None:
            mask = cache.mask(T)
            latent, k_rope = cache.write(self.layer_id, latent, k_rope)
        S = latent.shape[2]
        kv = self.wkv_b(latent.transpose(1, 2).reshape(B, S, self.kv_rank)).float().view(B, S, H, -1)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, H, S, self.rope)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1)
        return o.transpose(1, 2)
