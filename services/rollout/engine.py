"""The inference engine: the policy model, its version, and constrained sampling with a KV cache.

Weights are swapped between decode steps: `swap` loads a new state dict into a fresh model and then
switches both (model, version) in one assignment, so every sampled token knows the version that made it.
An episode that spans a swap keeps its KV cache (computed by the old weights), as asynchronous RL
systems do; the per-token versions let the trainer see and bound exactly that staleness.
"""

from __future__ import annotations

import threading

import torch

from crucible.agent import grammar, tokenizer
from crucible.agent.episode import EpisodeState
from crucible.agent.toolcalls import ToolCallGrammar
from crucible.contracts.runconfig import RunConfig
from crucible.model import PRESETS, Transformer, build_model
from crucible.model.sources import load_tokenizer, model_config


class PolicyEngine:
    """The run's model at its newest version and the agent's token format: the byte-level `<act>` format
    of Crucible's presets, or a pretrained model's own tokenizer, chat template and tool calls."""

    def __init__(self, *, config: RunConfig, max_context: int) -> None:
        self.config = config
        source = config.model.source
        self.model_config = model_config(source)
        self.tokenizer = load_tokenizer(source)
        self.tool_calls: ToolCallGrammar | None = None
        if self.tokenizer is None:
            if self.model_config.vocab_size != tokenizer.VOCAB_SIZE:
                raise ValueError(f"preset {source!r} has vocab {self.model_config.vocab_size}")
        else:
            self.tool_calls = ToolCallGrammar.for_agent(
                self.tokenizer, vocab_size=self.model_config.vocab_size, agent=config.agent
            )
        self.max_context = min(max_context, self.model_config.max_seq_len)
        self._current: tuple[Transformer, int] | None = None
        self._swap_lock = threading.Lock()

    @property
    def version(self) -> int:
        return -1 if self._current is None else self._current[1]

    def _build(self) -> Transformer:
        if self.config.model.source in PRESETS:
            model = build_model(self.model_config, precision=self.config.model.precision, seed=self.config.seed)
        else:  # the weights come with the swap
            model = Transformer(self.model_config, precision=self.config.model.precision)
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
            self._current = (model, version)

    def new_episode(self, *, greedy: bool = False) -> EpisodeState:
        if self._current is None:
            raise RuntimeError("no weights loaded yet")
        return EpisodeState(cache=self._current[0].new_cache(batch_size=1, max_len=self.max_context), greedy=greedy)

    @torch.inference_mode()
    def _feed(self, model: Transformer, state: EpisodeState) -> torch.Tensor:
        """Run the not-yet-fed tokens through the model; returns the last position's logits [V]."""
        pending = torch.tensor([state.tokens[state.fed :]], dtype=torch.long)
        out = model(pending, cache=state.cache)
        if out.routes is not None:
            state.routes.extend(out.routes[0].tolist())
        state.fed = len(state.tokens)
        return out.logits[0, -1]

    @torch.inference_mode()
    def sample_action(self, state: EpisodeState, *, generator: torch.Generator) -> tuple[str | None, str, bool]:
        """Sample `<tool:NAME> ARGS <end>` after the `<act>` already in `state`.

        For a tool without arguments (`tokenizer.NO_ARGUMENT_TOOLS`) only the tool token is sampled; the
        `<end>` that closes the action follows as an environment token (loss mask 0): bytes the tool
        would ignore must not be sampled, nor trained on. Returns (tool name, argument text,
        context_exhausted).
        """
        budget = self.config.agent.max_action_tokens
        name: str | None = None
        args: list[int] = []
        constraint = grammar.TOOL
        for step in range(budget):
            if len(state) + 2 >= self.max_context:
                return name, bytes(args).decode("utf-8", "replace"), True
            model, version = self._current  # type: ignore[misc]
            logits = self._feed(model, state)
            logp = grammar.constrained_logprobs(
                logits, torch.tensor(constraint), temperature=self.config.agent.temperature
            )
            token = state.pick(logp, generator)
            state.append_sampled(token, float(logp[token]), version, constraint)
            if constraint == grammar.TOOL:
                name = tokenizer.tool_name(token)
                if name in tokenizer.NO_ARGUMENT_TOOLS:
                    state.append_env([tokenizer.END], version)
                    break
                constraint = grammar.ARGS
            elif token == tokenizer.END:
                break
            else:
                args.append(token)
        else:
            state.append_env([tokenizer.END], self.version)
        return name, bytes(args).decode("utf-8", "replace"), False

    @torch.inference_mode()
    def sample_tool_call(
        self, state: EpisodeState, *, generator: torch.Generator
    ) -> tuple[str | None, dict | None, bool]:
        """A pretrained model's tool call, every token under the grammar, ending with its end-of-turn
        token. Returns (tool name, arguments, context_exhausted); (None, None, False) when the action
        budget ran out before the call closed (the end of turn then follows as an environment token)."""
        assert self.tool_calls is not None and self.tokenizer is not None
        matcher = self.tool_calls.matcher()
        eos = self.tokenizer.eos_token_id
        action: list[int] = []
        for _ in range(self.config.agent.max_action_tokens):
            if len(state) + 2 >= self.max_context:
                return None, None, True
            model, version = self._current  # type: ignore[misc]
            logits = self._feed(model, state)
            logp = grammar.masked_logprobs(
                logits, self.tool_calls.allowed(matcher), temperature=self.config.agent.temperature
            )
            token = state.pick(logp, generator)
            state.append_sampled(token, float(logp[token]), version, grammar.TOOL_CALL)
            action.append(token)
            if token == eos:
                name, arguments = self.tool_calls.parse(self.tokenizer.decode(action))
                return name, arguments, False
            self.tool_calls.advance(matcher, token)
        state.append_env([eos], self.version)
        return None, None, False

    @torch.inference_mode()
    def finish(self, state: EpisodeState) -> None:
        """Feed the trailing tokens so that every position has its routing recorded."""
        if state.fed < len(state) and self._current is not None:
            self._feed(self._current[0], state)
