"""One optimizer step of the clipped policy-gradient loss on a batch of graded groups."""

from __future__ import annotations

import torch

from crucible.agent.grammar import constrained_logprobs
from crucible.model import Transformer
from crucible.rl.losses import clipped_policy_loss
from services.trainer.batch import Batch


def token_logprobs(model: Transformer, batch: Batch, *, temperature: float) -> torch.Tensor:
    """log pi(token_t | tokens_<t) under the constraint recorded at t; [B, T] with position 0 = 0."""
    out = model(batch.tokens_BT, routes=batch.routes_BTLk)
    logp_BTV = constrained_logprobs(out.logits[:, :-1], batch.constraints_BT[:, 1:], temperature=temperature)
    picked = logp_BTV.gather(-1, batch.tokens_BT[:, 1:, None]).squeeze(-1)
    # Tokens the policy did not sample may be outside their constraint (-inf); they are masked anyway.
    picked = torch.where(batch.mask_BT[:, 1:] > 0, picked, torch.zeros_like(picked))
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def train_step(
    *,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    clip_eps: float,
    temperature: float,
    max_grad_norm: float = 1.0,
) -> dict[str, float]:
    model.train()
    optimizer.zero_grad(set_to_none=True)
    logprobs = token_logprobs(model, batch, temperature=temperature)
    stats = clipped_policy_loss(
        logprobs=logprobs.flatten(),
        behaviour_logprobs=batch.behaviour_logprobs_BT.flatten(),
        advantages=batch.advantages_BT.flatten(),
        mask=batch.mask_BT.flatten(),
        clip_eps=clip_eps,
    )
    stats.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    model.update_router_biases()  # loss-free load balancing, from the load this step routed
    return {
        "loss": float(stats.loss.detach()),
        "grad_norm": float(grad_norm),
        "clip_fraction": stats.clip_fraction,
        "ratio_mean": stats.ratio_mean,
        "ratio_max": stats.ratio_max,
        "approx_kl": stats.approx_kl,
        "tokens": float(stats.tokens),
    }
