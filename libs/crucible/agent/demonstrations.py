"""Demonstrations for supervised warm start: known solutions (crucible.agent.solutions) played through
the agent loop.

A demonstration is an episode of the `Teacher`, an actor that plays fixed actions instead of sampling
them, in the same loop, token format and sandbox as the policy's episodes (crucible.agent.episode):
its tokens are marked as the policy's (loss mask 1) and everything else is the environment's, so a
supervised step trains exactly the tokens the policy would have to produce. Every action must fit the
run's agent budget (its tools, turns, action tokens and, for a pretrained model, the tool-call grammar);
one that does not raises DemonstrationError and the demonstration is left out.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from crucible.agent import grammar, tokenizer
from crucible.agent.episode import EpisodeState
from crucible.agent.solutions import SUBMIT, Action, DemonstrationError
from crucible.agent.toolcalls import CLOSE, OPEN, ToolCallGrammar
from crucible.contracts.runconfig import AgentSection


class Teacher:
    """An actor that plays `actions` (then submit) as the policy's tokens, with logprob 0 and version 0."""

    version = 0

    def __init__(
        self,
        actions: list[Action],
        *,
        agent: AgentSection,
        max_context: int,
        tokenizer: Any = None,
        tool_calls: ToolCallGrammar | None = None,
    ) -> None:
        if len(actions) > agent.max_turns:
            raise DemonstrationError(
                f"over the turn budget: {len(actions)} actions, agent.max_turns = {agent.max_turns}"
            )
        self.actions = list(actions)
        self.agent = agent
        self.max_context = max_context
        self.tokenizer = tokenizer
        self.tool_calls = tool_calls

    def new_episode(self, *, greedy: bool = False) -> EpisodeState:
        return EpisodeState()

    def _next(self) -> Action:
        action = self.actions.pop(0) if self.actions else SUBMIT
        if action.name not in self.agent.tools:
            raise DemonstrationError(f"calls {action.name}, which is not in agent.tools {self.agent.tools}")
        return action

    async def sample_action(
        self, state: EpisodeState, *, generator: torch.Generator
    ) -> tuple[str | None, str, bool]:
        action = self._next()
        text = action.text()
        body = [] if action.name in tokenizer.NO_ARGUMENT_TOOLS else [*tokenizer.encode(text), tokenizer.END]
        if 1 + len(body) > self.agent.max_action_tokens:
            raise DemonstrationError(
                f"over the action budget: {action.name} takes {1 + len(body)} tokens, "
                f"agent.max_action_tokens = {self.agent.max_action_tokens}"
            )
        if len(state) + 1 + len(body) + 2 >= self.max_context:
            return action.name, text, True
        state.append_sampled(tokenizer.tool_token(action.name), 0.0, self.version, grammar.TOOL)
        for token in body:
            state.append_sampled(token, 0.0, self.version, grammar.ARGS)
        if not body:
            state.append_env([tokenizer.END], self.version, part="actions")
        return action.name, text, False

    async def sample_tool_call(
        self, state: EpisodeState, *, generator: torch.Generator
    ) -> tuple[str | None, dict | None, bool]:
        assert self.tokenizer is not None and self.tool_calls is not None
        action = self._next()
        call = OPEN + json.dumps({"name": action.name, "arguments": action.arguments}) + CLOSE
        tokens = [*self.tokenizer.encode(call, add_special_tokens=False), self.tokenizer.eos_token_id]
        if len(tokens) > self.agent.max_action_tokens:
            raise DemonstrationError(
                f"over the action budget: {action.name} takes {len(tokens)} tokens, "
                f"agent.max_action_tokens = {self.agent.max_action_tokens}"
            )
        matcher = self.tool_calls.matcher()
        for token in tokens:  # the policy could have sampled exactly these under its grammar
            if not self.tool_calls.allowed(matcher)[token]:
                raise DemonstrationError(f"refused by the tool-call grammar: {call[:80]!r}")
            if matcher.is_stopped():
                break  # the call is complete; what the grammar allowed was its end of turn
            self.tool_calls.advance(matcher, token)
        if len(state) + len(tokens) + 2 >= self.max_context:
            return action.name, action.arguments, True
        for token in tokens:
            state.append_sampled(token, 0.0, self.version, grammar.TOOL_CALL)
        return action.name, action.arguments, False

    async def sample_summary(self, state: EpisodeState, *, generator: torch.Generator) -> str:
        raise DemonstrationError("over the context: a demonstration must fit one context, with no summary")

    async def finish(self, state: EpisodeState) -> None:
        pass

    def release(self, state: EpisodeState) -> None:
        pass
