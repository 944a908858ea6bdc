"""MoE throughput against a dense model with the same active parameters, both measured in the same run.

    python benches/bench_moe.py [--preset tiny] [--precision bf16] [--steps 30] [--batch 8] [--seq 128]

Training: both models train on the same random tokens (forward, backward, AdamW step). Decoding: a
16-token prefill then 50 single tokens with the KV cache at batch 1 (the rollout's inner loop). Blocks
of calls alternate between the two models so load on a shared machine hits both alike. Prints
tokens/s of each and the ratio.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import alternate

from crucible.model import PRESETS, ModelConfig, build_model

DECODE_PREFILL, DECODE_TOKENS = 16, 50


def train_step(cfg: ModelConfig, precision: str, tokens: torch.Tensor) -> Callable[[], None]:
    model = build_model(cfg, precision=precision, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.update_router_biases()

    return step


def decode(cfg: ModelConfig, precision: str) -> Callable[[], None]:
    model = build_model(cfg, precision=precision, seed=0).eval()
    prompt, one = torch.ones(1, DECODE_PREFILL, dtype=torch.long), torch.ones(1, 1, dtype=torch.long)

    def run() -> None:
        with torch.inference_mode():
            cache = model.new_cache(batch_size=1, max_len=DECODE_PREFILL + DECODE_TOKENS)
            model(prompt, cache=cache)
            for _ in range(DECODE_TOKENS):
                model(one, cache=cache)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "mxfp8"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    moe_cfg = PRESETS[args.preset]
    if not moe_cfg.num_experts:
        parser.error(f"preset {args.preset} has no experts")
    dense_cfg = moe_cfg.dense_equivalent()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, moe_cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    configs = {"moe": moe_cfg, "dense": dense_cfg}
    train = alternate({k: train_step(c, args.precision, tokens) for k, c in configs.items()}, reps=args.steps)
    dec = alternate({k: decode(c, args.precision) for k, c in configs.items()}, reps=10)

    train_rate = {k: args.batch * args.seq / t for k, t in train.items()}
    decode_rate = {k: (DECODE_PREFILL + DECODE_TOKENS) / t for k, t in dec.items()}
    print(
        f"preset={args.preset} precision={args.precision} batch={args.batch} seq={args.seq} "
        f"threads={args.threads}"
    )
    print(
        f"active params: moe {moe_cfg.param_count(active=True):,} (total {moe_cfg.param_count():,}), "
        f"dense {dense_cfg.param_count():,}"
    )
    for label, rate in (("train", train_rate), ("decode", decode_rate)):
        print(
            f"{label:6s} moe {rate['moe']:9.0f} tokens/s   dense {rate['dense']:9.0f} tokens/s   "
            f"ratio moe/dense {rate['moe'] / rate['dense']:.2f}"
        )


if __name__ == "__main__":
    main()
