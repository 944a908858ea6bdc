"""Episodes driven by an agent harness (`agent.driver = "harness"`): the rollout starts the harness
program (its `harness_command`) for each episode and serves it, on the replica's episodes endpoint,

    GET  /episodes/ID/task                 the statement, the system prompt, the tools, max_turns
    POST /episodes/ID/v1/chat/completions  one action of the policy (OpenAI chat completions)
    POST /episodes/ID/tools/NAME           runs that action in the episode's sandbox

The episode id is a random capability: it names one live episode and nothing else. Every completion
request must extend the conversation of the one before (the harness keeps its history verbatim); the
rollout renders only what is new (the tool results, a user turn) with the model's chat template and
appends it to the episode's context as environment tokens, then samples the policy's tool call under
the run's grammar on the replica's engine, exactly as its own agent loop does. So the trajectory is the
context token for token, the policy's tokens with their logprobs and versions, the environment's masked,
and it goes to grading like any other. Sampling follows the run's config (`agent.temperature`,
`agent.max_action_tokens`); a request's own sampling fields are ignored.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from crucible.agent.episode import (
    CHAT_SYSTEM_PROMPT,
    chat_prompt,
    clip,
    episode_trajectory,
    run_chat_tool,
    turn_fits,
)
from crucible.agent.toolcalls import ToolCallError, after_turn, agent_tools, render_prompt
from crucible.clients.sandbox import SandboxSession
from crucible.contracts.messages import TaskSpec, ToolCall, Trajectory
from crucible.contracts.runconfig import RunConfig
from crucible.serving.app import chat_logprobs, openai_errors, template_message, tool_call
from crucible.serving.engine import RequestError, Sampled
from crucible.serving.protocol import ChatCompletionRequest, Message
from services.rollout.engine import PolicyEngine

OUTPUT_TAIL = 2000  # characters of a failed harness's stderr kept for the log


@dataclass
class _Action:
    name: str
    arguments: dict
    start: int
    end: int
    version: int


class HarnessEpisode:
    """One episode's context as the harness drives it."""

    def __init__(
        self, *, engine: PolicyEngine, config: RunConfig, task: TaskSpec, session: SandboxSession, seed: int,
        tool_timeout_s: float,
    ) -> None:  # fmt: skip
        if engine.tool_calls is None:
            raise ValueError("an agent harness needs a model with its own chat template and tool calls")
        self.id = secrets.token_hex(16)
        self.engine, self.config, self.task, self.session = engine, config, task, session
        self.tool_timeout_s = tool_timeout_s
        self.tools = agent_tools(config.agent.tools)
        self.state = engine.new_episode()
        self.generator = torch.Generator().manual_seed(seed)
        self.history: list[dict[str, str]] = []  # the conversation so far, in the template's terms
        self.actions = 0
        self.pending: _Action | None = None  # the policy's last call, not yet run
        self.calls: list[ToolCall] = []
        self.finish = "harness_exit"  # until the episode says otherwise
        self.over = False
        self.lock = asyncio.Lock()  # one request at a time: the context grows in order

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.config.model.source,
            "statement": self.task.statement,
            "system_prompt": CHAT_SYSTEM_PROMPT,
            "tools": self.tools,
            "max_turns": self.config.agent.max_turns,
        }

    async def complete(self, body: ChatCompletionRequest) -> dict[str, Any]:
        async with self.lock:
            self._check(body)
            tokenizer = self.engine.tokenizer
            assert tokenizer is not None  # a model with tool calls (checked on creation) has its own
            messages = [template_message(i, m) for i, m in enumerate(body.messages)]
            try:
                new = (
                    render_prompt(tokenizer, messages, tools=self.tools)
                    if not self.history
                    else after_turn(tokenizer, self.history, messages, tools=self.tools)
                )
            except ToolCallError as exc:
                raise RequestError(
                    f"{exc}: an episode's requests keep its conversation verbatim", param="messages"
                ) from None
            if not turn_fits(self.engine, self.config, self.state, new):
                self.finish, self.over = "context", True
                raise RequestError(
                    f"the episode's context of {self.engine.max_context} tokens is spent", param="messages"
                )
            if self.history:
                self.state.append_env(new, self.engine.version)
            else:  # the prompt's part that a blank task shares is the system prompt and tools
                blank = render_prompt(tokenizer, chat_prompt(""), tools=self.tools)
                self.state.append_prompt(new, blank, self.engine.version)
            start = len(self.state)
            name, arguments, exhausted = await self.engine.sample_tool_call(
                self.state, generator=self.generator
            )
            self.actions += 1
            tokens = self.state.tokens[start:]
            reply: dict[str, Any] = {"role": "assistant", "content": None}
            if exhausted:
                self.finish, self.over = "context", True
            if name is None:  # the call did not close (budget or context): its text, and the turn is lost
                reply["content"] = tokenizer.decode(tokens, skip_special_tokens=True)
                finish = "length"
            else:
                assert arguments is not None  # a call that closed was parsed whole
                reply["tool_calls"] = [tool_call(name, arguments)]
                self.pending = _Action(name, arguments, start, len(self.state), self.state.versions[-1])
                finish = "tool_calls"
            self.history = [*messages, template_message(len(messages), Message.model_validate(reply))]
            return {
                "id": f"chatcmpl-{self.id}-{self.actions}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.config.model.source,
                "choices": [
                    {
                        "index": 0,
                        "message": reply,
                        "logprobs": self._logprobs(start) if body.logprobs else None,
                        "finish_reason": finish,
                        "prompt_token_ids": self.state.tokens[:start],
                        "token_ids": tokens,
                        "policy_versions": self.state.versions[start:],
                    }
                ],
                "usage": {
                    "prompt_tokens": start,
                    "completion_tokens": len(tokens),
                    "total_tokens": len(self.state),
                },
            }

    def _logprobs(self, start: int) -> dict[str, list]:
        """The action's tokens with the logprobs recorded for training (no alternatives: the rollout
        keeps none)."""
        state = self.state
        sampled = [
            Sampled(t, lp, [], v)
            for t, lp, v in zip(
                state.tokens[start:], state.logprobs[start:], state.versions[start:], strict=True
            )
        ]
        return chat_logprobs(self.engine.tokenizer, sampled)

    def _check(self, body: ChatCompletionRequest) -> None:
        if self.over:
            raise RequestError(f"the episode is over ({self.finish})")
        if body.stream or body.n != 1:
            raise RequestError("an episode's completions are one choice, not streamed", param="stream")
        names = self.config.agent.tools
        if sorted(t.function.name for t in body.tools or []) != sorted(names):
            raise RequestError(f"an episode's tools are the run's: {', '.join(sorted(names))}", param="tools")
        if self.pending is not None:
            raise RequestError(
                f"run the policy's {self.pending.name} call first (POST .../tools/{self.pending.name})"
            )
        if self.actions >= self.config.agent.max_turns:
            self.finish, self.over = "max_turns", True
            raise RequestError(f"the episode's {self.config.agent.max_turns} turns are spent")

    async def run_tool(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Run the policy's last call (and only that) in the episode's sandbox."""
        async with self.lock:
            action = self.pending
            if action is None or action.name != name or action.arguments != arguments:
                raise RequestError(
                    "the tool endpoint runs the policy's last call, as the policy made it", param="name"
                )
            self.pending = None
            args_text = json.dumps(arguments)
            if name == "submit":
                self.finish, self.over = "submitted", True
                self._record(action, args_text, True, "", 0.0)
                return {"ok": True, "output": "", "error": None}
            t0 = time.perf_counter()
            result, text = await run_chat_tool(
                self.session, name, arguments, config=self.config, timeout_s=self.tool_timeout_s
            )
            self._record(action, args_text, result.ok, text, time.perf_counter() - t0)
            output = clip(result.output, self.config.agent.max_observation_bytes)
            return {"ok": result.ok, "output": output, "error": result.error}

    def _record(self, action: _Action, args_text: str, ok: bool, output: str, duration: float) -> None:
        self.calls.append(
            ToolCall(
                index=len(self.calls),
                name=action.name,
                arguments=args_text,
                ok=ok,
                output=output,
                duration_s=duration,
                token_start=action.start,
                token_end=action.end,
                policy_version=action.version,
            )
        )


@dataclass
class Episodes:
    """The replica's live harness episodes, by id, and where the harnesses reach them."""

    live: dict[str, HarnessEpisode] = field(default_factory=dict)
    url: str = ""


def episodes_app(episodes: Episodes) -> FastAPI:
    app = FastAPI(title="Crucible rollout episodes", docs_url=None, redoc_url=None, openapi_url=None)
    openai_errors(app)

    def missing() -> JSONResponse:
        return JSONResponse(
            status_code=404, content={"error": {"message": "no such live episode", "type": "not_found"}}
        )

    @app.get("/episodes/{episode_id}/task")
    async def task(episode_id: str):
        episode = episodes.live.get(episode_id)
        return missing() if episode is None else episode.describe()

    @app.get("/episodes/{episode_id}/v1/models")
    async def models(episode_id: str):
        episode = episodes.live.get(episode_id)
        if episode is None:
            return missing()
        return {
            "object": "list",
            "data": [{"id": episode.config.model.source, "object": "model", "owned_by": "crucible"}],
        }

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat(episode_id: str, body: ChatCompletionRequest):
        episode = episodes.live.get(episode_id)
        return missing() if episode is None else await episode.complete(body)

    @app.post("/episodes/{episode_id}/tools/{name}")
    async def run_tool(episode_id: str, name: str, arguments: dict[str, Any]):
        episode = episodes.live.get(episode_id)
        return missing() if episode is None else await episode.run_tool(name, arguments)

    return app


async def run_harness_episode(
    *,
    episodes: Episodes,
    command: list[str],
    timeout_s: float,
    engine: PolicyEngine,
    config: RunConfig,
    task: TaskSpec,
    session: SandboxSession,
    run_id: str,
    group_id: str,
    seed: int,
    replica: str,
    tool_timeout_s: float,
) -> Trajectory:
    """Start the harness on one episode, wait for it to end, and make the trajectory of its context."""
    started = time.time()
    episode = HarnessEpisode(
        engine=engine, config=config, task=task, session=session, seed=seed, tool_timeout_s=tool_timeout_s
    )
    episodes.live[episode.id] = episode
    base = f"{episodes.url}/episodes/{episode.id}"
    env = {
        **os.environ,
        "OPENAI_BASE_URL": f"{base}/v1",
        "OPENAI_API_KEY": episode.id,
        "CRUCIBLE_EPISODE_URL": base,
    }
    try:
        process = await asyncio.create_subprocess_exec(
            *(command or [sys.executable, "-m", "crucible.agent.harness"]),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, err = await asyncio.wait_for(process.communicate(), timeout=timeout_s)
        except TimeoutError:
            process.kill()
            _, err = await process.communicate()
            episode.finish = "timeout"
        async with episode.lock:
            episode.over = True
        if not len(episode.state):
            tail = err.decode("utf-8", "replace")[-OUTPUT_TAIL:]
            raise RuntimeError(f"the harness (exit {process.returncode}) asked for no action: {tail}")
        await engine.finish(episode.state)
    finally:
        episodes.live.pop(episode.id, None)
        engine.release(episode.state)
    return episode_trajectory(
        tokenizer=engine.tokenizer,
        states=[episode.state],
        task=task,
        run_id=run_id,
        group_id=group_id,
        calls=episode.calls,
        finish=episode.finish,
        diff=await session.diff(),
        replica=replica,
        started=started,
    )  # a trajectory id of its own: the episode's was a credential while it lived
