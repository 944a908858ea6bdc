"""The trainer must recompute the distribution the rollout sampled from: same constraints, same
temperature, same routes. If it did not, every importance ratio would be off before any update. The
rollout decodes incrementally and the trainer runs the whole sequence, so bf16 rounding may differ by
an ulp: log-probabilities agree to bf16 precision, not bit for bit."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from crucible.agent import grammar, tokenizer
from crucible.contracts.messages import GradedTrajectory, Reward, Trajectory
from crucible.contracts.packing import pack
from crucible.contracts.runconfig import RunConfig
from crucible.model import PRESETS, build_model
from crucible.model.lora import merge
from crucible.model.spec import PolicySpec
from services.rollout.engine import PolicyEngine
from services.trainer.batch import collate
from services.trainer.group import PolicyGroup
from services.trainer.policy import token_logprobs


def sample_group(engine: PolicyEngine, *, n: int, version: int) -> list[GradedTrajectory]:
    return asyncio.run(_sample_group(engine, n=n, version=version))


async def _sample_group(engine: PolicyEngine, *, n: int, version: int) -> list[GradedTrajectory]:
    graded = []
    for i in range(n):
        state = engine.new_episode()
        state.append_env([tokenizer.BOS, *tokenizer.encode(f"task {i}"), tokenizer.ACT], version)
        await engine.sample_action(state, generator=torch.Generator().manual_seed(i))
        state.append_env([tokenizer.ACT], version)
        await engine.sample_action(state, generator=torch.Generator().manual_seed(100 + i))
        state.append_env([tokenizer.EOS], version)
        await engine.finish(state)
        engine.release(state)
        L, k = len(state.routes[0]), len(state.routes[0][0])
        trajectory = Trajectory(
            run_id="r",
            trajectory_id=f"t{i}",
            group_id="g",
            task_id="task",
            taskset="s",
            tokens=pack("u32", state.tokens),
            logprobs=pack("f32", state.logprobs),
            versions=pack("u32", state.versions),
            loss_mask=pack("u8", state.loss_mask),
            constraints=pack("u8", state.constraints),
            routes=pack("u8", (e for layer in state.routes for ks in layer for e in ks)),
            routes_shape=[len(state.routes), L, k],
        )
        graded.append(
            GradedTrajectory(
                trajectory=trajectory,
                reward=Reward(total=float(i), tests_passed=0, tests_total=1),
                graded_at=0.0,
            )
        )
    return graded


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_equal_behaviour_logprobs_on_policy(temperature):
    config = RunConfig.model_validate({"agent": {"temperature": temperature, "max_action_tokens": 12}})
    engine = PolicyEngine(config=config, max_context=512)
    model = build_model(PRESETS[config.model.source], precision=config.model.precision, seed=config.seed)
    engine.swap({k: v.clone() for k, v in model.state_dict().items()}, 0)
    graded = sample_group(engine, n=3, version=0)
    batch = collate([g.trajectory for g in graded], [1.0, 0.0, -1.0])
    assert int(batch.mask_BT.sum()) > 6
    with torch.no_grad():
        recomputed = token_logprobs(model.eval(), batch, temperature=temperature)[0]
    sampled = batch.mask_BT > 0
    assert torch.allclose(recomputed[sampled], batch.behaviour_logprobs_BT[sampled], atol=5e-3)
    # every sampled token obeyed its constraint
    allowed = grammar.allowed_table()
    tokens, constraints = batch.tokens_BT[sampled], batch.constraints_BT[sampled]
    assert allowed[constraints, tokens].all()


def test_a_run_s_tools_bound_what_is_sampled_and_what_the_trainer_recomputes():
    """With agent.tools a subset, only those tool tokens are drawn, and the trainer renormalises over the
    same subset: over all six tools its logprobs would be lower than the behaviour's."""
    tools = ["read_file", "replace", "submit"]
    config = RunConfig.model_validate({"agent": {"max_action_tokens": 6, "tools": tools}})
    engine = PolicyEngine(config=config, max_context=512)
    model = build_model(PRESETS[config.model.source], precision=config.model.precision, seed=config.seed)
    engine.swap({k: v.clone() for k, v in model.state_dict().items()}, 0)
    batch = collate([g.trajectory for g in sample_group(engine, n=8, version=0)], [0.0] * 8)
    picked = batch.tokens_BT[(batch.mask_BT > 0) & (batch.constraints_BT == grammar.TOOL)]
    assert len(picked) == 16 and {tokenizer.tool_name(int(t)) for t in picked} <= set(tools)
    at = (batch.mask_BT > 0) & (batch.constraints_BT == grammar.TOOL)
    with torch.no_grad():
        same = token_logprobs(model.eval(), batch, temperature=1.0, tools=config.agent.tools)[0]
        every = token_logprobs(model.eval(), batch, temperature=1.0)[0]
    sampled = batch.mask_BT > 0
    assert torch.allclose(same[sampled], batch.behaviour_logprobs_BT[sampled], atol=5e-3)
    assert (every[at] < batch.behaviour_logprobs_BT[at] - 1e-3).all()


def test_a_step_moves_the_policy_towards_the_advantaged_trajectory():
    """One step of the trainer's worker group (one rank) on what the rollout sampled."""
    config = RunConfig.model_validate({"agent": {"max_action_tokens": 8}, "optim": {"learning_rate": 1e-2}})
    engine = PolicyEngine(config=config, max_context=512)
    model = build_model(dataclasses.replace(PRESETS["tiny"]), precision="bf16", seed=0)
    policy = PolicyGroup(config, timeout_s=120)
    try:
        model.load_state_dict(policy.weights())  # the run's version 0
        engine.swap({k: v.clone() for k, v in model.state_dict().items()}, 0)
        graded = sample_group(engine, n=2, version=0)
        batch = collate([g.trajectory for g in graded], [1.0, -1.0])
        with torch.no_grad():
            before = (token_logprobs(model, batch, temperature=1.0)[0] * batch.mask_BT).sum(dim=1)
        metrics = policy.train([g.trajectory for g in graded], [1.0, -1.0])
        model.load_state_dict(policy.weights())
    finally:
        policy.close()
    with torch.no_grad():
        after = (token_logprobs(model, batch, temperature=1.0)[0] * batch.mask_BT).sum(dim=1)
    assert metrics["tokens"] == float(batch.mask_BT.sum())
    assert after[0] > before[0] and after[1] < before[1]


def test_a_lora_run_trains_only_its_adapters_and_rollouts_sample_what_the_trainer_recomputes():
    """model.lora: the worker group trains the adapters alone (the base keeps every bit), and a rollout
    engine that loads the trained version samples with the logprobs the trainer recomputes."""
    config = RunConfig.model_validate(
        {
            "model": {"lora": {"rank": 4, "alpha": 8}},
            "agent": {"max_action_tokens": 8},
            "optim": {"learning_rate": 5e-2},
        }
    )
    engine = PolicyEngine(config=config, max_context=512)
    policy = PolicyGroup(config, timeout_s=120)
    try:
        start = {k: v.clone() for k, v in policy.weights().items()}  # on CPU they are the live parameters
        engine.swap({k: v.clone() for k, v in start.items()}, 0)
        graded = sample_group(engine, n=2, version=0)
        policy.train([g.trajectory for g in graded], [1.0, -1.0])
        trained = policy.weights()
    finally:
        policy.close()
    changed = {k for k, v in trained.items() if not torch.equal(v, start[k])}
    assert changed and all(".lora." in k for k in changed), sorted(changed)[:4]
    engine.swap({k: v.clone() for k, v in trained.items()}, 1)
    batch = collate([g.trajectory for g in sample_group(engine, n=3, version=1)], [0.0] * 3)
    model = PolicySpec.resolve(config).empty_model()
    model.load_state_dict(trained)
    with torch.no_grad():
        recomputed = token_logprobs(model.eval(), batch, temperature=1.0)[0]
        without = build_model(PRESETS["tiny"], precision="bf16", seed=0)
        without.load_state_dict(merge({k: v for k, v in trained.items() if ".lora." not in k}, without.cfg))
        base = token_logprobs(without.eval(), batch, temperature=1.0)[0]
    sampled = batch.mask_BT > 0
    assert torch.allclose(recomputed[sampled], batch.behaviour_logprobs_BT[sampled], atol=5e-3)
    assert (base[sampled] - batch.behaviour_logprobs_BT[sampled]).abs().max() > 5e-2  # the adapters count
