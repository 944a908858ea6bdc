"""The inference engine: the policy model, its version, and the agent's constrained sampling, on one
continuous batcher (crucible.model.batcher) shared by every episode of the replica's run.

An action is one request to the batcher: its `choose` callback applies the action's constraint (the
byte-level table, or the tool-call grammar) to each position's logits, samples, records the token with
the logprob of the distribution it was drawn from and the version that made it, and says when the action
is complete. Episodes decode together; a group's episodes prefill their shared prompt once.

Weights are swapped between decode steps: `swap` loads a new state dict into a fresh model and hands it
to the batcher, whose next step uses it. An episode that spans a swap keeps its KV cache (computed by the
old weights), as asynchronous RL systems do; the per-token versions let the trainer see and bound exactly
that staleness.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from crucible.agent import grammar, tokenizer
from crucible.agent.episode import EpisodeState
from crucible.agent.toolcalls import ToolCallGrammar
from crucible.contracts.runconfig import RunConfig
from crucible.model import Transformer, build_model
from crucible.model.batcher import ContinuousBatcher
from crucible.model.spec import PolicySpec


class PolicyEngine:
    """The run's model at its newest version and the agent's token format: the byte-level `<act>` format
    of Crucible's presets, or a pretrained model's own tokenizer, chat template and tool calls."""

    def __init__(
        self, *, config: RunConfig, max_context: int, max_sequences: int = 64, prefill_chunk: int = 256
    ) -> None:
        self.config = config
        self.policy = PolicySpec.resolve(config, max_context=max_context)
        self.model_config = self.policy.architecture
        if self.policy.byte_level and self.model_config.vocab_size != tokenizer.VOCAB_SIZE:
            raise ValueError(f"preset {config.model.source!r} has vocab {self.model_config.vocab_size}")
        self.tokenizer = self.policy.tokenizer
        self.tool_calls: ToolCallGrammar | None = self.policy.tool_calls
        self.max_context = self.policy.max_context
        self.batcher = ContinuousBatcher(
            max_context=self.max_context, max_slots=max_sequences, prefill_chunk=prefill_chunk
        )
        self._swap_lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.batcher.version

    def close(self) -> None:
        self.batcher.close()

    async def aclose(self) -> None:
        self.close()

    def _build(self) -> Transformer:
        """A model for the swap's weights to fill (with the run's adapters, if it has any)."""
        if self.policy.byte_level:
            model = build_model(self.model_config, precision=self.policy.precision, seed=self.config.seed)
            model = self.policy.adapt(model)
        else:  # the weights come with the swap
            model = self.policy.empty_model()
        model.eval()
        model.requires_grad_(False)
        return model

    def swap(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load into a fresh model: a decode step may still be running on the current one."""
        with self._swap_lock:
            if version <= self.version:
                return
            model = self._build()
            model.load_state_dict(state_dict, strict=True)
            self.batcher.swap(model, version)

    async def load(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """`swap`, off the event loop (the rollout worker's way in, as for an external engine)."""
        await asyncio.to_thread(self.swap, state_dict, version)

    def new_episode(self, *, greedy: bool = False) -> EpisodeState:
        if self.version < 0:
            raise RuntimeError("no weights loaded yet")
        return EpisodeState(greedy=greedy)

    async def _run(self, state: EpisodeState, choose) -> None:
        error = await asyncio.wrap_future(self.batcher.submit(state, choose))
        if error is not None:
            raise error

    async def sample_action(
        self, state: EpisodeState, *, generator: torch.Generator
    ) -> tuple[str | None, str, bool]:
        """Sample `<tool:NAME> ARGS <end>` after the `<act>` already in `state`.

        For a tool without arguments (`tokenizer.NO_ARGUMENT_TOOLS`) only the tool token is sampled; the
        `<end>` that closes the action follows as an environment token (loss mask 0): bytes the tool
        would ignore must not be sampled, nor trained on. Returns (tool name, argument text,
        context_exhausted).
        """
        budget = self.config.agent.max_action_tokens
        temperature, tools = self.config.agent.temperature, self.config.agent.tools
        action = {"name": None, "args": [], "exhausted": False, "constraint": grammar.TOOL, "sampled": 0}

        def choose(logits: torch.Tensor, version: int) -> bool:
            constraint = action["constraint"]
            logp = grammar.constrained_logprobs(
                logits, torch.tensor(constraint), temperature=temperature, tools=tools
            )
            token = state.pick(logp, generator)
            state.append_sampled(token, float(logp[token]), version, constraint)
            action["sampled"] += 1
            if constraint == grammar.TOOL:
                action["name"] = tokenizer.tool_name(token)
                if action["name"] in tokenizer.NO_ARGUMENT_TOOLS:
                    state.append_env([tokenizer.END], version, part="actions")
                    return True
                action["constraint"] = grammar.ARGS
            elif token == tokenizer.END:
                return True
            else:
                action["args"].append(token)
            if action["sampled"] >= budget:
                state.append_env([tokenizer.END], version, part="actions")
                return True
            if len(state) + 2 >= self.max_context:
                action["exhausted"] = True
                return True
            return False

        if len(state) + 2 >= self.max_context:
            action["exhausted"] = True
        else:
            await self._run(state, choose)
        return action["name"], bytes(action["args"]).decode("utf-8", "replace"), action["exhausted"]

    async def sample_tool_call(
        self, state: EpisodeState, *, generator: torch.Generator
    ) -> tuple[str | None, dict | None, bool]:
        """A pretrained model's tool call, every token under the grammar, ending with its end-of-turn
        token. Returns (tool name, arguments, context_exhausted); (None, None, False) when the action
        budget ran out before the call closed (the end of turn then follows as an environment token)."""
        tool_calls, tokenizer = self.tool_calls, self.tokenizer
        assert tool_calls is not None and tokenizer is not None
        eos = tokenizer.eos_token_id
        budget = self.config.agent.max_action_tokens
        temperature = self.config.agent.temperature
        matcher = tool_calls.matcher()
        action: list[int] = []
        result: dict = {"call": (None, None), "exhausted": False}

        def choose(logits: torch.Tensor, version: int) -> bool:
            logp = grammar.masked_logprobs(logits, tool_calls.allowed(matcher), temperature=temperature)
            token = state.pick(logp, generator)
            state.append_sampled(token, float(logp[token]), version, grammar.TOOL_CALL)
            action.append(token)
            if token == eos:
                result["call"] = tool_calls.parse(tokenizer.decode(action))
                return True
            tool_calls.advance(matcher, token)
            if len(action) >= budget:
                state.append_env([eos], version, part="actions")
                return True
            if len(state) + 2 >= self.max_context:
                result["exhausted"] = True
                return True
            return False

        if len(state) + 2 >= self.max_context:
            return None, None, True
        await self._run(state, choose)
        if result["exhausted"]:
            return None, None, True
        name, arguments = result["call"]
        return name, arguments, False

    async def sample_summary(self, state: EpisodeState, *, generator: torch.Generator) -> str:
        """Free text after the summary request already in `state`: printable bytes closed by `<end>` in
        the byte-level format, any token closed by the end of turn for a pretrained model (the trainer's
        unconstrained positions), at most agent.max_summary_tokens (the end then follows as an
        environment token). Returns the summary's text."""
        budget = self.config.agent.max_summary_tokens
        temperature = self.config.agent.temperature
        if self.tokenizer is None:
            end, constraint = tokenizer.END, grammar.ARGS
            allowed = grammar.allowed_table()[grammar.ARGS]
        else:
            end, constraint = self.tokenizer.eos_token_id, grammar.FREE
            allowed = torch.ones(self.model_config.vocab_size, dtype=torch.bool)
        text: list[int] = []

        def choose(logits: torch.Tensor, version: int) -> bool:
            logp = grammar.masked_logprobs(logits, allowed, temperature=temperature)
            token = state.pick(logp, generator)
            state.append_sampled(token, float(logp[token]), version, constraint)
            if token == end:
                return True
            text.append(token)
            if len(text) >= budget or len(state) + 2 >= self.max_context:
                state.append_env([end], version, part="actions")
                return True
            return False

        if len(state) + 2 < self.max_context:
            await self._run(state, choose)
        else:
            state.append_env([end], self.version, part="actions")
        if self.tokenizer is None:
            return bytes(text).decode("utf-8", "replace")
        return self.tokenizer.decode(text, skip_special_tokens=True)

    async def finish(self, state: EpisodeState) -> None:
        """Feed the trailing tokens so that every position has its routing recorded."""
        if state.fed < len(state):
            await self._run(state, None)

    def release(self, state: EpisodeState) -> None:
        """The episode is over: its KV cache slot goes back to the batcher."""
        self.batcher.release(state)
