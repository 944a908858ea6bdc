"""Drawing a token by inverse transform sampling: the distribution it is asked for, never a masked
token, the same draws for the same seed."""

from __future__ import annotations

import math

import torch

from crucible.model.sampling import sample


def test_draws_follow_the_distribution_and_never_a_masked_token() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 2
    masked = torch.zeros(50, dtype=torch.bool)
    masked[::3] = True
    masked[-1] = True  # the last token too: where a rounded draw would fall
    logp = torch.log_softmax(logits.masked_fill(masked, float("-inf")), dim=-1)
    generator = torch.Generator().manual_seed(1)
    n = 20_000
    counts = torch.bincount(torch.tensor([sample(logp, generator) for _ in range(n)]), minlength=50)
    assert counts[masked].sum() == 0
    # each frequency within 5 binomial standard deviations of its probability (a false alarm per
    # token has probability below 1e-6)
    for p, k in zip(logp.exp().tolist(), counts.tolist(), strict=True):
        assert abs(k / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12


def test_a_one_token_distribution_and_a_large_masked_vocabulary() -> None:
    generator = torch.Generator().manual_seed(2)
    only = torch.full((49_152,), float("-inf"))
    only[7] = 0.0
    assert {sample(only, generator) for _ in range(50)} == {7}
    logits = torch.randn(49_152, generator=generator)
    logits[1::2] = float("-inf")
    logp = torch.log_softmax(logits, dim=-1)
    assert all(sample(logp, generator) % 2 == 0 for _ in range(2000))


def test_the_same_seed_draws_the_same_tokens() -> None:
    logp = torch.log_softmax(torch.randn(1000, generator=torch.Generator().manual_seed(3)), dim=-1)
    draws = [[sample(logp, g) for _ in range(100)] for g in (torch.Generator().manual_seed(9) for _ in "ab")]
    assert draws[0] == draws[1] and len(set(draws[0])) > 10
