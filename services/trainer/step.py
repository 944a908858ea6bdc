"""One optimizer step: of the run's policy loss (crucible.rl.losses) on a batch of graded groups, or of
the warm start's negative log-likelihood on demonstrations; both through the same logprobs."""

from __future__ import annotations

import torch

from crucible.agent.grammar import TOOL_CALL, constrained_logprobs, masked_logprobs
from crucible.agent.toolcalls import ToolCallGrammar
from crucible.contracts.runconfig import OptimSection
from crucible.model import Transformer
from crucible.rl.losses import entropy_from_logprobs, policy_loss
from services.trainer.batch import Batch


def _shift(picked_BT1: torch.Tensor) -> torch.Tensor:
    """Values for positions 1..T-1 put back at their token's position; position 0 (never sampled) = 0."""
    return torch.cat([torch.zeros_like(picked_BT1[:, :1]), picked_BT1], dim=1)


def replayed_masks(batch: Batch, tool_calls: ToolCallGrammar) -> torch.Tensor:
    """Bool [B, T, V]: what a pretrained model's sampler allowed for each token, its grammar replayed over
    the sampled tokens (once per step: the policy and the reference share it)."""
    masks = torch.stack([
        tool_calls.replay_masks(tokens.tolist(), (constraints == TOOL_CALL).tolist())
        for tokens, constraints in zip(batch.tokens_BT, batch.constraints_BT)
    ])  # fmt: skip
    return masks


def token_logprobs(
    model: Transformer,
    batch: Batch,
    *,
    temperature: float,
    with_entropy: bool = False,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(token_t | tokens_<t) under what the sampler allowed at t, [B, T] with position 0 = 0, and
    (if asked) the entropy of each position's constrained distribution. `allowed` [B, T, V] are a
    pretrained model's replayed grammar masks (`replayed_masks`); without them, the byte-level table
    under the recorded constraints."""
    # The model runs one row per context (batch.to_rows); the values go back to the trajectories' layout.
    tokens = batch.to_rows(batch.tokens_BT)
    routes = None
    if batch.routes_BTLk is not None:
        k = batch.routes_BTLk.shape[-1]
        routes = batch.to_rows(batch.routes_BTLk, fill=torch.arange(k))  # padding: distinct experts
    out = model(tokens, routes=routes, valid_BT=batch.to_rows(batch.valid_BT))
    if allowed is None:
        constraints = batch.to_rows(batch.constraints_BT)
        logp_BTV = constrained_logprobs(out.logits[:, :-1], constraints[:, 1:], temperature=temperature)
    else:
        allowed = batch.to_rows(allowed, fill=True)[:, 1:]
        logp_BTV = masked_logprobs(out.logits[:, :-1], allowed, temperature=temperature)
    picked = logp_BTV.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    # Tokens the policy did not sample may be outside their constraint (-inf); they are masked anyway.
    sampled = batch.to_rows(batch.mask_BT)[:, 1:] > 0
    picked = torch.where(sampled, picked, torch.zeros_like(picked))
    entropy = None
    if with_entropy:
        entropy = batch.from_rows(_shift(torch.where(sampled, entropy_from_logprobs(logp_BTV), torch.zeros_like(picked))))
    return batch.from_rows(_shift(picked)), entropy


def train_step(
    *,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    optim: OptimSection,
    temperature: float,
    reference: Transformer | None = None,
    tool_calls: ToolCallGrammar | None = None,
) -> dict[str, float]:
    """Forward, the run's loss, backward, clip, step, then the router bias update; returns the metrics.
    `reference` is the frozen starting policy, needed when optim.kl_coef > 0; `tool_calls` the grammar of
    a pretrained model's actions."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    allowed = None if tool_calls is None else replayed_masks(batch, tool_calls)
    logprobs, entropy = token_logprobs(
        model, batch, temperature=temperature, with_entropy=optim.entropy_coef > 0, allowed=allowed
    )
    ref_logprobs = None
    if optim.kl_coef > 0:
        if reference is None:
            raise ValueError("kl_coef > 0 needs the reference policy")
        with torch.no_grad():
            ref_logprobs, _ = token_logprobs(reference, batch, temperature=temperature, allowed=allowed)
    stats = policy_loss(
        logprobs_BT=logprobs,
        behaviour_logprobs_BT=batch.behaviour_logprobs_BT,
        advantages_BT=batch.advantages_BT,
        mask_BT=batch.mask_BT,
        optim=optim,
        ref_logprobs_BT=ref_logprobs,
        entropy_BT=entropy,
    )
    return {**_apply(model, optimizer, stats.loss, optim.max_grad_norm), **stats.metrics}


def sft_step(
    *,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    temperature: float,
    max_grad_norm: float,
    tool_calls: ToolCallGrammar | None = None,
) -> dict[str, float]:
    """Negative log-likelihood of the demonstrations' policy tokens (mean per token) under the
    distribution the policy samples from: the same temperature and constraints as `token_logprobs`."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    allowed = None if tool_calls is None else replayed_masks(batch, tool_calls)
    logprobs, _ = token_logprobs(model, batch, temperature=temperature, allowed=allowed)
    tokens = batch.mask_BT.sum()
    loss = -(logprobs * batch.mask_BT).sum() / tokens.clamp(min=1)
    return {**_apply(model, optimizer, loss, max_grad_norm), "tokens": float(tokens)}


class NonFiniteStep(ArithmeticError):
    """The step's loss or gradients are not finite: nothing was applied (weights, optimizer state and
    router biases are as before the step). `reason` names what was not finite."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"non-finite {reason}: the step was not applied")
        self.reason = reason


def _apply(model: Transformer, optimizer: torch.optim.Optimizer, loss: torch.Tensor, max_grad_norm: float) -> dict[str, float]:
    """Backward, clip, step, then the router bias update (loss-free load balancing, from this step's load).
    A non-finite loss or gradient raises NonFiniteStep before anything changes."""
    if not torch.isfinite(loss.detach()):
        model.update_router_biases(rate=0.0)  # forget the load this forward counted
        raise NonFiniteStep("loss")
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        model.update_router_biases(rate=0.0)
        raise NonFiniteStep("gradients")
    optimizer.step()
    model.update_router_biases()
    return {"loss": float(loss.detach()), "grad_norm": float(grad_norm)}
