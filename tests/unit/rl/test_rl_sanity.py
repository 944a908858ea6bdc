"""The RL sanity suite: a tiny random-init policy learns a choice reachable by chance, through the
rollout engine and the trainer step (benches/bench_rl_sanity.py), and a shuffled-reward control does not.
One seed per loss here (a different one each); the benchmark runs every loss over three seeds."""

from __future__ import annotations

import pytest

from benches.bench_rl_sanity import run_arm

pytestmark = pytest.mark.slow
STEPS = 80


def test_ppo_learns_and_the_shuffled_control_does_not() -> None:
    rl = run_arm(loss="ppo", seed=0, steps=STEPS, control=False)
    control = run_arm(loss="ppo", seed=0, steps=STEPS, control=True)
    assert rl.end - rl.start >= 0.40, rl.accuracy
    assert abs(control.end - control.start) <= 0.05, control.accuracy


@pytest.mark.parametrize(("loss", "seed"), [("cispo", 1), ("decoupled", 2)])
def test_every_policy_loss_learns(loss: str, seed: int) -> None:
    arm = run_arm(loss=loss, seed=seed, steps=STEPS, control=False)
    assert arm.end - arm.start >= 0.40, arm.accuracy
