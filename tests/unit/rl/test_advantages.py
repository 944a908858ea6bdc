import pytest
import torch

from crucible.rl.advantages import (
    dr_grpo_advantages,
    group_advantages,
    grpo_advantages,
    is_uniform,
    rloo_advantages,
)

REWARDS = torch.tensor([0.0, 1.0, 1.0, 2.0])  # mean 1; population std sqrt(0.5); sample std sqrt(2/3)


def test_grpo_population_and_sample_std():
    s = 0.5**0.5
    assert torch.allclose(grpo_advantages(REWARDS, eps=0.0), torch.tensor([-1 / s, 0.0, 0.0, 1 / s]))
    s = (2 / 3) ** 0.5
    assert torch.allclose(
        grpo_advantages(REWARDS, std="sample", eps=0.0), torch.tensor([-1 / s, 0.0, 0.0, 1 / s])
    )
    # eps is added to the std: 1 / (sqrt(0.5) + 0.5)
    assert grpo_advantages(REWARDS, eps=0.5)[3].item() == pytest.approx(1 / (0.5**0.5 + 0.5))


def test_dr_grpo_removes_the_mean_only():
    assert dr_grpo_advantages(torch.tensor([1.0, 3.0])).tolist() == [-1.0, 1.0]


def test_rloo_subtracts_the_mean_of_the_others():
    # r_0 = 0 minus mean(1, 1, 2) = -4/3; r_3 = 2 minus mean(0, 1, 1) = 4/3; r_1 = 1 - mean(0, 1, 2) = 0
    assert torch.allclose(rloo_advantages(REWARDS), torch.tensor([-4 / 3, 0.0, 0.0, 4 / 3]))
    # = G / (G - 1) x (r - mean)
    assert torch.allclose(rloo_advantages(REWARDS), 4 / 3 * dr_grpo_advantages(REWARDS))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_and_single_members_give_zero(estimator):
    assert group_advantages(torch.tensor([0.5, 0.5, 0.5]), estimator=estimator).abs().max() == 0
    assert group_advantages(torch.tensor([0.7]), estimator=estimator).tolist() == [0.0]
    assert is_uniform(torch.tensor([0.5, 0.5])) and not is_uniform(torch.tensor([0.5, 0.6]))


def test_rejects_bad_shape_and_unknown_estimator():
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(REWARDS, estimator="gae")  # type: ignore[arg-type]
