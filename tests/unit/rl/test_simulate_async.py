"""The asynchrony simulator (benches/simulate_async.py) against hand-computed pipelines."""

from __future__ import annotations

import itertools

import pytest

from benches.simulate_async import Costs, Pipeline, simulate

SYNC = {"max_staleness": 0, "publish_every": 1}


def test_sync_with_a_free_trainer_runs_at_the_rollouts_pace():
    free = Costs(group_s=10.0, grade_s=0.0, step_s=0.0, publish_s=0.0, load_s=0.0)
    for replicas in (1, 2):
        result = simulate(free, Pipeline(replicas=replicas, groups_per_step=2, steps=10, **SYNC))
        assert result.seconds_per_step == pytest.approx(2 * 10.0 / replicas)


def test_sync_step_is_the_sum_of_its_stages():
    costs = Costs(group_s=20.0, grade_s=2.0, step_s=5.0, publish_s=1.0, load_s=0.5)
    result = simulate(costs, Pipeline(graders=2, group_size=4, groups_per_step=2, steps=6, **SYNC))
    # two groups one after the other, the last group's 4 trajectories on 2 graders, step, publish, load
    assert result.seconds_per_step == pytest.approx(2 * 20.0 + 2 * 2.0 + 5.0 + 1.0 + 0.5)
    assert result.max_lag == 0


def test_async_hides_the_trainer_behind_the_rollouts():
    costs = Costs(group_s=20.0, grade_s=2.0, step_s=5.0, publish_s=1.0, load_s=0.5)
    result = simulate(costs, Pipeline(graders=2, group_size=4, groups_per_step=2, max_staleness=2, steps=20))
    assert result.seconds_per_step == pytest.approx(2 * 20.0)


@pytest.mark.parametrize(
    ("costs", "replicas", "trainers"),
    list(
        itertools.product(
            [
                Costs(group_s=20.0, grade_s=2.0, step_s=5.0, publish_s=1.0, load_s=0.5),
                Costs(group_s=3.0, grade_s=1.0, step_s=30.0, publish_s=4.0, load_s=2.0),
                Costs(group_s=7.0, grade_s=5.0, step_s=7.0, publish_s=0.0, load_s=7.0),
            ],
            [1, 3, 8],
            [1, 4],
        )
    ),
)
def test_async_is_never_slower_than_sync_and_keeps_the_staleness_bound(costs, replicas, trainers):
    pipe = Pipeline(replicas=replicas, trainers=trainers, steps=30)
    sync = simulate(costs, Pipeline(**{**pipe.__dict__, **SYNC}))
    assert sync.max_lag == 0
    for staleness, publish_every in ((1, 1), (2, 1), (2, 2)):
        result = simulate(
            costs, Pipeline(**{**pipe.__dict__, "max_staleness": staleness, "publish_every": publish_every})
        )
        assert len(result.step_done_at) == 30
        assert result.max_lag <= staleness
        assert result.seconds <= sync.seconds + 1e-9
