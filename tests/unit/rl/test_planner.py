"""The step planner against hand-computed values: what is kept, dropped as stale or alone, the advantages
of each estimator, the step's metrics, and the steps that must be skipped."""

from __future__ import annotations

import math

import pytest

from crucible.contracts.messages import GradedTrajectory, Reward, TokenUsage, Trajectory
from crucible.contracts.packing import pack
from crucible.contracts.runconfig import RunConfig
from crucible.rl.planner import plan_step


def attempt(tid: str, reward: float, versions: list[int], *, resolved: bool = False) -> GradedTrajectory:
    """Two prompt tokens (version 0, not sampled: one system, one task) then one sampled token per entry
    of `versions`."""
    n = 2 + len(versions)
    trajectory = Trajectory(
        run_id="r", trajectory_id=tid, group_id=tid[0], task_id="t", taskset="s",
        tokens=pack("u32", list(range(n))), logprobs=pack("f32", [0.0] * n),
        versions=pack("u32", [0, 0, *versions]), loss_mask=pack("u8", [0, 0] + [1] * len(versions)),
        constraints=pack("u8", [0] * n),
        token_usage=TokenUsage(system=1, task=1, actions=len(versions)),
    )  # fmt: skip
    reward_ = Reward(total=reward, tests_passed=0, tests_total=1, resolved=resolved)
    return GradedTrajectory(trajectory=trajectory, reward=reward_, graded_at=0.0)


def config(**optim) -> RunConfig:
    return RunConfig.model_validate(
        {"optim": optim, "schedule": {"group_size": 2, "max_staleness": 1, "publish_every": 2}}
    )


def test_grpo_advantages_and_metrics_by_hand() -> None:
    groups = [
        [attempt("a0", 1.0, [3, 3], resolved=True), attempt("a1", 0.0, [3])],
        [attempt("b0", 2.0, [2]), attempt("b1", 0.0, [3]), attempt("b2", 1.0, [3, 2])],
    ]
    plan = plan_step(groups, version=3, step=7, config=config(advantage="grpo", advantage_eps=0.0))
    assert [g.trajectory.trajectory_id for g in plan.kept] == ["a0", "a1", "b0", "b1", "b2"]
    # group a: mean 0.5, population std 0.5; group b: mean 1, population std sqrt(2/3)
    s = math.sqrt(2 / 3)
    assert plan.advantages == pytest.approx([1.0, -1.0, 1 / s, -1 / s, 0.0])
    assert plan.stale == plan.alone == [] and plan.non_finite is None
    m = plan.metrics
    assert m["reward_mean"] == pytest.approx(4.0 / 5)
    assert m["resolved_rate"] == pytest.approx(1 / 5)
    assert m["reward_max"] == 2.0
    # lags behind version 3: a0 0, a1 0, b0 1, b1 0, b2 1 (its oldest sampled token is version 2)
    assert m["staleness_mean"] == pytest.approx(2 / 5) and m["staleness_max"] == 1.0
    assert (m["staleness_lag_0"], m["staleness_lag_1"]) == (3.0, 2.0)
    # steps since the oldest token's version was published: 7 - 2 * publish_every(2) = 3
    assert m["token_age_steps_max"] == 3.0
    assert m["trajectories"] == 5.0 and m["stale_dropped"] == 0.0
    # tokens per kept episode, by part: actions 2, 1, 1, 1, 2
    assert (m["tokens_system"], m["tokens_task"], m["tokens_observations"]) == (1.0, 1.0, 0.0)
    assert m["tokens_actions"] == pytest.approx(7 / 5)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [("dr_grpo", [1.5, -0.5, -1.0]), ("rloo", [2.25, -0.75, -1.5])],  # rloo: G / (G - 1) x dr_grpo's
)
def test_other_estimators_by_hand(estimator: str, expected: list[float]) -> None:
    group = [attempt("a0", 2.0, [0]), attempt("a1", 0.0, [0]), attempt("a2", -0.5, [0])]  # mean 0.5
    plan = plan_step([group], version=0, step=0, config=config(advantage=estimator))
    assert plan.advantages == pytest.approx(expected)


def test_stale_members_are_dropped_and_a_group_left_alone_is_not_trained() -> None:
    groups = [
        [attempt("a0", 1.0, [1]), attempt("a1", 0.0, [2]), attempt("a2", 0.5, [3])],  # a0 lags 2 > 1
        [attempt("b0", 1.0, [3]), attempt("b1", 0.0, [0, 3])],  # b1's oldest token lags 3
    ]
    plan = plan_step(groups, version=3, step=6, config=config(advantage="dr_grpo"))
    assert plan.stale == ["a0", "b1"] and plan.alone == ["b0"]
    assert [g.trajectory.trajectory_id for g in plan.kept] == ["a1", "a2"]
    assert plan.advantages == pytest.approx([-0.25, 0.25])
    # only the kept trajectories' lags: a1 1, a2 0
    assert plan.metrics["staleness_mean"] == pytest.approx(0.5) and plan.metrics["stale_dropped"] == 2.0


def test_a_trajectory_that_sampled_nothing_is_never_stale() -> None:
    groups = [[attempt("a0", 1.0, []), attempt("a1", 0.0, [9])]]
    plan = plan_step(groups, version=9, step=0, config=config())
    assert [g.trajectory.trajectory_id for g in plan.kept] == ["a0", "a1"] and plan.stale == []


def test_nothing_to_train_is_an_empty_plan() -> None:
    plan = plan_step([[attempt("a0", 1.0, [0])]], version=5, step=0, config=config())
    assert plan.kept == [] and plan.advantages == [] and plan.metrics == {} and plan.stale == ["a0"]


@pytest.mark.parametrize(("rewards", "reason"), [((math.nan, 1.0), "rewards"), ((math.inf, 1.0), "rewards")])
def test_non_finite_numbers_make_a_step_to_skip(rewards: tuple[float, float], reason: str) -> None:
    group = [attempt("a0", rewards[0], [0]), attempt("a1", rewards[1], [0])]
    assert plan_step([group], version=0, step=0, config=config()).non_finite == reason


def test_finite_rewards_whose_advantages_overflow_are_refused() -> None:
    group = [attempt("a0", 1e39, [0]), attempt("a1", 0.0, [0])]  # finite, beyond float32's range
    plan = plan_step([group], version=0, step=0, config=config(advantage="dr_grpo"))
    assert plan.non_finite == "advantages"
