"""Decoder-only MoE transformer: the policy used by both trainer and rollout."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from crucible.model.attention import Attention
from crucible.model.config import ModelConfig
from crucible.model.kvcache import Cache, KVCache, RaggedBatch, SlotBatch
from crucible.model.layers import Embedding, FeedForward, Linear, RMSNorm, rotary_tables
from crucible.model.matmul import check_precision, linear
from crucible.model.mla import LatentAttention
from crucible.model.moe import MoE, Router
from crucible.model.scoring import Scores, Scoring, score


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V] float32 ([B, 0, V] when the forward scored instead)
    routes: torch.Tensor | None  # [B, T, L_moe, top_k] int64 expert ids, None for dense models
    scores: Scores | None = None  # forward(..., scoring=...)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, *, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = (
            LatentAttention(cfg, layer_id=layer_id)
            if cfg.attention == "mla"
            else Attention(cfg, layer_id=layer_id)
        )
        self.ffn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        if layer_id in cfg.moe_layers:
            self.moe = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: Cache | None,
        replay: torch.Tensor | None,
        valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache)
        if hasattr(self, "moe"):
            y, ids = self.moe(self.ffn_norm(h), replay, valid)
            return h + y, ids
        return h + self.feed_forward(self.ffn_norm(h)), None


class Transformer(nn.Module):
    """Token ids in, fp32 logits (and the expert choices of every MoE layer) out.

    Embeddings, norms, router and attention core run in fp32; linear layers and experts at
    `precision`; the output head in bf16 unless precision is fp32. With `checkpoint_blocks` set, a
    forward under autograd keeps only each block's input and recomputes the block in backward.
    """

    rope_cos: torch.Tensor  # buffers (register_buffer)
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, *, precision: str = "bf16") -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, layer_id=i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size)
        cos, sin = rotary_tables(head_dim=cfg.rope_dim, max_seq_len=cfg.max_seq_len, theta=cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.precision = "fp32"
        self.set_precision(precision)
        self.checkpoint_blocks = False

    def set_precision(self, precision: str) -> None:
        """Choose the matmul precision of every linear layer and expert ("fp32", "bf16", "mxfp8")."""
        self.precision = check_precision(precision)
        for module in self.modules():
            if module is not self and hasattr(module, "precision"):
                cast(Any, module).precision = precision  # nn.Module types attributes as Tensor | Module
        self.head_precision = "fp32" if precision == "fp32" else "bf16"
        if self.output is not None:
            self.output.precision = self.head_precision

    @property
    def moe_layers(self) -> list[MoE]:
        return [moe for block in self.layers if isinstance(moe := getattr(block, "moe", None), MoE)]

    def new_cache(
        self,
        *,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> KVCache:
        if max_len > self.cfg.max_seq_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {self.cfg.max_seq_len}")
        mla = self.cfg.attention == "mla"
        return KVCache.empty(
            n_layers=self.cfg.n_layers,
            batch_size=batch_size,
            n_kv_heads=1 if mla else self.cfg.n_kv_heads,
            max_len=max_len,
            head_dim=self.cfg.kv_lora_rank if mla else self.cfg.head_dim,
            v_dim=self.cfg.qk_rope_head_dim if mla else None,
            dtype=dtype,
            device=device or self.rope_cos.device,
        )

    def forward(
        self,
        tokens_BT: torch.Tensor,
        *,
        routes: torch.Tensor | None = None,
        cache: Cache | None = None,
        valid_BT: torch.Tensor | None = None,
        last_only: bool = False,
        scoring: Scoring | None = None,
    ) -> ModelOutput:
        """Logits for every position (`last_only`: for the last one only, [B, 1, V], all a sampler needs).
        `routes` [B, T, L_moe, k] replays recorded expert choices (rows of -1 are routed afresh); `cache`
        continues positions at cache.length (a `SlotBatch`: each row at its own slot's length) and
        advances it by T. A `RaggedBatch` takes its parts' tokens packed as [1, N] and, with `last_only`,
        gives each row's last logits as [rows, 1, V].

        `valid_BT` [B, T] is 1 at real tokens and 0 at padding: padding is computed like any token (its
        outputs are masked by the caller) but does not count in the routers' training load, which
        `update_router_biases` balances. Without it every position counts.

        With `scoring` the output has no logits: `scores` holds the log-probabilities (and entropies) of
        the tokens it names, computed a chunk of positions at a time (crucible.model.scoring)."""
        self._check_tokens(tokens_BT, cache)
        B, T = tokens_BT.shape
        if routes is not None:
            self._check_routes(routes, B, T)
        if valid_BT is not None and tuple(valid_BT.shape) != (B, T):
            raise ValueError(f"valid_BT must have the tokens' shape {(B, T)}, got {tuple(valid_BT.shape)}")
        if isinstance(cache, SlotBatch | RaggedBatch):
            positions = cache.positions(T)
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        else:
            start = 0 if cache is None else cache.length
            cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        x = self.tok_embeddings(tokens_BT)
        chosen, moe_index = [], 0
        recompute = self.checkpoint_blocks and torch.is_grad_enabled() and cache is None
        for block in self.layers:
            replay = None
            if routes is not None and hasattr(block, "moe"):
                replay = routes[:, :, moe_index]
            if recompute:
                run = _once_counted(cast(TransformerBlock, block))
                x, ids = checkpoint(run, x, cos, sin, replay, valid_BT, use_reentrant=False)
            else:
                x, ids = block(x, cos, sin, cache, replay, valid_BT)
            if ids is not None:
                chosen.append(ids)
                moe_index += 1
        if cache is not None:
            cache.advance(T)
        routes_out = torch.stack(chosen, dim=2) if chosen else None
        if last_only:  # each row's last position (of a ragged batch: each packed row's)
            x = cache.last(x) if isinstance(cache, RaggedBatch) else x[:, -1:]
        h = self.norm(x)
        if scoring is not None:
            if tuple(scoring.where_BT.shape) != (B, T):
                raise ValueError(f"scoring.where_BT must have the tokens' shape {(B, T)}")
            empty = h.new_zeros(B, 0, self.cfg.vocab_size, dtype=torch.float32)
            return ModelOutput(logits=empty, routes=routes_out, scores=score(h, self.head, scoring))
        return ModelOutput(logits=self.head(h).float(), routes=routes_out)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The output head: final (normed) hidden states to logits."""
        if self.output is None:
            return linear(h, self.tok_embeddings.weight, precision=self.head_precision)
        return self.output(h)

    @torch.no_grad()
    def update_router_biases(self, *, rate: float | None = None) -> None:
        """Apply one load-balancing step to every router from the load counted since the last call."""
        for moe in self.moe_layers:
            moe.router.update_bias(rate=self.cfg.bias_update_rate if rate is None else rate)

    def _check_tokens(self, tokens_BT: torch.Tensor, cache: Cache | None) -> None:
        if tokens_BT.dim() != 2 or tokens_BT.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                "tokens must be an int64 [batch, time] tensor, "
                f"got {tokens_BT.dtype} {tuple(tokens_BT.shape)}"
            )
        if tokens_BT.numel() == 0:
            raise ValueError("tokens must not be empty")
        lo, hi = torch.aminmax(tokens_BT)
        if int(lo) < 0 or int(hi) >= self.cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size})")
        B, T = tokens_BT.shape
        if isinstance(cache, RaggedBatch):
            if (B, T) != (1, cache.tokens):
                raise ValueError(f"a ragged batch feeds [1, {cache.tokens}] tokens, got {[B, T]}")
            end = cache.end
        else:
            end = T if cache is None else cache.length + T
            if cache is not None and cache.batch_size != B:
                raise ValueError(f"cache holds {cache.batch_size} sequences, tokens have {B}")
        limit = self.cfg.max_seq_len if cache is None else min(cache.max_len, self.cfg.max_seq_len)
        if end > limit:
            raise ValueError(f"sequence would reach position {end}, past the limit {limit}")

    def _check_routes(self, routes: torch.Tensor, B: int, T: int) -> None:
        expected = (B, T, len(self.moe_layers), self.cfg.top_k)
        if not self.moe_layers:
            raise ValueError("routes given to a model without MoE layers")
        if tuple(routes.shape) != expected or routes.dtype not in (torch.int64, torch.int32, torch.uint8):
            raise ValueError(
                f"routes must be an integer tensor of shape {expected}, "
                f"got {routes.dtype} {tuple(routes.shape)}"
            )
        fresh = routes < 0
        if (fresh.any(-1) != fresh.all(-1)).any():
            raise ValueError("a token's routes in one layer must be all recorded or all -1")
        if (routes >= self.cfg.num_experts).any():
            raise ValueError(f"expert ids must be below num_experts={self.cfg.num_experts}")
        ordered = routes.sort(dim=-1).values
        if ((ordered[..., 1:] == ordered[..., :-1]) & ~fresh[..., 1:]).any():
            raise ValueError("a token cannot be routed to the same expert twice in one layer")


def _once_counted(block: TransformerBlock):
    """The block as a checkpointed function: its routers count their load in the forward, not again when
    backward recomputes it."""
    calls = 0

    def run(x, cos, sin, replay, valid):
        nonlocal calls
        calls += 1
        routers = [block.moe.router] if hasattr(block, "moe") else []
        counting = [r.counting for r in routers]
        for r in routers:
            r.counting = calls == 1
        try:
            return block(x, cos, sin, None, replay, valid)
        finally:
            for r, c in zip(routers, counting, strict=True):
                r.counting = c

    return run


def _init_std(name: str, cfg: ModelConfig) -> float | None:
    """Standard deviation for a parameter (0 for biases), or None for norm weights (ones)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(".bias"):
        return 0.0
    if name.endswith(("wo.weight", "w2.weight", "w2_EDF")):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def build_model(
    cfg: ModelConfig, *, precision: str = "bf16", seed: int = 0, device: torch.device | str = "cpu"
) -> Transformer:
    """A freshly initialised model with fp32 master parameters, identical for identical seeds."""
    check_precision(precision)
    model = Transformer(cfg, precision=precision)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = _init_std(name, cfg)
            if std is None:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
        for module in model.modules():
            if isinstance(module, Router):
                module.expert_bias.zero_()
                module.tokens_per_expert.zero_()
    return model.to(device)
