"""Numbers that are not finite never reach the weights: a step whose loss or gradients are not finite is
not applied (weights, optimizer state and router biases as before), a trajectory with non-finite
behaviour logprobs is refused, and weights with a non-finite value are never published."""

from __future__ import annotations

import copy

import pytest
import torch

from crucible.clients.checkpoints import WeightsError, publish_weights
from crucible.contracts import ContractError
from crucible.contracts.messages import Trajectory
from crucible.contracts.packing import pack
from crucible.contracts.runconfig import RunConfig
from crucible.contracts.trajectories import check_trajectory
from crucible.model import PRESETS, build_model
from services.trainer.batch import collate
from services.trainer.step import NonFiniteStep, train_step


def _trajectory(i: int, n: int = 12, logprob: float = -1.0) -> Trajectory:
    tokens = torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(i)).tolist()
    return Trajectory(
        run_id="r", trajectory_id=f"t{i}", group_id="g", task_id="task", taskset="s",
        tokens=pack("u32", tokens), logprobs=pack("f32", [0.0] * 4 + [logprob] * (n - 4)),
        versions=pack("u32", [0] * n), loss_mask=pack("u8", [0] * 4 + [1] * (n - 4)), constraints=pack("u8", [0] * n),
    )  # fmt: skip


def _snapshot(model, optimizer) -> tuple[dict, dict]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())


def _step(model, optimizer, advantages: list[float]) -> dict:
    batch = collate([_trajectory(0), _trajectory(1)], advantages)
    optim = RunConfig().optim
    return train_step(model=model, optimizer=optimizer, batch=batch, optim=optim, temperature=1.0)


def _unchanged(model, optimizer, before) -> bool:
    weights, state = before
    same_weights = all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    return same_weights and optimizer.state_dict()["state"].keys() == state["state"].keys()


@pytest.fixture
def trainer():
    model = build_model(PRESETS["tiny"], precision="fp32", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, optimizer, [1.0, -1.0])  # an optimizer with state, as mid-run
    return model, optimizer


def test_a_non_finite_loss_is_not_applied(trainer) -> None:
    model, optimizer = trainer
    before = _snapshot(model, optimizer)
    with pytest.raises(NonFiniteStep) as raised:
        _step(model, optimizer, [float("nan"), 1.0])
    assert raised.value.reason == "loss"
    assert _unchanged(model, optimizer, before)
    assert all(float(moe.router.tokens_per_expert.sum()) == 0 for moe in model.moe_layers)  # the load forgotten
    assert _step(model, optimizer, [1.0, -1.0])["loss"] == pytest.approx(_step_loss(model, optimizer, before))


def _step_loss(model, optimizer, before) -> float:
    """The loss the same step gives on a copy that never saw the skipped one."""
    twin = build_model(PRESETS["tiny"], precision="fp32", seed=0)
    twin.load_state_dict(before[0])
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    twin_optimizer.load_state_dict(before[1])
    return _step(twin, twin_optimizer, [1.0, -1.0])["loss"]


def test_non_finite_gradients_are_not_applied(trainer) -> None:
    model, optimizer = trainer
    before = _snapshot(model, optimizer)
    handle = model.tok_embeddings.weight.register_hook(lambda grad: grad * float("inf"))
    with pytest.raises(NonFiniteStep) as raised:
        _step(model, optimizer, [1.0, -1.0])
    handle.remove()
    assert raised.value.reason == "gradients"
    assert _unchanged(model, optimizer, before)
    assert all(p.grad is None for p in model.parameters())


def test_non_finite_behaviour_logprobs_are_refused() -> None:
    check_trajectory(_trajectory(0))
    with pytest.raises(ContractError, match="not finite"):
        check_trajectory(_trajectory(0, logprob=float("nan")))


async def test_non_finite_weights_are_never_published() -> None:
    state = {"w": torch.tensor([1.0, float("inf")]), "b": torch.zeros(2)}
    with pytest.raises(WeightsError, match=r"\['w'\].*non-finite"):  # refused before the bus or store is used
        await publish_weights(bus=None, store=None, run_id="r", version=1, step=1, state_dict=state)
