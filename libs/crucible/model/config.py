"""Model configuration and named presets, from a CPU test size to real sizes."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

VOCAB_SIZE = 320  # 256 byte tokens + 64 special tokens, the same in every preset
PRECISIONS = ("fp32", "bf16", "mxfp8")
QK_NORMS = ("none", "head", "full")
ATTENTIONS = ("gqa", "mla")
ROUTER_SCORINGS = ("sigmoid", "softmax")


@dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters (crucible.model.lora): `rank`, `alpha` (the update is scaled by alpha / rank) and
    the projections they target, by Hugging Face name."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a decoder-only MoE transformer.

    Layers before `first_moe_layer` use a dense SwiGLU feed-forward of width `ffn_dim`; the rest use
    `num_experts` routed experts of width `expert_dim` (top `top_k` per token) plus, when
    `shared_expert_dim` > 0, one always-on shared expert. `num_experts == 0` gives a dense model.

    The families of pretrained checkpoints are members of this one shape (crucible.model.hf): Llama-style
    dense models (`qkv_bias` for Qwen2, `tie_embeddings`), Qwen3 (`qk_norm="head"`: RMSNorm of each
    head's queries and keys; `head_size` independent of dim / n_heads), OLMoE (`qk_norm="full"`: over the
    whole projection), softmax-scored top-k routers (`router_scoring="softmax"`, with `norm_topk_prob`
    renormalising the chosen weights) for Qwen3-MoE, Mixtral and OLMoE, and DeepSeek-V3: multi-head
    latent attention (`attention="mla"`, queries and keys/values through low-rank latents, rotary
    positions on `qk_rope_head_dim` features only), the sigmoid router with its selection bias (the one
    Crucible's presets use) limited to `topk_group` of `n_group` expert groups, shared experts and
    dense first layers.
    """

    vocab_size: int = VOCAB_SIZE
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    max_seq_len: int = 4096
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    ffn_dim: int = 128
    num_experts: int = 4
    top_k: int = 2
    expert_dim: int = 64
    shared_expert_dim: int = 0
    first_moe_layer: int = 0
    route_scale: float = 1.0
    bias_update_rate: float = 1e-3
    tie_embeddings: bool = False
    init_std: float = 0.02
    head_size: int = 0
    """Width of one attention head; 0: dim // n_heads."""
    qkv_bias: bool = False
    qk_norm: str = "none"
    router_scoring: str = "sigmoid"
    norm_topk_prob: bool = True
    family: str = ""
    """The Hugging Face model_type the weights came from ("" for Crucible's own presets)."""
    attention: str = "gqa"
    q_lora_rank: int = 0
    """MLA: rank of the query latent (0: queries projected directly)."""
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    """MLA: the rotary features come in interleaved pairs (DeepSeek's layout)."""
    n_group: int = 1
    topk_group: int = 1
    """Experts are chosen only within the `topk_group` best of `n_group` equal groups (DeepSeek-V3)."""

    def __post_init__(self) -> None:
        problems = []
        if not self.head_size and self.dim % self.n_heads:
            problems.append(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.n_heads > 0 and self.head_dim % 2:
            problems.append("head_dim must be even for rotary embeddings")
        if self.qk_norm not in QK_NORMS:
            problems.append(f"qk_norm {self.qk_norm!r} is not one of {QK_NORMS}")
        if self.attention not in ATTENTIONS:
            problems.append(f"attention {self.attention!r} is not one of {ATTENTIONS}")
        if (
            self.attention == "mla"
            and min(self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) <= 0
        ):
            problems.append("mla needs positive kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim")
        if self.attention == "mla" and self.qk_rope_head_dim % 2:
            problems.append("qk_rope_head_dim must be even for rotary embeddings")
        if self.num_experts and (self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group):
            problems.append(
                f"num_experts {self.num_experts} in n_group {self.n_group} groups, "
                f"topk_group {self.topk_group}"
            )
        if self.router_scoring not in ROUTER_SCORINGS:
            problems.append(f"router_scoring {self.router_scoring!r} is not one of {ROUTER_SCORINGS}")
        if self.num_experts < 0 or self.num_experts > 255:
            problems.append("num_experts must be in [0, 255] (routes travel as u8, 255 = not recorded)")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            problems.append(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if not 0 <= self.first_moe_layer <= self.n_layers:
            problems.append(f"first_moe_layer {self.first_moe_layer} outside [0, n_layers]")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """Features per head that the rotary embedding turns."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers with routed experts."""
        if self.num_experts == 0:
            return ()
        return tuple(range(self.first_moe_layer, self.n_layers))

    def param_count(self, *, active: bool = False) -> int:
        """Parameters of the model; with `active`, only those one token uses (top_k of the experts)."""
        d, hd = self.dim, self.head_dim
        qkv = (self.n_heads + 2 * self.n_kv_heads) * hd
        norms = {"none": 0, "head": 2 * hd, "full": (self.n_heads + self.n_kv_heads) * hd}[self.qk_norm]
        attention = d * qkv + self.n_heads * hd * d + 2 * d + (qkv if self.qkv_bias else 0) + norms
        if self.attention == "mla":
            H, qk = self.n_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            ql, kvl = self.q_lora_rank, self.kv_lora_rank
            q = d * ql + ql + ql * H * qk if ql else d * H * qk
            kv = d * (kvl + self.qk_rope_head_dim) + kvl + kvl * H * (self.qk_nope_head_dim + self.v_head_dim)
            attention = q + kv + H * self.v_head_dim * d + 2 * d
        dense_ffn = 3 * d * self.ffn_dim
        experts = (self.top_k if active else self.num_experts) * 3 * d * self.expert_dim
        moe_ffn = experts + 3 * d * self.shared_expert_dim + self.num_experts * d
        n_moe = len(self.moe_layers)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        layers = self.n_layers * attention + (self.n_layers - n_moe) * dense_ffn + n_moe * moe_ffn
        return self.vocab_size * d + layers + d + head

    def dense_equivalent(self) -> ModelConfig:
        """A dense model with the same active parameters per token (FFN width top_k * expert_dim + shared)."""
        if not self.num_experts:
            return self
        width = self.top_k * self.expert_dim + self.shared_expert_dim
        return dataclasses.replace(self, num_experts=0, ffn_dim=width, shared_expert_dim=0)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        fields = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(fields) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        return cls(**fields)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "tiny-dense": ModelConfig(num_experts=0, ffn_dim=128),
    "small": ModelConfig(
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=2,
        ffn_dim=1536,
        num_experts=16,
        top_k=2,
        expert_dim=384,
        shared_expert_dim=384,
        first_moe_layer=1,
        max_seq_len=8192,
    ),
    "1b-a200m": ModelConfig(
        dim=1024,
        n_layers=16,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=4096,
        num_experts=64,
        top_k=6,
        expert_dim=512,
        shared_expert_dim=1024,
        first_moe_layer=1,
        max_seq_len=32768,
        rope_theta=500_000.0,
    ),
    "16b-a3b": ModelConfig(
        dim=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=10944,
        num_experts=64,
        top_k=6,
        expert_dim=1408,
        shared_expert_dim=2816,
        first_moe_layer=1,
        max_seq_len=32768,
        rope_theta=500_000.0,
    ),
    "30b-a3b": ModelConfig(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=6144,
        num_experts=128,
        top_k=8,
        expert_dim=768,
        first_moe_layer=0,
        max_seq_len=32768,
        rope_theta=1_000_000.0,
    ),
}
