"""Long horizons (agent.context_policy = "summarize"): when the next turn would not fit, the policy
summarises its work and the episode goes on in a new context that begins with the task and that summary.
Real sandbox, real engine (the byte-level preset and a chat model built here): the trajectory records
where each context began, every context fits the engine's window, the summary is the policy's own sampled
tokens, and the trainer, feeding each context as a row of its own, recomputes exactly the logprobs the
rollout sampled with (which it would not, fed the trajectory as one sequence)."""

from __future__ import annotations

import itertools

import pytest
import torch
from calc_task import calc_task
from chat_model import save_chat_model

from crucible.agent import tokenizer as bytes_format
from crucible.agent.episode import SUMMARY_INTRO, SUMMARY_REQUEST, run_episode
from crucible.clients.sandbox import SandboxClient
from crucible.contracts.packing import unpack
from crucible.contracts.runconfig import RunConfig
from crucible.contracts.trajectories import check_trajectory
from crucible.model import PRESETS, Transformer, build_model
from crucible.model.hf import load_pretrained
from services.rollout.engine import PolicyEngine
from services.trainer.batch import collate
from services.trainer.policy import token_logprobs

pytestmark = pytest.mark.integration
AGENT = {"max_turns": 12, "max_action_tokens": 24, "max_observation_bytes": 48, "max_summary_tokens": 24}


def _byte_engine() -> tuple[PolicyEngine, Transformer]:
    config = RunConfig.model_validate({"agent": {**AGENT, "context_policy": "summarize"}})
    engine = PolicyEngine(config=config, max_context=900)
    model = build_model(PRESETS[config.model.source], precision=config.model.precision, seed=config.seed)
    engine.swap({k: v.clone() for k, v in model.state_dict().items()}, 0)
    shift = torch.zeros(engine.model_config.vocab_size)
    shift[
        bytes_format.tool_token("submit")
    ] = -30.0  # so that the random policy works until its context is spent
    _shifted(engine.batcher.model, shift)
    return engine, _shifted(model, shift)


def _chat_engine(tmp_path) -> tuple[PolicyEngine, Transformer]:
    checkpoint = save_chat_model(tmp_path / "hf")
    config = RunConfig.model_validate(
        {
            "model": {"source": str(checkpoint)},
            "agent": {**AGENT, "max_action_tokens": 48, "context_policy": "summarize"},
        }
    )
    engine = PolicyEngine(config=config, max_context=1800)  # its prompt, with the tools, is ~1.1k tokens
    engine.swap(load_pretrained(checkpoint).state_dict(), 0)
    model = Transformer(engine.model_config, precision=config.model.precision)  # the trainer's copy
    model.load_state_dict(engine.batcher.model.state_dict())
    shift = torch.zeros(engine.model_config.vocab_size)
    for token in range(len(engine.tokenizer)):  # string arguments close, and no call is a submit
        text = engine.tokenizer.decode([token])
        shift[token] = -30.0 if "submit" in text else 12.0 if '"' in text else 0.0
    _shifted(engine.batcher.model, shift)
    return engine, _shifted(model, shift)


@pytest.mark.parametrize("agent_format", ["bytes", "chat"])
async def test_an_episode_summarises_and_goes_on_in_a_new_context(
    tmp_path, bus, store, sandbox, agent_format
):
    engine, model = _byte_engine() if agent_format == "bytes" else _chat_engine(tmp_path)
    task = await calc_task(store)
    session = await SandboxClient(bus).create(
        run_id="long-horizon-test", task_id=task.task_id, snapshot=task.snapshot
    )
    try:
        async with session:
            trajectory = await run_episode(
                engine=engine, config=engine.config, task=task, session=session, run_id="r", group_id="g",
                seed=5, replica="test", tool_timeout_s=10,
            )  # fmt: skip
    finally:
        engine.close()
    check_trajectory(trajectory)
    tokens, mask = unpack("u32", trajectory.tokens), unpack("u8", trajectory.loss_mask)
    starts = trajectory.context_starts
    assert len(starts) >= 2 and starts[0] == 0, (starts, trajectory.finish_reason)
    bounds = [*starts, len(tokens)]
    assert all(end - start <= engine.max_context for start, end in itertools.pairwise(bounds))
    decode = bytes_format.decode if engine.tokenizer is None else engine.tokenizer.decode
    end_token = bytes_format.END if engine.tokenizer is None else engine.tokenizer.eos_token_id
    for start, end in itertools.pairwise(bounds[1:]):
        # the closed context ends with the request and the policy's summary; the next begins with it
        last = start - 1 if mask[start - 1] == 0 else start  # the end token of a summary cut at its budget
        first = last
        while mask[first - 1]:
            first -= 1
        assert (last - first >= 1 and tokens[last - 1] == end_token) or last < start
        assert SUMMARY_REQUEST[-30:] in decode(tokens[first - 60 : first])
        summary = decode([t for t in tokens[first:last] if t != end_token])
        assert SUMMARY_INTRO.strip() in decode(tokens[start:end]) and summary.strip()[:8] in decode(
            tokens[start:end]
        )
    for call in trajectory.tool_calls:  # spans are the episode's, each within one context
        assert any(
            start <= call.token_start < call.token_end <= end for start, end in itertools.pairwise(bounds)
        )
        assert all(
            mask[call.token_start : call.token_end - 1]
        )  # (an action cut at its budget ends with an environment token)

    batch = collate([trajectory], [1.0])
    assert batch.rows == len(starts)
    calls = engine.tool_calls
    with torch.no_grad():
        recomputed = token_logprobs(model.eval(), batch, temperature=1.0, tool_calls=calls)[0]
    sampled = batch.mask_BT > 0
    # bf16: the rollout's incremental decode and the trainer's whole-row forward round apart. bf16 keeps 8
    # significant bits, so a logit in [8, 16) (the shifted quote tokens) is held to one ulp, 2^-4: a token
    # may differ by up to that, while the mean over hundreds of tokens stays far below it.
    diff = (recomputed[sampled] - batch.behaviour_logprobs_BT[sampled]).abs()
    assert float(diff.max()) <= 2**-4 and float(diff.mean()) <= 1e-3, (diff.max(), diff.mean())
    # fed as one sequence, the later contexts' tokens would see the earlier ones: other logprobs, or (the
    # chat model's episode being longer than its positions) no logprobs at all
    flat = collate([type(trajectory)(**{**_fields(trajectory), "context_starts": []})], [1.0])
    if len(tokens) > engine.model_config.max_seq_len:
        with pytest.raises(ValueError, match="past the limit"), torch.no_grad():
            token_logprobs(model.eval(), flat, temperature=1.0, tool_calls=calls)
        return
    with torch.no_grad():
        wrong = token_logprobs(model.eval(), flat, temperature=1.0, tool_calls=calls)[0]
    later = sampled.clone()
    later[:, : starts[1]] = False
    assert later.any(), "the policy acts again in its second context"
    error = (recomputed - batch.behaviour_logprobs_BT)[sampled].abs().max()
    wrong_error = (wrong - batch.behaviour_logprobs_BT)[later].abs().max()
    assert wrong_error > 3 * error


def _shifted(model: Transformer, shift: torch.Tensor) -> Transformer:
    """The rollout's and the trainer's copies sample from, and recompute, the same pushed logits: the
    instance's output head adds `shift` (the whole-sequence logits and the scored tokens both use it)."""
    head = model.head
    model.head = lambda h: head(h) + shift.to(h.device)
    return model


def _fields(trajectory) -> dict:
    return {name: getattr(trajectory, name) for name in trajectory.__struct_fields__}
