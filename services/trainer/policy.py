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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from crucible.agent.grammar import FREE, TOOL_CALL, allowed_table
from crucible.agent.tokenizer import TOOLS
from crucible.agent.toolcalls import ToolCallGrammar
from crucible.contracts.runconfig import RunConfig
from crucible.model import Transformer, lora
from crucible.model.scoring import Scoring, pack_allowed
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
from crucible.rl.losses import BatchTotals, policy_loss
from services.trainer.batch import Batch


@dataclass(frozen=True)
class Slice:
    """One rank's part of a step: its trajectories' batch and the whole batch's counts."""

    batch: Batch
    totals: BatchTotals


def token_logprobs(
    model: Transformer,
    batch: Batch,
    *,
    temperature: float,
    with_entropy: bool = False,
    tool_calls: ToolCallGrammar | None = None,
    tools: Sequence[str] = TOOLS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(token_t | tokens_<t) at the sampled positions under what the sampler allowed there, [B, T]
    with 0 elsewhere, and (if asked) the entropy of each sampled position's distribution. A pretrained
    model's `tool_calls` grammar is replayed over the sampled tokens; without it, the byte-level table
    of the run's `tools` under the recorded constraints. Only the sampled positions reach the output
    head, a chunk at a time (crucible.model.scoring): no [B, T, vocabulary] tensor is made."""
    # The model runs one row per context (batch.to_rows); the values go back to the trajectories' layout.
    tokens = batch.to_rows(batch.tokens_BT)
    routes = None
    if batch.routes_BTLk is not None:
        k = batch.routes_BTLk.shape[-1]
        routes = batch.to_rows(batch.routes_BTLk, fill=torch.arange(k))  # padding: distinct experts
    sampled = batch.to_rows(batch.mask_BT) > 0
    sampled[:, 0] = False  # position 0 has no context to be sampled from
    where = torch.zeros_like(sampled)
    where[:, :-1] = sampled[:, 1:]  # the hidden state before a sampled token predicts it
    allowed = _allowed(batch, sampled, model.cfg.vocab_size, tool_calls, tools)
    if not sampled.any():
        # Nothing sampled (a rank's filler slice): score one token anyway, so that every rank's backward
        # reaches the same weights; its value is masked out below.
        where[0, 0] = True
        allowed = None if allowed is None else allowed.new_full((1, allowed.shape[1]), -1)
    scoring = Scoring(
        where_BT=where,
        targets_N=tokens[:, 1:][where[:, :-1]],
        temperature=temperature,
        allowed_NW=allowed,
        entropy=with_entropy,
    )
    out = model(tokens, routes=routes, valid_BT=batch.to_rows(batch.valid_BT), scoring=scoring)
    assert out.scores is not None
    at = sampled if sampled.any() else torch.roll(where, 1, dims=1)
    zeros = torch.zeros(sampled.shape, dtype=torch.float32, device=sampled.device)
    picked = torch.where(sampled, zeros.masked_scatter(at, out.scores.logprobs_N), zeros)
    entropy = None
    if out.scores.entropy_N is not None:
        entropy = batch.from_rows(torch.where(sampled, zeros.masked_scatter(at, out.scores.entropy_N), zeros))
    return batch.from_rows(picked), entropy


def _allowed(
    batch: Batch,
    sampled_RT: torch.Tensor,
    vocab_size: int,
    tool_calls: ToolCallGrammar | None,
    tools: Sequence[str],
) -> torch.Tensor | None:
    """Packed allowed tokens [N, W] at the sampled positions (row-major over the model's rows), or None
    when every token was allowed at each of them."""
    if tool_calls is None:
        constraints = batch.to_rows(batch.constraints_BT)[sampled_RT]
        if bool((constraints == FREE).all()):
            return None
        return pack_allowed(allowed_table(vocab_size, constraints.device, tools=tools)[constraints])
    # Replay each trajectory's grammar (over the trajectories' layout), then order its masks as the rows.
    words = -(-vocab_size // 32)
    sampled_BT = batch.from_rows(sampled_RT.to(torch.float32)) > 0
    per_trajectory = []
    for tokens, constraints, at in zip(batch.tokens_BT, batch.constraints_BT, sampled_BT, strict=True):
        constrained = constraints == TOOL_CALL
        packed = torch.full((int(at.sum()), words), -1, dtype=torch.int32)
        replayed = tool_calls.replay(tokens.tolist(), constrained.tolist())
        packed[constrained[at]] = replayed[at[constrained]]
        per_trajectory.append(packed)
    # Rows are numbered trajectory by trajectory, context by context: (trajectory, position) order is
    # the rows' row-major order.
    return torch.cat(per_trajectory).to(sampled_RT.device)


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
        # Every rank builds the same plain model (same source and seed, the same fresh adapters if the run
        # has model.lora), then keeps its part of it. With adapters only they train.
        plain = spec.initial_model(seed=config.seed)
        self.cfg = plain.cfg
        self.lora_spec = spec.lora
        self.fresh_adapters: dict[str, torch.Tensor] = {}
        if self.lora_spec is not None:
            lora.freeze_base(plain)
            self.fresh_adapters = {k: v.clone() for k, v in plain.state_dict().items() if lora.is_adapter(k)}
        self.model = parallelize(plain.to(self.device), mesh=mesh)
        self.optimizer = torch.optim.AdamW(self._trained(), lr=config.optim.learning_rate, weight_decay=0.0)
        self.sft_optimizer: torch.optim.Optimizer | None = None
        self.reference: Transformer | None = None  # the KL term's frozen start, whole on every rank
        self.tool_calls = spec.tool_calls  # the rollouts' action grammar, replayed over the sampled tokens

    def train(self, part: Slice) -> dict[str, float | str]:
        """One RL step on this rank's slice: the run's policy loss over its micro-batches, then the shared
        step. A trajectory whose advantage is 0 contributes no gradient unless a KL or entropy term
        reaches it, so then it is not run at all (`rows_skipped`)."""
        optim, batch = self.config.optim, part.batch.to(self.device)
        if optim.kl_coef > 0 and self.reference is None:
            raise ValueError("kl_coef > 0 needs the reference policy (set_reference)")
        every_row = optim.kl_coef > 0 or optim.entropy_coef > 0
        sampled = batch.mask_BT.sum(-1) > 0
        runs = sampled & ((batch.advantages_BT[:, 0] != 0) | every_row)
        ran: dict[str, list[torch.Tensor]] = {}  # policy_loss's inputs, per micro-batch that ran

        def loss_of(piece: Batch) -> torch.Tensor:
            logprobs, entropy = token_logprobs(
                self.model, piece, **self._scoring(), with_entropy=optim.entropy_coef > 0
            )
            ref_logprobs = None
            if self.reference is not None and optim.kl_coef > 0:
                with torch.no_grad():
                    ref_logprobs, _ = token_logprobs(self.reference, piece, **self._scoring())
            inputs = {
                "logprobs_BT": logprobs,
                "behaviour_logprobs_BT": piece.behaviour_logprobs_BT,
                "advantages_BT": piece.advantages_BT,
                "mask_BT": piece.mask_BT,
                "ref_logprobs_BT": ref_logprobs,
                "entropy_BT": entropy,
            }
            given = {k: v for k, v in inputs.items() if v is not None}
            if piece.mask_BT.any():  # not a filler
                for k, v in given.items():
                    ran.setdefault(k, []).append(v.detach())
            return policy_loss(**given, optim=optim, totals=part.totals).loss

        result = self._step(self.optimizer, batch, runs, loss_of, optim.max_grad_norm)
        skipped = {"rows_skipped": float((sampled & ~runs).sum())}
        if not ran:
            return {**result, **skipped, "tokens": 0.0}
        # The step's metrics over every trajectory that ran, from what its micro-batch computed.
        width = max(t.shape[1] for t in ran["mask_BT"])
        whole = {k: torch.cat([F.pad(t, (0, width - t.shape[1])) for t in v]) for k, v in ran.items()}
        metrics = policy_loss(**whole, optim=optim, totals=part.totals).metrics
        return {**result, **skipped, **metrics}

    def sft(self, part: Slice, learning_rate: float) -> dict[str, float | str]:
        """One warm-start step: the negative log-likelihood of the demonstrations' policy tokens (mean per
        token of the whole batch) under the distribution the policy samples from, with its own AdamW."""
        if self.sft_optimizer is None:
            self.sft_optimizer = torch.optim.AdamW(self._trained(), lr=learning_rate, weight_decay=0.0)
        batch = part.batch.to(self.device)

        def loss_of(piece: Batch) -> torch.Tensor:
            logprobs, _ = token_logprobs(self.model, piece, **self._scoring())
            return -(logprobs * piece.mask_BT).sum() / max(part.totals.tokens, 1.0)

        sampled = batch.mask_BT.sum(-1) > 0
        metrics = self._step(self.sft_optimizer, batch, sampled, loss_of, self.config.optim.max_grad_norm)
        return {**metrics, "tokens": float(batch.mask_BT.sum())}

    def _trained(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def end_sft(self) -> None:
        self.sft_optimizer = None

    def _scoring(self) -> dict:
        agent = self.config.agent
        return {"temperature": agent.temperature, "tool_calls": self.tool_calls, "tools": agent.tools}

    def _step(
        self,
        optimizer: torch.optim.Optimizer,
        batch: Batch,
        runs: torch.Tensor,
        loss_of: Callable[[Batch], torch.Tensor],
        max_grad_norm: float,
    ) -> dict[str, float | str]:
        """Forward and backward each micro-batch of the trajectories that `runs` [B] marks (each one's share
        of the step's loss from `loss_of`), then clip, step, and update the router biases from the whole
        batch's load; skipped on every rank, with nothing changed, when the loss or the gradients are not
        finite on any.

        Every rank runs as many micro-batches as the rank with the most (a forward and backward are
        collectives under HSDP and EP), a rank with fewer running fillers that count nowhere."""
        parallel = self.config.parallel
        rows = runs.nonzero().flatten().tolist()
        pieces = batch.select(rows).split(parallel.micro_batch_tokens) if rows else []
        count = torch.tensor([len(pieces)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if not count.item():
            return {"loss": 0.0, "grad_norm": 0.0}  # nothing to learn from on any rank: no step
        self.model.train()
        self.model.checkpoint_blocks = parallel.activation_checkpointing
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for i in range(int(count.item())):
            piece = pieces[i] if i < len(pieces) else batch.filler()
            share = loss_of(piece)
            (share * dist.get_world_size()).backward()
            total += share.detach().float()
        finite = torch.tensor([1.0 if bool(torch.isfinite(total)) else 0.0], device=self.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            optimizer.zero_grad(set_to_none=True)
            self.model.update_router_biases(rate=0.0)  # forget the load this forward counted
            return {"skipped": "loss"}
        grad_norm = clip_grad_norm_(self.model, max_norm=max_grad_norm)
        if not math.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            self.model.update_router_biases(rate=0.0)
            return {"skipped": "gradients"}
        optimizer.step()
        if self.model.moe_layers:
            all_reduce_router_loads(self.model)
        self.model.update_router_biases(rate=0.0 if self.lora_spec else None)  # adapters: the base is frozen
        loss = total.reshape(1).clone()
        dist.all_reduce(loss)
        return {"loss": float(loss), "grad_norm": grad_norm}

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The whole policy's state dict (the plain model's keys) on rank 0, None elsewhere; every rank
        must call it (it gathers)."""
        state = full_state_dict(self.model)
        return {k: v.cpu() for k, v in state.items()} if dist.get_rank() == 0 else None

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load a whole state dict; plain weights into a model with adapters keep the fresh adapters."""
        if self.lora_spec is not None and not any(lora.is_adapter(k) for k in state):
            state = {**state, **self.fresh_adapters}
        load_full_state_dict(self.model, state)

    def set_reference(self, state: dict[str, torch.Tensor]) -> None:
        """The KL term's frozen policy: `state` with any adapters merged into a plain model."""
        reference = Transformer(self.cfg, precision=self.config.model.precision)
        reference.load_state_dict(lora.merge(state, self.cfg), strict=True)
        self.reference = reference.requires_grad_(False).eval().to(self.device)

    def save(self, directory: str) -> None:
        save_sharded(self.model, self.optimizer, directory)

    def load(self, directory: str) -> None:
        load_sharded(self.model, self.optimizer, directory)
