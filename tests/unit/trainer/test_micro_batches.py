"""A rank's step in micro-batches, with its blocks recomputed in backward and only the sampled positions
reaching the output head, is the step computed the plain way: one forward over the whole batch, full
[B, T, V] logits, the byte-level constraint table, one backward. Trajectories whose advantage is 0 (and
that no KL or entropy term reaches) are not run, and the step is the same as with them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from crucible.agent.grammar import constrained_logprobs
from crucible.contracts.messages import Trajectory
from crucible.contracts.packing import pack
from crucible.contracts.runconfig import RunConfig
from crucible.model.spec import PolicySpec
from crucible.parallel import full_grads
from crucible.rl.losses import BatchTotals, policy_loss
from services.trainer.batch import collate
from services.trainer.group import slices
from services.trainer.policy import PolicyRank

LENGTHS = (30, 17, 24, 9, 21, 12)
PROMPT = 5


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def trajectories() -> list[Trajectory]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate(LENGTHS):
        sampled = n - PROMPT
        out.append(Trajectory(
            run_id="r", trajectory_id=f"t{i}", group_id="g", task_id="t", taskset="s",
            tokens=pack("u32", torch.randint(1, 256, (n,), generator=g).tolist()),
            logprobs=pack("f32", [0.0] * PROMPT + (-5.0 - torch.rand(sampled, generator=g)).tolist()),
            versions=pack("u32", [0] * n), loss_mask=pack("u8", [0] * PROMPT + [1] * sampled),
            # free, then tool-name, then argument constraints: the table's rows all appear
            constraints=pack("u8", [0] * PROMPT + [1] + [2] * (sampled - 1)),
        ))  # fmt: skip
    return out


def config(**parallel) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"source": "tiny", "precision": "fp32"},
        "optim": {"learning_rate": 1e-3, "max_grad_norm": 1e9, "loss": "ppo"},
        "parallel": parallel,
    })  # fmt: skip


def plain_step(cfg: RunConfig, advantages: list[float]) -> tuple[float, dict[str, torch.Tensor]]:
    """The step the old way: whole batch, full logits, one backward; its loss and gradients."""
    model = PolicySpec.resolve(cfg).initial_model(seed=cfg.seed).train()
    batch = collate(trajectories(), advantages)
    logits = model(batch.tokens_BT, valid_BT=batch.valid_BT).logits[:, :-1]
    logp = constrained_logprobs(logits, batch.constraints_BT[:, 1:], temperature=cfg.agent.temperature)
    picked = logp.gather(-1, batch.tokens_BT[:, 1:, None]).squeeze(-1)
    picked = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1) * (batch.mask_BT > 0)
    loss = policy_loss(
        logprobs_BT=picked, behaviour_logprobs_BT=batch.behaviour_logprobs_BT,
        advantages_BT=batch.advantages_BT, mask_BT=batch.mask_BT, optim=cfg.optim,
        totals=BatchTotals.of(batch.mask_BT),
    ).loss  # fmt: skip
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def rank_step(cfg: RunConfig, advantages: list[float]) -> tuple[dict, dict[str, torch.Tensor]]:
    rank = PolicyRank(cfg, PolicySpec.resolve(cfg))
    (part,) = slices(trajectories(), advantages, world_size=1)
    metrics = rank.train(part)
    return metrics, full_grads(rank.model)


def tolerance(cfg: RunConfig) -> float:
    """fp32 sums of up to D terms in another order (micro-batches, chunks, recomputed blocks): D x 2^-24
    relative to the values' magnitude, D the longest reduction (the batch's tokens or the vocabulary)."""
    arch = PolicySpec.resolve(cfg).architecture
    return max(sum(LENGTHS), arch.vocab_size, arch.dim, arch.ffn_dim) * 2.0**-24


def assert_same(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float) -> None:
    assert grads.keys() == expected.keys()
    for name, g in expected.items():
        scale = float(g.abs().max()) or 1.0
        torch.testing.assert_close(grads[name], g, rtol=0, atol=tol * scale * 4, msg=name)


@pytest.mark.parametrize("tokens", [8192, 40, 1])
def test_micro_batches_and_recomputed_blocks_give_the_plain_step(tokens: int) -> None:
    cfg = config(micro_batch_tokens=tokens, activation_checkpointing=True)
    advantages = [1.0, -0.5, 0.25, -1.0, 0.75, -0.25]
    loss, expected = plain_step(cfg, advantages)
    metrics, grads = rank_step(cfg, advantages)
    assert metrics["loss"] == pytest.approx(loss, rel=tolerance(cfg) * 4)
    assert metrics["rows_skipped"] == 0 and metrics["tokens"] == sum(n - PROMPT for n in LENGTHS)
    assert_same(grads, expected, tolerance(cfg))


def test_trajectories_with_no_advantage_are_not_run_and_the_step_is_the_same() -> None:
    cfg = config(micro_batch_tokens=40)
    advantages = [1.0, 0.0, -1.0, 0.0, 0.0, 0.5]
    loss, expected = plain_step(cfg, advantages)
    metrics, grads = rank_step(cfg, advantages)
    assert metrics["rows_skipped"] == 3
    assert metrics["tokens"] == sum(n - PROMPT for n, a in zip(LENGTHS, advantages, strict=True) if a)
    assert metrics["loss"] == pytest.approx(loss, rel=tolerance(cfg) * 4)
    assert_same(grads, expected, tolerance(cfg))


def test_an_entropy_term_runs_every_trajectory() -> None:
    cfg = config(micro_batch_tokens=40)
    cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"entropy_coef": 0.01})})
    metrics, _ = rank_step(cfg, [1.0, 0.0, -1.0, 0.0, 0.0, 0.5])
    assert metrics["rows_skipped"] == 0 and metrics["entropy"] > 0


def test_a_step_with_nothing_to_learn_changes_nothing() -> None:
    cfg = config()
    rank = PolicyRank(cfg, PolicySpec.resolve(cfg))
    before = {k: v.clone() for k, v in rank.model.state_dict().items()}
    (part,) = slices(trajectories(), [0.0] * len(LENGTHS), world_size=1)
    metrics = rank.train(part)
    assert metrics["rows_skipped"] == len(LENGTHS) and metrics["tokens"] == 0
    assert all(torch.equal(before[k], v) for k, v in rank.model.state_dict().items())
    assert not rank.optimizer.state  # no optimizer step was taken
