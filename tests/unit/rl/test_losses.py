"""Every loss, aggregation, correction and regulariser against values and gradients computed by hand."""

import math

import pytest
import torch

from crucible.contracts.runconfig import OptimSection
from crucible.model.scoring import entropy_from_logprobs
from crucible.rl.losses import (
    aggregate,
    cispo_objective,
    correction_weights,
    kl_estimate,
    policy_loss,
    ppo_objective,
)


def optim(**fields) -> OptimSection:
    return OptimSection.model_validate(fields)


def loss(logp, behaviour, adv, mask=None, **fields):
    logp = torch.tensor([logp], requires_grad=True) if not isinstance(logp, torch.Tensor) else logp
    rows = lambda x: torch.tensor([x], dtype=torch.float32)  # noqa: E731
    mask = rows(mask) if mask is not None else torch.ones_like(logp)
    stats = policy_loss(
        logprobs_BT=logp, behaviour_logprobs_BT=rows(behaviour), advantages_BT=rows(adv), mask_BT=mask,
        optim=optim(**fields),
    )  # fmt: skip
    stats.loss.backward()
    return stats, logp.grad[0]


def test_on_policy_ppo_is_minus_mean_advantage_and_gradient_is_advantage():
    stats, grad = loss([-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5], [1.0, -1.0, 2.0])
    assert stats.loss.item() == pytest.approx(-(1 - 1 + 2) / 3)
    assert torch.allclose(grad, -torch.tensor([1.0, -1.0, 2.0]) / 3)  # d/dlogp of -(r A)/N at r = 1
    assert stats.metrics["clip_low_fraction"] == stats.metrics["clip_high_fraction"] == 0.0
    assert stats.metrics["ratio_p50"] == pytest.approx(1.0) and stats.metrics[
        "kl_behaviour"
    ] == pytest.approx(0)


def test_ratio_clipped_high_for_positive_advantage():
    # r = e^0.5 = 1.6487 > 1.2: objective 1.2 A, no gradient
    stats, grad = loss([0.0], [-0.5], [2.0])
    assert stats.loss.item() == pytest.approx(-1.2 * 2.0) and grad.item() == 0.0
    assert stats.metrics["clip_high_fraction"] == 1.0 and stats.metrics["ratio_max"] == pytest.approx(
        math.exp(0.5)
    )


def test_clip_higher_lets_a_positive_token_rise_further():
    # clip_high 0.7: 1.6487 < 1.7, so unclipped: objective r A, gradient -r A = -1.6487 x 2
    stats, grad = loss([0.0], [-0.5], [2.0], clip_high=0.7)
    assert stats.loss.item() == pytest.approx(-math.exp(0.5) * 2.0)
    assert grad.item() == pytest.approx(-math.exp(0.5) * 2.0)


def test_low_ratio_negative_advantage_is_clipped_at_one_minus_clip_low():
    # r = e^-1 = 0.3679 < 0.8 with A = -1: min(-0.3679, -0.8) = -0.8
    stats, grad = loss([-1.0], [0.0], [-1.0])
    assert stats.loss.item() == pytest.approx(0.8) and grad.item() == 0.0
    assert stats.metrics["clip_low_fraction"] == 1.0


def test_dual_clip_bounds_negative_advantage_and_can_be_off():
    # r = e^2 = 7.389 with A = -1: PPO gives -7.389; the dual clip bounds it at 3 x -1
    stats, _ = loss([2.0], [0.0], [-1.0])
    assert stats.loss.item() == pytest.approx(3.0)
    stats, grad = loss([2.0], [0.0], [-1.0], dual_clip=None)
    assert stats.loss.item() == pytest.approx(math.exp(2.0)) and grad.item() == pytest.approx(math.exp(2.0))


def test_cispo_keeps_a_clipped_token_s_gradient_with_a_clipped_weight():
    # r = e^0.5 clipped to 1.2; loss = -1.2 x A x logp = -1.2 x 2 x 0 = 0, gradient -1.2 x 2
    stats, grad = loss([0.0], [-0.5], [2.0], loss="cispo")
    assert stats.loss.item() == pytest.approx(0.0) and grad.item() == pytest.approx(-2.4)
    # a token far outside the range (PPO gives it no gradient) still learns, at the bound
    _, ppo_grad = loss([3.0], [0.0], [1.0])
    _, cispo_grad = loss([3.0], [0.0], [1.0], loss="cispo")
    assert ppo_grad.item() == 0.0 and cispo_grad.item() == pytest.approx(-1.2)


def test_decoupled_clips_against_the_proximal_policy_and_weights_by_the_behaviour():
    # A token sampled at logp -0.5 by an old policy, now at 0.0. PPO would clip it (r = 1.65 > 1.2, no
    # gradient). Decoupled: r = pi / pi_prox = 1 (prox = current), weight pi_prox / pi_behaviour = 1.65:
    # objective 1.65 x r x A, gradient -1.65 x 2.
    w = math.exp(0.5)
    _, ppo_grad = loss([0.0], [-0.5], [2.0])
    assert ppo_grad.item() == 0.0  # the flaw: a stale token outside the clip range learns nothing
    stats, grad = loss([0.0], [-0.5], [2.0], loss="decoupled")
    assert stats.loss.item() == pytest.approx(-w * 2.0) and grad.item() == pytest.approx(-w * 2.0)
    assert stats.metrics["correction_weight_mean"] == pytest.approx(w)
    # truncated at 1.5
    _, grad = loss([0.0], [-0.5], [2.0], loss="decoupled", correction="tis", correction_cap=1.5)
    assert grad.item() == pytest.approx(-1.5 * 2.0)
    # masked outside [1/1.5, 1.5]: no gradient, counted
    stats, grad = loss([0.0], [-0.5], [2.0], loss="decoupled", correction="mis", correction_cap=1.5)
    assert grad.item() == 0.0 and stats.metrics["correction_masked_fraction"] == 1.0


def test_correction_levels():
    log_r = torch.tensor([[0.5, -0.2, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the last token is the environment's: not counted
    token = correction_weights(log_r, mask, mode="none", level="token", cap=2.0)
    assert torch.allclose(token, torch.tensor([[math.exp(0.5), math.exp(-0.2), 1.0]]))
    seq = correction_weights(log_r, mask, mode="none", level="sequence", cap=2.0)
    assert torch.allclose(seq, torch.full((1, 3), math.exp(0.3)))
    geo = correction_weights(log_r, mask, mode="none", level="geometric", cap=2.0)
    assert torch.allclose(geo, torch.full((1, 3), math.exp(0.15)))
    assert correction_weights(log_r * 10, mask, mode="tis", level="sequence", cap=2.0).max() == 2.0
    assert correction_weights(log_r * 10, mask, mode="mis", level="sequence", cap=2.0).max() == 0.0
    huge = correction_weights(torch.tensor([[1e4]]), torch.ones(1, 1), mode="none", level="token", cap=2.0)
    assert huge.item() == pytest.approx(math.exp(20.0))  # the log-ratio is clamped


def test_a_correction_needs_the_decoupled_loss():
    with pytest.raises(ValueError, match="set loss = 'decoupled'"):
        optim(correction="tis")


def test_aggregations():
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(x, m, mode="token_mean").item() == pytest.approx(16 / 4)
    assert aggregate(x, m, mode="seq_mean_token_mean").item() == pytest.approx((2 + 10) / 2)
    assert aggregate(x, m, mode="seq_sum_norm", norm_tokens=8).item() == pytest.approx(16 / (2 * 8))
    empty = torch.zeros(2, 3)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_sum_norm"):
        assert aggregate(x, empty, mode=mode).item() == 0.0  # zero-length responses: no loss, no NaN


def test_seq_sum_norm_does_not_normalise_by_length():
    # Dr. GRPO: a long and a short response with the same advantage get the same gradient per token
    logp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    stats = policy_loss(
        logprobs_BT=logp,
        behaviour_logprobs_BT=torch.zeros(2, 4),
        advantages_BT=torch.ones(2, 4),
        mask_BT=mask,
        optim=optim(aggregation="seq_sum_norm", norm_tokens=4),
    )
    stats.loss.backward()
    assert logp.grad[0, 0].item() == logp.grad[1, 0].item() == pytest.approx(-1 / 8)
    logp.grad = None
    policy_loss(
        logprobs_BT=logp,
        behaviour_logprobs_BT=torch.zeros(2, 4),
        advantages_BT=torch.ones(2, 4),
        mask_BT=mask,
        optim=optim(aggregation="seq_mean_token_mean"),
    ).loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-1 / 8) and logp.grad[1, 0].item() == pytest.approx(-1 / 2)


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log r = ref - logp = -0.5
    assert kl_estimate(logp, ref, estimator="k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, estimator="k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, estimator="k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)


def test_kl_as_a_loss_term_and_as_a_reward_penalty():
    logp = torch.tensor([[-1.0]], requires_grad=True)
    common = dict(behaviour_logprobs_BT=torch.tensor([[-1.0]]), advantages_BT=torch.tensor([[1.0]]),
                  mask_BT=torch.ones(1, 1), ref_logprobs_BT=torch.tensor([[-1.5]]))  # fmt: skip
    stats = policy_loss(logprobs_BT=logp, optim=optim(kl_coef=0.1, kl_estimator="k1"), **common)
    assert stats.loss.item() == pytest.approx(-1.0 + 0.1 * 0.5)
    stats.loss.backward()
    assert logp.grad.item() == pytest.approx(-1.0 + 0.1)  # d k1 / d logp = 1
    assert stats.metrics["kl_reference"] == pytest.approx(0.5)
    logp.grad = None
    stats = policy_loss(
        logprobs_BT=logp, optim=optim(kl_coef=0.1, kl_estimator="k1", kl_mode="reward"), **common
    )
    stats.loss.backward()
    assert logp.grad.item() == pytest.approx(-(1.0 - 0.1 * 0.5))  # the advantage lowered by 0.05
    with pytest.raises(ValueError, match="reference policy"):
        policy_loss(logprobs_BT=logp, optim=optim(kl_coef=0.1), **{**common, "ref_logprobs_BT": None})


def test_entropy_bonus_and_entropy_of_a_constrained_distribution():
    logp_V = torch.log(torch.tensor([[0.5, 0.5, 0.0]]))  # the third token forbidden
    assert entropy_from_logprobs(logp_V).item() == pytest.approx(math.log(2))
    logp = torch.tensor([[-1.0]], requires_grad=True)
    stats = policy_loss(
        logprobs_BT=logp, behaviour_logprobs_BT=torch.tensor([[-1.0]]), advantages_BT=torch.zeros(1, 1),
        mask_BT=torch.ones(1, 1), optim=optim(entropy_coef=0.01), entropy_BT=torch.tensor([[0.7]]),
    )  # fmt: skip
    assert stats.loss.item() == pytest.approx(-0.007) and stats.metrics["entropy"] == pytest.approx(0.7)


def test_mask_excludes_environment_tokens():
    stats, grad = loss([-1.0, -1.0], [-1.0, -5.0], [1.0, 100.0], mask=[1.0, 0.0])
    assert stats.loss.item() == pytest.approx(-1.0) and stats.metrics["tokens"] == 1
    assert grad[1].item() == 0.0


def test_objectives_directly():
    r, a = torch.tensor([0.5, 1.5]), torch.tensor([1.0, -1.0])
    assert ppo_objective(r, a, clip_low=0.2, clip_high=0.2, dual_clip=None).tolist() == pytest.approx(
        [0.5, -1.5]
    )
    logp = torch.tensor([-2.0, -1.0])
    assert cispo_objective(logp, r, a, clip_low=0.2, clip_high=0.2).tolist() == pytest.approx([-1.6, 1.2])


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        policy_loss(
            logprobs_BT=torch.zeros(1, 2),
            behaviour_logprobs_BT=torch.zeros(1, 3),
            advantages_BT=torch.zeros(1, 2),
            mask_BT=torch.ones(1, 2),
            optim=optim(),
        )
