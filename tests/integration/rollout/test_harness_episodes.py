"""The episode endpoint an agent harness drives, with the official `openai` client, over the replica's
engine and a real sandbox: the context grows token for token (the policy's tool call sampled under the
run's grammar, the harness's tool result rendered by the chat template as environment tokens), and what
would break that record is refused with a 400 while the episode goes on."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from calc_task import calc_task
from chat_model import save_chat_model

from crucible.agent import grammar
from crucible.agent.episode import CHAT_SYSTEM_PROMPT
from crucible.agent.toolcalls import TOOLS, render_prompt
from crucible.clients.sandbox import SandboxClient
from crucible.contracts.runconfig import RunConfig
from crucible.model import ModelOutput
from crucible.model.hf import load_pretrained
from services.rollout.engine import PolicyEngine
from services.rollout.harness import Episodes, HarnessEpisode, episodes_app

pytestmark = pytest.mark.integration


def _engine(checkpoint, tokenizer) -> PolicyEngine:
    """The replica's engine on the checkpoint's weights, its logits pushed towards tokens with a quote and
    away from whitespace (which JSON allows between any two tokens), so that the random model's string
    arguments close within the budget (and its calls are real calls)."""
    config = RunConfig.model_validate(
        {
            "model": {"source": str(checkpoint)},
            "agent": {"driver": "harness", "max_turns": 2, "max_action_tokens": 64},
        }
    )
    engine = PolicyEngine(config=config, max_context=2048)
    engine.swap(load_pretrained(checkpoint).state_dict(), 0)
    shift = torch.zeros(engine.model_config.vocab_size)
    for token in range(len(tokenizer)):
        text = tokenizer.decode([token])
        if '"' in text:
            shift[token] = 12.0
        elif text and text.isspace():
            shift[token] = -12.0
    engine.batcher.model.register_forward_hook(
        lambda m, a, out: ModelOutput(logits=out.logits + shift, routes=out.routes)
    )
    return engine


async def test_a_harness_turn_is_recorded_token_for_token_and_bad_requests_are_refused(
    tmp_path, bus, store, sandbox
):
    checkpoint = save_chat_model(tmp_path / "hf")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    engine = _engine(checkpoint, tokenizer)
    task = await calc_task(store)
    session = await SandboxClient(bus).create(
        run_id="harness-test", task_id=task.task_id, snapshot=task.snapshot
    )
    episodes = Episodes()
    episode = HarnessEpisode(
        engine=engine, config=engine.config, task=task, session=session, seed=3, tool_timeout_s=10
    )
    episodes.live[episode.id] = episode
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=episodes_app(episodes)), base_url="http://rollout"
    )
    client = openai.AsyncOpenAI(
        base_url=f"http://rollout/episodes/{episode.id}/v1",
        api_key=episode.id,
        http_client=http,
        max_retries=0,
    )
    try:
        assert (await http.get("/episodes/not-an-episode/task")).status_code == 404
        described = (await http.get(f"/episodes/{episode.id}/task")).json()
        assert described["statement"] == "Fix add()." and described["tools"] == TOOLS
        messages = [
            {"role": "system", "content": described["system_prompt"]},
            {"role": "user", "content": "Fix add()."},
        ]
        with pytest.raises(openai.BadRequestError, match="the run's"):
            await client.chat.completions.create(model="m", messages=messages, tools=TOOLS[:2])
        first = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, tool_choice="required", logprobs=True
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        prompt, action = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
        assert prompt == render_prompt(tokenizer, messages) and assert_sampled(episode, len(prompt), action)
        assert described["system_prompt"] == CHAT_SYSTEM_PROMPT
        assert [e.logprob for e in choice.logprobs.content] == episode.state.logprobs[len(prompt) :]
        # the policy's call must run first, and only as the policy made it
        with pytest.raises(openai.BadRequestError, match="first"):
            await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        forged = await http.post(f"/episodes/{episode.id}/tools/run", json={"command": "rm -rf /workspace"})
        assert forged.status_code == 400
        ran = await http.post(
            f"/episodes/{episode.id}/tools/{call.function.name}", json=json.loads(call.function.arguments)
        )
        assert ran.status_code == 200 and set(ran.json()) == {"ok", "output", "error"}
        assert call.function.name != "submit"  # (seeded) so that the conversation goes on
        history = [*messages, choice.message.model_dump(exclude_none=True)]
        result = {"role": "tool", "tool_call_id": call.id, "content": ran.json()["output"] or "(empty)"}
        rewritten = [{"role": "system", "content": "another prompt"}, *history[1:], result]
        with pytest.raises(openai.BadRequestError, match="verbatim"):
            await client.chat.completions.create(model="m", messages=rewritten, tools=TOOLS)
        second = await client.chat.completions.create(model="m", messages=[*history, result], tools=TOOLS)
        context = second.choices[0].model_extra["prompt_token_ids"]
        assert context[: len(prompt) + len(action)] == prompt + action  # the context only grows
        tail = context[len(prompt) + len(action) :]
        assert tokenizer.decode(tail).startswith("<tool>") and episode.state.loss_mask[
            len(prompt) + len(action) : len(context)
        ] == [0] * len(tail)
        (record,) = episode.calls
        assert (record.name, record.token_start, record.token_end) == (
            call.function.name,
            len(prompt),
            len(prompt) + len(action),
        )
        for c in second.choices[0].message.tool_calls or []:
            await http.post(
                f"/episodes/{episode.id}/tools/{c.function.name}", json=json.loads(c.function.arguments)
            )
        with pytest.raises(openai.BadRequestError, match="turns"):  # max_turns = 2
            await client.chat.completions.create(model="m", messages=[*history, result], tools=TOOLS)
    finally:
        await http.aclose()
        engine.release(episode.state)
        engine.close()
        await session.destroy()


def assert_sampled(episode: HarnessEpisode, start: int, action: list[int]) -> bool:
    """The action's tokens are the policy's: sampled under the grammar, logprobs and versions recorded."""
    state = episode.state
    span = slice(start, start + len(action))
    assert state.tokens[span] == action and state.loss_mask[span] == [1] * len(action)
    assert state.constraints[span] == [grammar.TOOL_CALL] * len(action) and state.versions[span] == [0] * len(
        action
    )
    assert all(lp <= 0 for lp in state.logprobs[span]) and not any(state.loss_mask[:start])
    return True
