"""The routers' load-balancing step must see the load of real tokens only. A padded training batch routes
its padding positions too (router replay gives them experts 0..k-1); counting them would push the
biases of those experts down every step. `collate` marks the real tokens in `valid_BT` and the model
counts only those."""

from __future__ import annotations

import pytest
import torch

from crucible.contracts.messages import GradedTrajectory, Reward, Trajectory
from crucible.contracts.packing import pack
from crucible.model import PRESETS, build_model
from services.trainer.batch import collate

LENGTHS = (9, 23)
PROMPT = 4  # environment tokens at the start of each trajectory: loss mask 0, but routed


def _loads(model) -> list[torch.Tensor]:
    return [moe.router.tokens_per_expert.clone() for moe in model.moe_layers]


def _reset(model) -> None:
    for moe in model.moe_layers:
        moe.router.tokens_per_expert.zero_()


def _trajectories(model, *, replay: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list]:
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(1, 256, (n,), generator=g) for n in LENGTHS]
    routes, graded = [], []
    model.eval()
    for i, seq in enumerate(sequences):
        with torch.no_grad():
            recorded = model(seq[None]).routes[0] if replay else None
        routes.append(recorded)
        n = len(seq)
        trajectory = Trajectory(
            run_id="r",
            trajectory_id=f"t{i}",
            group_id="g",
            task_id="task",
            taskset="s",
            tokens=pack("u32", seq.tolist()),
            logprobs=pack("f32", [0.0] * n),
            versions=pack("u32", [0] * n),
            loss_mask=pack("u8", [0] * PROMPT + [1] * (n - PROMPT)),
            constraints=pack("u8", [0] * n),
            routes=b"" if recorded is None else pack("u8", recorded.flatten().tolist()),
            routes_shape=[] if recorded is None else list(recorded.shape),
        )
        reward = Reward(total=0.0, tests_passed=0, tests_total=1)
        graded.append(GradedTrajectory(trajectory=trajectory, reward=reward, graded_at=0.0))
    return sequences, routes, graded


def test_collate_marks_every_real_token_valid_and_padding_not():
    model = build_model(PRESETS["tiny"], precision="fp32", seed=0)
    _, _, graded = _trajectories(model, replay=True)
    batch = collate([g.trajectory for g in graded], [1.0, -1.0])
    assert batch.valid_BT.shape == batch.tokens_BT.shape
    assert batch.valid_BT.sum(dim=1).tolist() == [float(n) for n in LENGTHS]
    assert batch.valid_BT[0, : LENGTHS[0]].eq(1).all() and batch.valid_BT[0, LENGTHS[0] :].eq(0).all()
    # the prompt (loss mask 0) is real: it counts in the load although it gets no gradient
    assert (batch.valid_BT >= batch.mask_BT).all()
    assert (batch.valid_BT[:, :PROMPT] == 1).all() and (batch.mask_BT[:, :PROMPT] == 0).all()


@pytest.mark.parametrize("replay", [True, False], ids=["replayed-routes", "fresh-routes"])
def test_padded_batch_counts_exactly_the_real_positions_per_expert(replay):
    model = build_model(PRESETS["tiny"], precision="fp32", seed=0)
    assert model.moe_layers, "the tiny preset must have MoE layers for this test"
    sequences, routes, graded = _trajectories(model, replay=replay)
    batch = collate([g.trajectory for g in graded], [1.0, -1.0])
    assert (batch.routes_BTLk is not None) == replay
    model.train()

    _reset(model)
    with torch.no_grad():
        for seq, recorded in zip(sequences, routes, strict=True):
            model(seq[None], routes=None if recorded is None else recorded[None])
    one_by_one = _loads(model)

    _reset(model)
    with torch.no_grad():
        model(batch.tokens_BT, routes=batch.routes_BTLk, valid_BT=batch.valid_BT)
    padded = _loads(model)

    k = PRESETS["tiny"].top_k
    for layer, (expected, got) in enumerate(zip(one_by_one, padded, strict=True)):
        assert float(expected.sum()) == sum(LENGTHS) * k
        assert torch.equal(got, expected), (layer, got, expected)

    # without the mask the padding would be counted: the batch really has padding positions
    _reset(model)
    with torch.no_grad():
        model(batch.tokens_BT, routes=batch.routes_BTLk)
    assert all(float(load.sum()) == len(LENGTHS) * max(LENGTHS) * k for load in _loads(model))


def test_bias_step_after_a_padded_batch_equals_the_one_by_one_step():
    model = build_model(PRESETS["tiny"], precision="fp32", seed=0)
    sequences, routes, graded = _trajectories(model, replay=True)
    batch = collate([g.trajectory for g in graded], [1.0, -1.0])
    reference = build_model(PRESETS["tiny"], precision="fp32", seed=0).train()
    model.train()
    with torch.no_grad():
        for seq, recorded in zip(sequences, routes, strict=True):
            reference(seq[None], routes=recorded[None])
        model(batch.tokens_BT, routes=batch.routes_BTLk, valid_BT=batch.valid_BT)
    reference.update_router_biases()
    model.update_router_biases()
    for ours, theirs in zip(model.moe_layers, reference.moe_layers, strict=True):
        assert torch.equal(ours.router.expert_bias, theirs.router.expert_bias)
    assert any(moe.router.expert_bias.abs().sum() > 0 for moe in model.moe_layers)


def test_valid_mask_of_the_wrong_shape_is_refused():
    model = build_model(PRESETS["tiny"], precision="fp32", seed=0)
    tokens = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="valid_BT"):
        model(tokens, valid_BT=torch.ones(2, 4))
