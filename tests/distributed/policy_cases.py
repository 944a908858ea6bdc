"""Rank functions that drive `PolicyRank`, the step the trainer service takes, on a run config's mesh.

Every case trains the same batch of byte-level trajectories (uneven lengths, so rows end in padding;
router replay with a skewed first layer that never picks expert 3, so with 4-way expert parallelism a
rank's experts get no tokens at all) with the same advantages, cut into one slice per rank as the
trainer's worker group cuts it, and returns what rank 0 sees: each step's metrics, the update the steps
made to every parameter, and the last step's gradients.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from crucible.contracts.messages import Trajectory
from crucible.contracts.packing import pack
from crucible.contracts.runconfig import RunConfig
from crucible.model.spec import PolicySpec
from crucible.parallel import full_grads, full_state_dict
from services.trainer.group import slices
from services.trainer.policy import PolicyRank, Slice

Shape = tuple[int, int, int]  # (dp_replicate, dp_shard, ep)
SHAPES_OF_FOUR: list[Shape] = [(2, 2, 2), (1, 4, 4), (4, 1, 2), (1, 4, 1)]
SHAPES_OF_EIGHT: list[Shape] = [(2, 4, 4), (4, 2, 2), (1, 8, 1)]
ROWS = 8
UNUSED_EXPERT = 3


LORA = {"rank": 4, "alpha": 8}
"""The adapters of the LoRA cases (attention only: every layer of the preset is MoE)."""


def run_config(
    shape: Shape, precision: str = "fp32", micro_batch_tokens: int = 8192, lora: bool = False
) -> RunConfig:
    replicate, shard, ep = shape
    return RunConfig.model_validate({
        "model": {"source": "tiny", "precision": precision, "lora": LORA if lora else None},
        "optim": {"learning_rate": 1e-3, "max_grad_norm": 0.3, "loss": "ppo"},
        "parallel": {"world_size": replicate * shard, "dp_replicate": replicate, "dp_shard": shard, "ep": ep,
                     "micro_batch_tokens": micro_batch_tokens},
    })  # fmt: skip


def batch() -> tuple[list[Trajectory], list[float]]:
    """ROWS trajectories of 24, 21, 18 or 15 tokens: a 4-token prompt, then sampled tokens whose behaviour
    logprobs differ from the policy's (ratios away from 1), and advantages of both signs."""
    g = torch.Generator().manual_seed(0)
    trajectories, advantages = [], []
    for i in range(ROWS):
        n = 24 - 3 * (i % 4)
        first = torch.multinomial(torch.tensor([4.0, 2.0, 1.0, 0.0]).expand(n, -1), 2, generator=g)
        second = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(n)])
        routes = torch.stack([first, second], dim=1)  # [n, layers, top_k]
        trajectories.append(Trajectory(
            run_id="r", trajectory_id=f"t{i}", group_id=f"g{i // 2}", task_id="t", taskset="s",
            tokens=pack("u32", torch.randint(1, 256, (n,), generator=g).tolist()),
            logprobs=pack("f32", [0.0] * 4 + (-5.0 - torch.rand(n - 4, generator=g)).tolist()),
            versions=pack("u32", [0] * n), loss_mask=pack("u8", [0] * 4 + [1] * (n - 4)),
            constraints=pack("u8", [0] * n), routes=pack("u8", routes.flatten().tolist()),
            routes_shape=[n, 2, 2],
        ))  # fmt: skip
        advantages.append((-1.0) ** i * (0.5 + i / ROWS))
    return trajectories, advantages


def fp32_tolerance(config: RunConfig) -> float:
    """What changing the rank layout may change in an fp32 value, relative to its size. The layout
    changes the order of the sums a value passes through: the loss's shares are summed by an all-reduce,
    gradients are reduce-scattered over the ranks instead of accumulated over one batch, and matmul
    kernels may block a reduction differently for fewer rows. Summing D terms in another order moves
    the result by at most about D x u relative to the sum of their magnitudes (u = 2^-24, fp32's unit
    roundoff); D is the longest reduction here: the batch's tokens, the vocabulary or the model width."""
    cfg = PolicySpec.resolve(config).architecture
    tokens = sum(24 - 3 * (i % 4) for i in range(ROWS))
    return max(tokens, cfg.vocab_size, cfg.dim, cfg.ffn_dim, cfg.expert_dim) * 2.0**-24


def policy_rank(
    shape: Shape, precision: str = "fp32", micro_batch_tokens: int = 8192, lora: bool = False
) -> PolicyRank:
    """This rank's PolicyRank on the shape's mesh, as the trainer's worker group builds it."""
    config = run_config(shape, precision, micro_batch_tokens, lora)
    return PolicyRank(config, PolicySpec.resolve(config))


def my_slice(advantages: list[float]) -> Slice:
    """This rank's slice of the batch with `advantages`, cut as the trainer's worker group cuts it."""
    trajectories, _ = batch()
    return slices(trajectories, advantages, world_size=dist.get_world_size())[dist.get_rank()]


def train(
    shape: Shape,
    *,
    precision: str = "fp32",
    steps: int = 2,
    micro_batch_tokens: int = 8192,
    idle: bool = False,
    lora: bool = False,
) -> dict | None:
    """`steps` steps of PolicyRank on this rank's slice; rank 0 returns what it saw (others None).
    `idle`: rows 2 and 3 (a whole rank's slice on four ranks) have advantage 0, so nothing of theirs runs.
    `lora`: the run trains adapters (model.lora) on the frozen model."""
    rank = policy_rank(shape, precision, micro_batch_tokens, lora)
    advantages = batch()[1]
    if idle:
        advantages[2] = advantages[3] = 0.0
    part = my_slice(advantages)
    start = {k: v.clone() for k, v in full_state_dict(rank.model).items()}  # a mesh of one may share storage
    metrics = [rank.train(part) for _ in range(steps)]
    grads = full_grads(rank.model)
    after = full_state_dict(rank.model)
    if dist.get_rank() != 0:
        return None
    return {"metrics": metrics, "update": {n: after[n] - start[n] for n in start}, "grads": grads}


def skipped_step(shape: Shape) -> dict:
    """A step in which one rank's slice alone has a non-finite advantage: every rank skips it, and no
    weight, optimizer state or router bias changes on any rank."""
    rank = policy_rank(shape)
    advantages = batch()[1]
    rank.train(my_slice(advantages))  # an optimizer with state, as mid-run
    before = {k: _local(v).clone() for k, v in rank.model.state_dict().items()}
    steps = [float(s["step"]) for s in rank.optimizer.state.values()]
    poisoned = [*advantages[:-1], math.nan]  # the last trajectory: the last rank's slice
    answer = rank.train(my_slice(poisoned))
    after = rank.model.state_dict()
    return {
        "answer": answer,
        "unchanged": all(torch.equal(_local(before[k]), _local(after[k])) for k in before),
        "optimizer_steps_unchanged": steps == [float(s["step"]) for s in rank.optimizer.state.values()],
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly distributed) tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def reference() -> dict:
    """One rank: the fp32 and MXFP8 steps every layout is compared with."""
    return {
        "fp32": train((1, 1, 1)),
        "mxfp8": train((1, 1, 1), precision="mxfp8", steps=1),
        "idle": train((1, 1, 1), idle=True),
        "lora": train((1, 1, 1), lora=True),
    }


def world_of_four() -> dict:
    """Everything the 4-rank tests check, in one launch: rank 0's steps, every rank's skipped step."""
    return {
        "fp32": [train(shape) for shape in SHAPES_OF_FOUR],
        # micro-batches of 45 tokens: two on rank 0 (rows of 24 and 21), one on rank 1 (18 and 15), which
        # runs a filler to join rank 0's second forward and backward
        "micro": train((2, 2, 2), micro_batch_tokens=45),
        # rank 1's rows have advantage 0: it runs fillers only
        "idle": train((2, 2, 2), micro_batch_tokens=45, idle=True),
        "mxfp8": train((2, 2, 2), precision="mxfp8", steps=1),
        "lora": train((2, 2, 2), lora=True),
        "skipped": skipped_step((2, 2, 2)),
    }


def world_of_eight() -> list[dict | None]:
    return [train(shape) for shape in SHAPES_OF_EIGHT]


def losses(shape: Shape, steps: int) -> list[float]:
    """Every rank's losses over `steps` steps (the same on every rank: the loss is all-reduced)."""
    rank = policy_rank(shape)
    part = my_slice(batch()[1])
    return [float(rank.train(part)["loss"]) for _ in range(steps)]


def everything_on_four() -> dict:
    """One launch of four ranks for the whole module: the trainer's steps here, the layout's gradients
    (parallel_cases) on rank 0."""
    import parallel_cases

    return {"policy": world_of_four(), "layout": parallel_cases.world_of_four()}
