"""Scoring chosen tokens without the full logits (crucible.model.scoring): the same log-probabilities,
entropies and gradients as log-softmax over [B, T, V] logits, whatever the chunk; allowed tokens survive
packing; a block recomputed in backward gives the same gradients and counts its routers' load once."""

from __future__ import annotations

import pytest
import torch

from crucible.agent.grammar import masked_logprobs
from crucible.model import PRESETS, build_model
from crucible.model.scoring import Scoring, entropy_from_logprobs, pack_allowed, unpack_allowed


def test_allowed_tokens_survive_packing() -> None:
    g = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 300):
        allowed = torch.rand(5, vocab, generator=g) < 0.5
        allowed[:, -1] = True  # the top bit of a word: the sign bit of an int32
        packed = pack_allowed(allowed)
        assert packed.dtype == torch.int32 and packed.shape == (5, -(-vocab // 32))
        assert torch.equal(unpack_allowed(packed, vocab), allowed)


def _model():
    return build_model(PRESETS["tiny"], precision="fp32", seed=1).train()


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, vocab, (3, 20), generator=g)
    where = torch.rand(3, 20, generator=g) < 0.6
    where[:, -1] = False  # the last position predicts nothing
    targets = tokens[:, 1:][where[:, :-1]]
    allowed = torch.rand(int(where.sum()), vocab, generator=g) < 0.7
    allowed[torch.arange(len(targets)), targets] = True
    return tokens, where, targets, allowed


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_scores_are_log_softmax_of_the_full_logits(chunk: int) -> None:
    model = _model()
    vocab = model.cfg.vocab_size
    tokens, where, targets, allowed = _inputs(vocab)
    full = model(tokens).logits
    logp = masked_logprobs(full[where], allowed, temperature=0.7)
    expected = logp.gather(-1, targets[:, None]).squeeze(-1)
    (expected.sum() + entropy_from_logprobs(logp).sum()).backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    packed = pack_allowed(allowed)
    scoring = Scoring(where, targets, temperature=0.7, allowed_NW=packed, entropy=True, chunk=chunk)
    out = model(tokens, scoring=scoring)
    assert out.scores is not None and out.logits.shape == (3, 0, vocab)
    assert out.scores.entropy_N is not None
    torch.testing.assert_close(out.scores.logprobs_N, expected.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.scores.entropy_N, entropy_from_logprobs(logp).detach(), rtol=0, atol=1e-5)
    (out.scores.logprobs_N.sum() + out.scores.entropy_N.sum()).backward()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_scoring_that_names_the_wrong_number_of_tokens_is_refused() -> None:
    where = torch.zeros(2, 4, dtype=torch.bool)
    where[0, 1] = True
    with pytest.raises(ValueError, match="one token per scored position"):
        Scoring(where, torch.tensor([1, 2]))


def test_recomputed_blocks_give_the_same_gradients_and_count_the_load_once() -> None:
    model = _model()
    assert model.moe_layers, "the tiny preset has MoE layers"
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    runs = []
    for recompute in (False, True):
        model.zero_grad()
        for moe in model.moe_layers:
            moe.router.tokens_per_expert.zero_()
        model.checkpoint_blocks = recompute
        model(tokens).logits.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        runs.append((grads, [moe.router.tokens_per_expert.clone() for moe in model.moe_layers]))
    (plain, plain_load), (recomputed, load) = runs
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert all(torch.equal(a, b) for a, b in zip(load, plain_load, strict=True))
    assert all(float(c.sum()) == 2 * 16 * model.cfg.top_k for c in load)
