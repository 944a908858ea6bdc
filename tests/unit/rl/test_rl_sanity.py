"""The RL sanity suite: a tiny random-init policy learns a choice reachable by chance, through the
rollout engine and the trainer step (benches/bench_rl_sanity.py), and a shuffled-reward control does not."""

from __future__ import annotations

import pytest

from benches.bench_rl_sanity import run_arm

pytestmark = pytest.mark.slow
STEPS = 80


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ppo_learns_and_the_shuffled_control_does_not(seed: int) -> None:
    rl = run_arm(loss="ppo", seed=seed, steps=STEPS, control=False)
    control = run_arm(loss="ppo", seed=seed, steps=STEPS, control=True)
    assert rl.end - rl.start >= 0.40, rl.accuracy
    assert abs(control.end - control.start) <= 0.05, control.accuracy


@pytest.mark.parametrize("loss", ["cispo", "decoupled"])
def test_every_policy_loss_learns(loss: str) -> None:
    arm = run_arm(loss=loss, seed=0, steps=STEPS, control=False)
    assert arm.end - arm.start >= 0.40, arm.accuracy
