"""A tool that takes no argument (submit) ends its action with an environment `<end>` right after the
tool token: the policy samples no argument bytes the episode would ignore, so none of them is trained on.
The model's logits are biased towards one tool so that the tool is really sampled (not vacuously)."""

from __future__ import annotations

import asyncio

import torch

from crucible.agent import grammar, tokenizer
from crucible.agent.episode import EpisodeState
from crucible.contracts.messages import GradedTrajectory, Reward, Trajectory
from crucible.contracts.packing import pack
from crucible.contracts.runconfig import RunConfig
from crucible.model import PRESETS, ModelOutput, build_model
from services.rollout.engine import PolicyEngine
from services.trainer.batch import collate
from services.trainer.policy import token_logprobs

SUBMIT = tokenizer.tool_token("submit")


def _engine(*, bias: dict[int, float]) -> tuple[PolicyEngine, torch.nn.Module]:
    """An engine whose policy's logits get `bias` added, and the unbiased model with the same weights."""
    config = RunConfig.model_validate({"agent": {"max_action_tokens": 12}})
    engine = PolicyEngine(config=config, max_context=512)
    model = build_model(PRESETS[config.model.source], precision=config.model.precision, seed=config.seed)
    engine.swap({k: v.clone() for k, v in model.state_dict().items()}, 0)
    shift = torch.zeros(tokenizer.VOCAB_SIZE)
    for token, amount in bias.items():
        shift[token] = amount
    engine.batcher.model.register_forward_hook(
        lambda module, args, out: ModelOutput(logits=out.logits + shift, routes=out.routes)
    )
    return engine, model


def _actions(
    engine: PolicyEngine, *, seed: int, turns: int = 3
) -> tuple[EpisodeState, list[tuple[int, str | None, str]]]:
    return asyncio.run(_episode(engine, seed=seed, turns=turns))


async def _episode(
    engine: PolicyEngine, *, seed: int, turns: int
) -> tuple[EpisodeState, list[tuple[int, str | None, str]]]:
    """An episode of a few actions; for each, where it starts (its tool token), the tool and its arguments."""
    generator = torch.Generator().manual_seed(seed)
    state = engine.new_episode()
    state.append_env([tokenizer.BOS, *tokenizer.encode("task: fix the bug")], 0)
    actions = []
    for _ in range(turns):
        state.append_env([tokenizer.ACT], 0)
        start = len(state)
        name, args, exhausted = await engine.sample_action(state, generator=generator)
        assert not exhausted
        actions.append((start, name, args))
        if name == "submit":
            break
        state.append_env([tokenizer.OBS, *tokenizer.encode("ok")], 0)
    state.append_env([tokenizer.EOS], 0)
    await engine.finish(state)
    engine.release(state)
    return state, actions


def _assert_submit_span(state: EpisodeState, start: int) -> None:
    """Exactly `<tool:submit>` (sampled) + `<end>` (environment), and nothing sampled after the tool."""
    assert state.tokens[start : start + 2] == [SUBMIT, tokenizer.END]
    assert state.loss_mask[start : start + 2] == [1, 0]
    assert state.constraints[start : start + 2] == [grammar.TOOL, grammar.FREE]
    assert state.logprobs[start + 1] == 0.0
    assert not any(state.loss_mask[start + 1 :]), "a token after <tool:submit> would get gradient"
    assert state.tokens[start + 2 :] == [tokenizer.EOS]  # the episode ends after submit


def test_submit_is_closed_by_an_environment_end_without_sampling():
    engine, _ = _engine(bias={SUBMIT: 30.0})
    for seed in range(5):
        state, actions = _actions(engine, seed=seed)
        assert [name for _, name, _ in actions] == ["submit"], "the bias must make the policy sample submit"
        start, _, args = actions[0]
        _assert_submit_span(state, start)
        assert args == ""
        assert sum(state.loss_mask) == 1  # the tool token is the only token the policy sampled


def test_whenever_submit_is_sampled_no_later_token_of_its_action_is_trained():
    # a milder bias: some actions submit, others call a tool with arguments
    engine, _ = _engine(bias={SUBMIT: 1.5})
    tools = []
    for seed in range(12):
        state, actions = _actions(engine, seed=seed)
        for start, name, args in actions:
            tools.append(name)
            if name == "submit":
                _assert_submit_span(state, start)
                assert args == ""
            else:  # a tool with arguments still samples them, under the argument constraint
                assert state.loss_mask[start : start + 2] == [1, 1]
                assert state.constraints[start + 1] == grammar.ARGS
    assert "submit" in tools and any(t != "submit" for t in tools), tools


def test_no_argument_tools_are_declared():
    assert tokenizer.NO_ARGUMENT_TOOLS == {"submit"}
    assert tokenizer.NO_ARGUMENT_TOOLS <= set(tokenizer.TOOLS)


def test_the_trainers_loss_has_no_gradient_at_the_positions_after_submit():
    engine, model = _engine(bias={SUBMIT: 30.0})
    state, [(start, name, _)] = _actions(engine, seed=0)
    assert name == "submit"
    L, k = len(state.routes[0]), len(state.routes[0][0])
    trajectory = Trajectory(
        run_id="r",
        trajectory_id="t",
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
    reward = Reward(total=1.0, tests_passed=1, tests_total=1)
    graded = GradedTrajectory(trajectory=trajectory, reward=reward, graded_at=0.0)
    batch = collate([graded.trajectory], [1.0])

    hidden = []

    def keep_hidden(module, args, out) -> None:
        out.retain_grad()
        hidden.append(out)

    model.norm.register_forward_hook(keep_hidden)  # the final hidden states: the output head's input
    model.train()
    logprobs, _ = token_logprobs(model, batch, temperature=1.0)
    loss = -(batch.advantages_BT * logprobs * batch.mask_BT).sum()
    loss.backward()
    grad_TV = hidden[0].grad[0]
    # the hidden state at position p predicts token p + 1: the tool token (sampled) is predicted at
    # start - 1, the environment <end> after it at `start`, and nothing after it is sampled either
    assert grad_TV[start - 1].abs().sum() > 0
    assert grad_TV[start:].abs().sum() == 0
