import pytest
import torch

from crucible.rl.advantages import group_relative_advantages


def test_hand_computed_group():
    # rewards 0, 1, 1, 2: mean 1, population std sqrt(0.5)
    adv = group_relative_advantages(torch.tensor([0.0, 1.0, 1.0, 2.0]), eps=0.0)
    s = 0.5**0.5
    assert torch.allclose(adv, torch.tensor([-1 / s, 0.0, 0.0, 1 / s]))


def test_mean_only():
    adv = group_relative_advantages(torch.tensor([1.0, 3.0]), scale_by_std=False)
    assert adv.tolist() == [-1.0, 1.0]


def test_equal_rewards_give_zero_advantage():
    assert group_relative_advantages(torch.tensor([0.5, 0.5, 0.5])).abs().max() == 0


def test_rejects_bad_shape():
    with pytest.raises(ValueError, match="1-D"):
        group_relative_advantages(torch.zeros(2, 2))
