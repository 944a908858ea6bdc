"""A trajectory's per-token arrays as every reader sees them, and what makes a graded trajectory usable.

`arrays(trajectory)` is the one typed view of the packed arrays: numpy arrays over the message's own
bytes (zero-copy, read-only), their lengths checked once, and one definition of each derived quantity
(which tokens the policy sampled, their versions, the counts). Optional parts follow one rule: empty on
the wire means absent (`routes` is None for a dense model's episode, `token_text` empty for the byte
tokenizer); present, they must fit the tokens or the trajectory is refused.

`check_trajectory` / `check_graded` are checked by every consumer that reads the arrays (the trainer
before it trains, the api before it stores): one home, so a forged or corrupt message is dead-lettered
with the same reason wherever it arrives instead of failing a training step or a detail page later.
A non-finite reward is refused by the api (`check_graded`: it cannot be served as JSON); the trainer
takes it and skips the step with the reason (see services.trainer.job)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

import numpy as np
from numpy.typing import NDArray

from crucible.contracts import ContractError
from crucible.contracts.messages import GradedTrajectory, Trajectory
from crucible.contracts.packing import view


@dataclass(frozen=True, eq=False)
class TrajectoryArrays:
    """A trajectory's per-token arrays, each of length `num_tokens` (read-only views of its bytes)."""

    tokens: NDArray[np.uint32]
    logprobs: NDArray[np.float32]
    """Behaviour logprobs; 0 where the policy did not sample."""
    versions: NDArray[np.uint32]
    """The policy version that produced each token (an environment token: the version at the time)."""
    loss_mask: NDArray[np.uint8]
    constraints: NDArray[np.uint8]
    routes: NDArray[np.uint8] | None
    """Expert ids [num_tokens, layers, top_k] for router replay; None for a dense model's episode."""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @cached_property
    def sampled(self) -> NDArray[np.bool_]:
        """Where the policy sampled the token (loss_mask != 0): the tokens it is trained on."""
        return self.loss_mask != 0

    @cached_property
    def num_sampled(self) -> int:
        return int(np.count_nonzero(self.sampled))

    @cached_property
    def sampled_versions(self) -> NDArray[np.uint32]:
        """The versions of the sampled tokens, in order. Empty when the policy sampled nothing: such a
        trajectory holds no policy's tokens, so nothing in it is stale and it spans no version."""
        return self.versions[self.sampled]

    @property
    def version_span(self) -> tuple[int, int] | None:
        """The lowest and highest version among the sampled tokens; None when there are none."""
        v = self.sampled_versions
        return (int(v.min()), int(v.max())) if len(v) else None


def arrays(trajectory: Trajectory) -> TrajectoryArrays:
    """The typed view of `trajectory`'s packed arrays; ContractError unless they agree in length."""
    t = trajectory
    try:
        columns = {
            "tokens": view("u32", t.tokens), "logprobs": view("f32", t.logprobs),
            "versions": view("u32", t.versions), "loss_mask": view("u8", t.loss_mask),
            "constraints": view("u8", t.constraints),
        }  # fmt: skip
    except ValueError as exc:
        raise ContractError(f"trajectory {t.trajectory_id}: {exc}") from exc
    n = len(columns["tokens"])
    if any(len(c) != n for c in columns.values()):
        sizes = ", ".join(f"{len(c)} {name}" for name, c in columns.items())
        raise ContractError(f"trajectory {t.trajectory_id}: per-token arrays differ in length: {sizes}")
    routes = None
    if t.routes_shape or t.routes:
        shape = tuple(t.routes_shape)
        if len(shape) != 3 or shape[0] != n or len(t.routes) != math.prod(shape):
            raise ContractError(
                f"trajectory {t.trajectory_id}: routes of shape {t.routes_shape} ({len(t.routes)} bytes)"
                f" do not fit {n} tokens"
            )
        routes = view("u8", t.routes).reshape(shape)
    return TrajectoryArrays(**columns, routes=routes)


def check_trajectory(trajectory: Trajectory) -> None:
    """Raise ContractError unless the per-token arrays agree in length and every index into them fits."""
    t = trajectory
    packed = arrays(t)
    n = packed.num_tokens
    if n < 2:
        raise ContractError(f"trajectory {t.trajectory_id}: fewer than two tokens")
    if t.token_text and len(t.token_text) != n:
        raise ContractError(f"trajectory {t.trajectory_id}: {len(t.token_text)} token texts for {n} tokens")
    if not np.isfinite(packed.logprobs).all():
        raise ContractError(f"trajectory {t.trajectory_id}: behaviour logprobs that are not finite")
    starts = t.context_starts
    if starts and (starts[0] != 0 or any(b <= a for a, b in pairwise(starts)) or starts[-1] >= n):
        raise ContractError(
            f"trajectory {t.trajectory_id}: context starts {starts[:8]} are not increasing from 0"
            f" within {n} tokens"
        )
    for call in t.tool_calls:
        if not 0 <= call.token_start <= call.token_end <= n:
            raise ContractError(
                f"trajectory {t.trajectory_id}: tool call {call.index} spans tokens"
                f" [{call.token_start}, {call.token_end}) outside {n}"
            )


def check_graded(graded: GradedTrajectory) -> None:
    """check_trajectory, and finite numbers in the reward and the timings (NaN trains on nothing and
    cannot be served as JSON)."""
    check_trajectory(graded.trajectory)
    reward = graded.reward
    numbers = [
        reward.total, *reward.components.values(), *reward.quality.values(),
        *(test.duration_s for test in reward.tests),
        *(call.duration_s for call in graded.trajectory.tool_calls),
    ]  # fmt: skip
    if not all(map(math.isfinite, numbers)):
        trajectory_id = graded.trajectory.trajectory_id
        raise ContractError(f"trajectory {trajectory_id}: a reward or timing that is not finite")
