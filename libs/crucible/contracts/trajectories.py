"""What makes a graded trajectory usable, checked by every consumer that reads its arrays (the trainer
before it trains, the api before it stores): one home, so a forged or corrupt message is dead-lettered
with the same reason wherever it arrives instead of failing a training step or a detail page later.
A non-finite reward is refused by the api (`check_graded`: it cannot be served as JSON); the trainer
takes it and skips the step with the reason (see services.trainer.job)."""

from __future__ import annotations

import math

from crucible.contracts import ContractError
from crucible.contracts.messages import GradedTrajectory, Trajectory
from crucible.contracts.packing import unpack


def check_trajectory(trajectory: Trajectory) -> None:
    """Raise ContractError unless the per-token arrays agree in length and every index into them fits."""
    t = trajectory
    sizes = {
        "tokens": len(t.tokens) // 4, "logprobs": len(t.logprobs) // 4, "versions": len(t.versions) // 4,
        "loss_mask": len(t.loss_mask), "constraints": len(t.constraints),
    }  # fmt: skip
    if len(set(sizes.values())) != 1 or len(t.tokens) % 4 or len(t.logprobs) % 4 or len(t.versions) % 4:
        raise ContractError(f"trajectory {t.trajectory_id}: per-token arrays differ in length: {sizes}")
    n = sizes["tokens"]
    if n < 2:
        raise ContractError(f"trajectory {t.trajectory_id}: fewer than two tokens")
    if t.token_text and len(t.token_text) != n:
        raise ContractError(f"trajectory {t.trajectory_id}: {len(t.token_text)} token texts for {n} tokens")
    if not all(map(math.isfinite, unpack("f32", t.logprobs))):
        raise ContractError(f"trajectory {t.trajectory_id}: behaviour logprobs that are not finite")
    starts = t.context_starts
    if starts and (starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= n):
        raise ContractError(
            f"trajectory {t.trajectory_id}: context starts {starts[:8]} are not increasing from 0 within {n} tokens"
        )
    for call in t.tool_calls:
        if not 0 <= call.token_start <= call.token_end <= n:
            raise ContractError(
                f"trajectory {t.trajectory_id}: tool call {call.index} spans tokens"
                f" [{call.token_start}, {call.token_end}) outside {n}"
            )
    if t.routes_shape:
        T, L, k = (t.routes_shape + [0, 0, 0])[:3]
        if len(t.routes_shape) != 3 or T != n or len(t.routes) != T * L * k:
            raise ContractError(
                f"trajectory {t.trajectory_id}: routes of shape {t.routes_shape} ({len(t.routes)} bytes)"
                f" do not fit {n} tokens"
            )


def check_graded(graded: GradedTrajectory) -> None:
    """check_trajectory, and finite numbers in the reward and the timings (NaN trains on nothing and
    cannot be served as JSON)."""
    check_trajectory(graded.trajectory)
    reward = graded.reward
    numbers = [
        reward.total, *reward.components.values(), *reward.quality.values(),
        *(test.duration_s for test in reward.tests), *(call.duration_s for call in graded.trajectory.tool_calls),
    ]  # fmt: skip
    if not all(map(math.isfinite, numbers)):
        raise ContractError(f"trajectory {graded.trajectory.trajectory_id}: a reward or timing that is not finite")
