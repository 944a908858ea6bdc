import math

import pytest
import torch

from crucible.rl.losses import clipped_policy_loss


def test_on_policy_loss_is_minus_mean_advantage_and_gradient_is_advantage():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0])
    stats = clipped_policy_loss(
        logprobs=logp, behaviour_logprobs=logp.detach().clone(), advantages=adv, mask=torch.ones(3)
    )
    assert stats.loss.item() == pytest.approx(-(1 - 1 + 2) / 3)
    stats.loss.backward()
    # d/dlogp of -(exp(logp - b) * A)/N at ratio 1 is -A/N
    assert torch.allclose(logp.grad, -adv / 3)
    assert stats.clip_fraction == 0.0


def test_ratio_clipped_for_positive_advantage():
    # ratio e^0.5 = 1.6487 > 1.2: clipped surrogate 1.2 * A, no gradient
    logp = torch.tensor([0.0], requires_grad=True)
    stats = clipped_policy_loss(
        logprobs=logp, behaviour_logprobs=torch.tensor([-0.5]), advantages=torch.tensor([2.0]), mask=torch.ones(1)
    )
    assert stats.loss.item() == pytest.approx(-1.2 * 2.0)
    stats.loss.backward()
    assert logp.grad.item() == 0.0
    assert stats.clip_fraction == 1.0
    assert stats.ratio_max == pytest.approx(math.exp(0.5))


def test_low_ratio_negative_advantage_is_clipped_at_one_minus_eps():
    # ratio e^-1 = 0.3679 < 0.8 with A = -1: min(0.3679 * -1, 0.8 * -1) = -0.8
    logp = torch.tensor([-1.0], requires_grad=True)
    stats = clipped_policy_loss(
        logprobs=logp, behaviour_logprobs=torch.tensor([0.0]), advantages=torch.tensor([-1.0]), mask=torch.ones(1)
    )
    assert stats.loss.item() == pytest.approx(0.8)


def test_dual_clip_bounds_negative_advantage():
    # ratio e^2 = 7.389 with A = -1: PPO gives -7.389; dual clip bounds it at 3 * -1
    logp = torch.tensor([2.0], requires_grad=True)
    stats = clipped_policy_loss(
        logprobs=logp, behaviour_logprobs=torch.tensor([0.0]), advantages=torch.tensor([-1.0]), mask=torch.ones(1)
    )
    assert stats.loss.item() == pytest.approx(3.0)


def test_mask_excludes_environment_tokens():
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    stats = clipped_policy_loss(
        logprobs=logp,
        behaviour_logprobs=torch.tensor([-1.0, -5.0]),
        advantages=torch.tensor([1.0, 100.0]),
        mask=torch.tensor([1.0, 0.0]),
    )
    assert stats.loss.item() == pytest.approx(-1.0)
    assert stats.tokens == 1
    stats.loss.backward()
    assert logp.grad[1].item() == 0.0


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        clipped_policy_loss(
            logprobs=torch.zeros(2), behaviour_logprobs=torch.zeros(3), advantages=torch.zeros(2), mask=torch.ones(2)
        )
