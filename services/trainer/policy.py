"""What each rank of a run's worker group holds and does: its shard of the policy (expert-parallel and
HSDP-sharded on the run's mesh, a mesh of one rank for world size 1), its optimizer, the RL and warm-start
losses on its slice of a step's batch, and its part of saving, loading and publishing the weights.

A rank's loss is its slice's share of the whole batch's loss (`BatchTotals`): the shares sum to the loss
one process computes on the whole batch, and since HSDP averages gradients over the W ranks, each rank
backpropagates W x its share. A step whose loss or gradients are not finite on any rank is skipped on
every rank (they agree with an all-reduce before anything changes): nothing is applied and the rank
returns `{"skipped": reason}`, so an expected outcome never breaks the group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from crucible.agent.grammar import TOOL_CALL, constrained_logprobs, masked_logprobs
from crucible.agent.toolcalls import ToolCallGrammar
from crucible.contracts.runconfig import RunConfig
from crucible.model import Transformer
from crucible.model.spec import PolicySpec
from crucible.parallel import (
    ParallelConfig,
    all_reduce_router_loads,
    build_mesh,
    clip_grad_norm_,
    full_state_dict,
    load_full_state_dict,
    load_sharded,
    parallelize,
    save_sharded,
)
from crucible.rl.losses import BatchTotals, entropy_from_logprobs, policy_loss
from services.trainer.batch import Batch


@dataclass(frozen=True)
class Slice:
    """One rank's part of a step: its trajectories' batch and the whole batch's counts."""

    batch: Batch
    totals: BatchTotals


def _shift(picked_BT1: torch.Tensor) -> torch.Tensor:
    """Values for positions 1..T-1 put back at their token's position; position 0 (never sampled) = 0."""
    return torch.cat([torch.zeros_like(picked_BT1[:, :1]), picked_BT1], dim=1)


def replayed_masks(batch: Batch, tool_calls: ToolCallGrammar) -> torch.Tensor:
    """Bool [B, T, V]: what a pretrained model's sampler allowed for each token, its grammar replayed over
    the sampled tokens (once per step: the policy and the reference share it)."""
    masks = torch.stack([
        tool_calls.replay_masks(tokens.tolist(), (constraints == TOOL_CALL).tolist())
        for tokens, constraints in zip(batch.tokens_BT, batch.constraints_BT, strict=True)
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
        entropy = batch.from_rows(
            _shift(torch.where(sampled, entropy_from_logprobs(logp_BTV), torch.zeros_like(picked)))
        )
    return batch.from_rows(_shift(picked)), entropy


class PolicyRank:
    """One rank of a run's worker group (built by `crucible.parallel.start_workers` on every rank)."""

    def __init__(self, config: RunConfig, spec: PolicySpec) -> None:
        self.config = config
        parallel = config.parallel
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        mesh = build_mesh(
            ParallelConfig(replicate=parallel.replicate, shard=parallel.shard, expert=parallel.ep),
            device_type=self.device.type,
        )
        # Every rank builds the same plain model (same source and seed), then keeps its part of it.
        plain = spec.initial_model(seed=config.seed)
        self.cfg = plain.cfg
        self.model = parallelize(plain.to(self.device), mesh=mesh)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.optim.learning_rate, weight_decay=0.0
        )
        self.sft_optimizer: torch.optim.Optimizer | None = None
        self.reference: Transformer | None = None  # the KL term's frozen start, whole on every rank
        self.tool_calls = spec.tool_calls  # the rollouts' action grammar, replayed over the sampled tokens

    def train(self, part: Slice) -> dict[str, float | str]:
        """One RL step on this rank's slice: the run's policy loss, then the shared step."""
        optim, batch = self.config.optim, part.batch.to(self.device)
        temperature = self.config.agent.temperature
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        allowed = None if self.tool_calls is None else replayed_masks(batch, self.tool_calls).to(self.device)
        logprobs, entropy = token_logprobs(
            self.model, batch, temperature=temperature, with_entropy=optim.entropy_coef > 0, allowed=allowed
        )
        ref_logprobs = None
        if optim.kl_coef > 0:
            if self.reference is None:
                raise ValueError("kl_coef > 0 needs the reference policy (set_reference)")
            with torch.no_grad():
                ref_logprobs, _ = token_logprobs(
                    self.reference, batch, temperature=temperature, allowed=allowed
                )
        stats = policy_loss(
            logprobs_BT=logprobs,
            behaviour_logprobs_BT=batch.behaviour_logprobs_BT,
            advantages_BT=batch.advantages_BT,
            mask_BT=batch.mask_BT,
            optim=optim,
            ref_logprobs_BT=ref_logprobs,
            entropy_BT=entropy,
            totals=part.totals,
        )
        return {**self._apply(self.optimizer, stats.loss, optim.max_grad_norm), **stats.metrics}

    def sft(self, part: Slice, learning_rate: float) -> dict[str, float | str]:
        """One warm-start step: the negative log-likelihood of the demonstrations' policy tokens (mean per
        token of the whole batch) under the distribution the policy samples from, with its own AdamW."""
        if self.sft_optimizer is None:
            self.sft_optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=learning_rate, weight_decay=0.0
            )
        batch = part.batch.to(self.device)
        self.model.train()
        self.sft_optimizer.zero_grad(set_to_none=True)
        allowed = None if self.tool_calls is None else replayed_masks(batch, self.tool_calls).to(self.device)
        logprobs, _ = token_logprobs(
            self.model, batch, temperature=self.config.agent.temperature, allowed=allowed
        )
        share = -(logprobs * batch.mask_BT).sum() / max(part.totals.tokens, 1.0)
        metrics = self._apply(self.sft_optimizer, share, self.config.optim.max_grad_norm)
        return {**metrics, "tokens": float(batch.mask_BT.sum())}

    def end_sft(self) -> None:
        self.sft_optimizer = None

    def _apply(
        self, optimizer: torch.optim.Optimizer, share: torch.Tensor, max_grad_norm: float
    ) -> dict[str, float | str]:
        """Backward, clip, step, then the router bias update from the whole batch's load; skipped on every
        rank, with nothing changed, when the loss or the gradients are not finite on any."""
        finite = torch.tensor([1.0 if bool(torch.isfinite(share.detach())) else 0.0], device=self.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            self.model.update_router_biases(rate=0.0)  # forget the load this forward counted
            return {"skipped": "loss"}
        (share * dist.get_world_size()).backward()
        grad_norm = clip_grad_norm_(self.model, max_norm=max_grad_norm)
        if not math.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            self.model.update_router_biases(rate=0.0)
            return {"skipped": "gradients"}
        optimizer.step()
        if self.model.moe_layers:
            all_reduce_router_loads(self.model)
        self.model.update_router_biases()
        loss = share.detach().float().reshape(1).clone()
        dist.all_reduce(loss)
        return {"loss": float(loss), "grad_norm": grad_norm}

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The whole policy's state dict (the plain model's keys) on rank 0, None elsewhere; every rank
        must call it (it gathers)."""
        state = full_state_dict(self.model)
        return {k: v.cpu() for k, v in state.items()} if dist.get_rank() == 0 else None

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        load_full_state_dict(self.model, state)

    def set_reference(self, state: dict[str, torch.Tensor]) -> None:
        reference = Transformer(self.cfg, precision=self.config.model.precision)
        reference.load_state_dict(state, strict=True)
        self.reference = reference.requires_grad_(False).eval().to(self.device)

    def save(self, directory: str) -> None:
        save_sharded(self.model, self.optimizer, directory)

    def load(self, directory: str) -> None:
        load_sharded(self.model, self.optimizer, directory)
