"""Numbers that are not finite never reach the weights: a step whose loss or gradients are not finite is
not applied (weights, optimizer state and router biases as before) on the trainer's worker group, a
trajectory with non-finite behaviour logprobs is refused, and weights with a non-finite value are never
published."""

from __future__ import annotations

import pytest
import torch

from crucible.clients.checkpoints import WeightsError, publish_weights
from crucible.contracts import ContractError
from crucible.contracts.messages import Trajectory
from crucible.contracts.packing import pack
from crucible.contracts.runconfig import RunConfig
from crucible.contracts.trajectories import check_trajectory
from services.trainer.group import NonFiniteStep, PolicyGroup
from services.trainer.policy import PolicyRank

pytestmark = pytest.mark.slow
CONFIG = RunConfig.model_validate({"optim": {"learning_rate": 1e-3}})


class ProbedRank(PolicyRank):
    """A rank the tests can look into, and whose gradients they can poison."""

    def optimizer_steps(self) -> list[float]:
        return sorted(float(state["step"]) for state in self.optimizer.state.values())

    def router_load(self) -> float:
        return sum(float(moe.router.tokens_per_expert.sum()) for moe in self.model.moe_layers)

    def gradients_cleared(self) -> bool:
        return all(p.grad is None for p in self.model.parameters())

    def poison_gradients(self, on: bool) -> None:
        if on:  # on the embeddings' output: FSDP hands the weight its gradient past any hook on it

            def poison(module, args, output):
                output.register_hook(lambda grad: grad * float("inf"))

            self.hook = self.model.tok_embeddings.register_forward_hook(poison)
        else:
            self.hook.remove()


def _trajectory(i: int, n: int = 12, logprob: float = -1.0) -> Trajectory:
    tokens = torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(i)).tolist()
    return Trajectory(
        run_id="r",
        trajectory_id=f"t{i}",
        group_id="g",
        task_id="task",
        taskset="s",
        tokens=pack("u32", tokens),
        logprobs=pack("f32", [0.0] * 4 + [logprob] * (n - 4)),
        versions=pack("u32", [0] * n),
        loss_mask=pack("u8", [0] * 4 + [1] * (n - 4)),
        constraints=pack("u8", [0] * n),
    )


def _step(policy: PolicyGroup, advantages: list[float]) -> dict:
    return policy.train([_trajectory(0), _trajectory(1)], advantages)


def _probe(policy: PolicyGroup, method, *args):
    return policy.workers.call(method, *args)[0]


@pytest.fixture
def trainer():
    policy = PolicyGroup(CONFIG, timeout_s=120, rank=ProbedRank)
    _step(policy, [1.0, -1.0])  # an optimizer with state, as mid-run
    yield policy
    policy.close()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_non_finite_loss_is_not_applied(trainer) -> None:
    weights, steps = trainer.weights(), _probe(trainer, ProbedRank.optimizer_steps)
    with pytest.raises(NonFiniteStep) as raised:
        _step(trainer, [float("nan"), 1.0])
    assert raised.value.reason == "loss"
    assert _same(trainer.weights(), weights) and _probe(trainer, ProbedRank.optimizer_steps) == steps
    assert _probe(trainer, ProbedRank.router_load) == 0  # the load the skipped forward counted is forgotten
    # the next step is the one a group that never saw the skipped step takes
    twin = PolicyGroup(CONFIG, timeout_s=120)
    try:
        _step(twin, [1.0, -1.0])
        assert _step(trainer, [1.0, -1.0])["loss"] == pytest.approx(_step(twin, [1.0, -1.0])["loss"])
    finally:
        twin.close()


def test_non_finite_gradients_are_not_applied(trainer) -> None:
    weights, steps = trainer.weights(), _probe(trainer, ProbedRank.optimizer_steps)
    _probe(trainer, ProbedRank.poison_gradients, True)
    with pytest.raises(NonFiniteStep) as raised:
        _step(trainer, [1.0, -1.0])
    _probe(trainer, ProbedRank.poison_gradients, False)
    assert raised.value.reason == "gradients"
    assert _same(trainer.weights(), weights) and _probe(trainer, ProbedRank.optimizer_steps) == steps
    assert _probe(trainer, ProbedRank.gradients_cleared)


def test_non_finite_behaviour_logprobs_are_refused() -> None:
    check_trajectory(_trajectory(0))
    with pytest.raises(ContractError, match="not finite"):
        check_trajectory(_trajectory(0, logprob=float("nan")))


async def test_non_finite_weights_are_never_published() -> None:
    state = {"w": torch.tensor([1.0, float("inf")]), "b": torch.zeros(2)}
    with pytest.raises(WeightsError, match=r"\['w'\].*non-finite"):  # refused before the bus or store is used
        await publish_weights(bus=None, store=None, run_id="r", version=1, step=1, state_dict=state)
