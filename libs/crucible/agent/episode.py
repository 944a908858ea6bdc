"""The agent loop: one episode of an actor working on a task inside a sandbox, in the agent's token format.

The actor is the rollout's policy engine (services.rollout.engine) or a teacher that plays a known
solution (crucible.agent.demonstrations); both fill the same EpisodeState, so a demonstration has
exactly the layout of the policy's own episodes."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from crucible.agent import grammar, tokenizer
from crucible.agent.toolcalls import ToolCallGrammar, after_action, after_turn, agent_tools, render_prompt
from crucible.clients.sandbox import SandboxSession
from crucible.contracts.messages import TOKEN_PARTS, TaskSpec, TokenUsage, ToolCall, Trajectory
from crucible.contracts.packing import pack
from crucible.contracts.runconfig import RunConfig
from crucible.contracts.sandbox import ToolResult
from crucible.model.batcher import common_prefix
from crucible.model.sampling import sample


@dataclass
class EpisodeState:
    """The growing token sequence of one episode, with everything the trainer needs per token."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    constraints: list[int] = field(default_factory=list)
    routes: list[list[list[int]]] = field(default_factory=list)  # per fed token: [layers][top_k]
    fed: int = 0  # tokens already run through the model
    greedy: bool = False
    """Take the most likely allowed token instead of sampling (an evaluation's pass@1 episode)."""
    usage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKEN_PARTS, 0))
    """Tokens per part of the episode (TokenUsage's fields)."""

    def pick(self, logp: torch.Tensor, generator: torch.Generator) -> int:
        if self.greedy:
            return int(torch.argmax(logp))
        return sample(logp, generator)

    def append_env(self, tokens: list[int], version: int, *, part: str = "observations") -> None:
        """Tokens of the environment (loss mask 0), counted under `part` of the usage."""
        self.usage[part] += len(tokens)
        for token in tokens:
            self.tokens.append(token)
            self.logprobs.append(0.0)
            self.versions.append(version)
            self.loss_mask.append(0)
            self.constraints.append(grammar.FREE)

    def append_sampled(self, token: int, logprob: float, version: int, constraint: int) -> None:
        """A token the policy sampled, with the logprob of the distribution it was drawn from."""
        self.usage["actions"] += 1
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        self.loss_mask.append(1)
        self.constraints.append(constraint)

    def append_prompt(self, prompt: list[int], blank: list[int], version: int) -> None:
        """A context's prompt: the tokens it shares with `blank`, the same prompt for an empty task (the
        system prompt and tool definitions every episode begins with), count as system, the rest as task."""
        shared = common_prefix(prompt, blank)
        self.append_env(prompt[:shared], version, part="system")
        self.append_env(prompt[shared:], version, part="task")

    def __len__(self) -> int:
        return len(self.tokens)


class Actor(Protocol):
    """What the agent loop needs of whoever chooses the actions."""

    tokenizer: Any  # None: the byte-level format
    max_context: int

    @property
    def tool_calls(self) -> ToolCallGrammar | None:
        """The action grammar of a model with its own tokenizer; None: the byte-level format."""
        ...

    @property
    def version(self) -> int: ...

    def new_episode(self, *, greedy: bool = False) -> EpisodeState: ...

    async def sample_action(
        self, state: EpisodeState, *, generator: torch.Generator
    ) -> tuple[str | None, str, bool]: ...

    async def sample_tool_call(
        self, state: EpisodeState, *, generator: torch.Generator
    ) -> tuple[str | None, dict | None, bool]: ...

    async def sample_summary(self, state: EpisodeState, *, generator: torch.Generator) -> str:
        """Free text after the summary request in `state`, closed by the format's end token (sampled, or
        an environment token when agent.max_summary_tokens ran out); returns its text."""
        ...

    async def finish(self, state: EpisodeState) -> None:
        """Whatever must follow the last token (the rollout feeds it, to record its routing)."""

    def release(self, state: EpisodeState) -> None:
        """The episode is over, normally or not: free what it held."""


USAGE = {
    "read_file": "read_file PATH",
    "list_dir": "list_dir PATH",
    "grep": "grep PATTERN",
    "replace": "replace PATH\\nOLD\\nNEW",
    "run": "run COMMAND",
    "submit": "submit",
}
"""How the byte-level system prompt shows each tool's call."""


def system_prompt(tools: Sequence[str]) -> str:
    """The byte-level agent's system prompt, naming only the run's tools."""
    return (
        "You are a coding agent in a Python repository at /workspace. Fix the bug described below so that "
        f"the project's tests pass. Each turn, call one tool: {' | '.join(USAGE[t] for t in tools)}.\n"
    )


CHAT_SYSTEM_PROMPT = (
    "You are a coding agent in a Python repository. Fix the bug the user describes so that the project's "
    "tests pass: look at the files, edit them with replace, run the tests, then submit."
)


def chat_prompt(statement: str) -> list[dict[str, str]]:
    """The conversation a pretrained model's episode begins with."""
    return [{"role": "system", "content": CHAT_SYSTEM_PROMPT}, {"role": "user", "content": statement}]


CONTEXT_RESERVE = 8  # <act>, a tool token and <end>, plus <eos>, always fit after an observation
SUMMARY_REQUEST = (
    "Your context is nearly full. Summarise your work so far for yourself: what the bug is, which files "
    "and lines matter, what you changed, what the tests said, and what is left to do. You will continue "
    "from this summary alone."
)
SUMMARY_INTRO = "\n\nYour summary of your work so far (the repository keeps your edits):\n"
SUMMARY_OVERHEAD = len(SUMMARY_REQUEST.encode()) + 48  # the request, and the template's tokens around it


class Contexts:
    """The contexts of one episode: the live one the actor decodes, and those a summary closed. A new
    context is a new sequence for the engine (its own KV cache, positions from 0)."""

    def __init__(self, engine: Actor, *, greedy: bool) -> None:
        self.engine = engine
        self.closed: list[EpisodeState] = []
        self.live: EpisodeState = engine.new_episode(greedy=greedy)

    @property
    def offset(self) -> int:
        """Where the live context begins in the episode's token arrays."""
        return sum(len(s) for s in self.closed)

    async def restart(self) -> EpisodeState:
        """Close the live context (its trailing tokens fed, its slot freed) and begin an empty one."""
        await self.engine.finish(self.live)
        self.engine.release(self.live)
        self.closed.append(self.live)
        self.live = self.engine.new_episode(greedy=self.live.greedy)
        return self.live

    @property
    def all(self) -> list[EpisodeState]:
        return [*self.closed, self.live]


def summary_reserve(config: RunConfig) -> int:
    """Room a turn must leave under agent.context_policy = "summarize": the tool's output, the summary
    request and the summary that may have to follow it. 0 under "stop"."""
    agent = config.agent
    if agent.context_policy != "summarize":
        return 0
    return agent.max_observation_bytes + SUMMARY_OVERHEAD + agent.max_summary_tokens


def tool_arguments(name: str, text: str, *, timeout_s: float) -> dict:
    """Map the agent's argument text to the sandbox tool's arguments."""
    if name == "read_file":
        return {"path": text.strip()}
    if name == "list_dir":
        return {"path": text.strip() or "."}
    if name == "grep":
        return {"pattern": text}
    if name == "replace":
        path, _, rest = text.partition("\n")
        old, _, new = rest.partition("\n")
        return {"path": path.strip(), "old": old, "new": new}
    if name == "run":
        return {"command": text, "timeout_s": timeout_s}
    raise ValueError(f"unknown tool {name!r}")


def clip(text: str, limit: int) -> str:
    """At most `limit` characters of a tool's output: a longer one keeps its head and its tail around a
    marker, since a command's verdict (a test run's summary, a traceback's last line) is at its end and
    the head says what ran."""
    if len(text) <= limit:
        return text
    room = max(limit - len(CUT), 0)
    return text[: room - room // 2] + CUT[: limit - room] + text[len(text) - room // 2 :]


CUT = "\n...\n"


def observation(text: str, *, limit: int) -> list[int]:
    """A byte-level observation of at most `limit` bytes (clipped as `clip` does, byte for byte)."""
    data = clip(text.encode("utf-8", "replace").decode("latin-1"), limit).encode("latin-1")
    return [tokenizer.OBS, *data]


async def run_episode(
    *,
    engine: Actor,
    config: RunConfig,
    task: TaskSpec,
    session: SandboxSession,
    run_id: str,
    group_id: str,
    seed: int,
    replica: str,
    tool_timeout_s: float,
    greedy: bool = False,
    trajectory_id: str | None = None,
) -> Trajectory:
    started = time.time()
    generator = torch.Generator().manual_seed(seed)
    contexts = Contexts(engine, greedy=greedy)
    try:
        turns = _chat_turns if engine.tool_calls is not None else _byte_turns
        calls, finish = await turns(engine, config, task, session, contexts, generator, tool_timeout_s)
        await engine.finish(contexts.live)
    finally:
        engine.release(contexts.live)
    return episode_trajectory(
        tokenizer=engine.tokenizer,
        states=contexts.all,
        task=task,
        run_id=run_id,
        group_id=group_id,
        calls=calls,
        finish=finish,
        diff=await session.diff(),
        replica=replica,
        started=started,
        trajectory_id=trajectory_id,
    )


def episode_trajectory(
    *,
    tokenizer: Any,
    states: list[EpisodeState],
    task: TaskSpec,
    run_id: str,
    group_id: str,
    calls: list[ToolCall],
    finish: str,
    diff: str,
    replica: str,
    started: float,
    trajectory_id: str | None = None,
) -> Trajectory:
    """The trajectory of a finished episode: its contexts (one after the other) with every token's
    record, its tool calls, the repository's diff."""
    tokens = [t for state in states for t in state.tokens]
    starts = [0]
    for state in states[:-1]:
        starts.append(starts[-1] + len(state))
    return Trajectory(
        run_id=run_id,
        trajectory_id=trajectory_id or uuid.uuid4().hex,
        group_id=group_id,
        task_id=task.task_id,
        taskset=task.taskset,
        **packed_arrays(*states),
        token_usage=TokenUsage(**{part: sum(state.usage[part] for state in states) for part in TOKEN_PARTS}),
        context_starts=starts if len(states) > 1 else [],
        token_text=[] if tokenizer is None else tokenizer.batch_decode([[t] for t in tokens]),
        tool_calls=calls,
        final_diff=diff,
        finish_reason=finish,
        rollout_replica=replica,
        started_at=started,
        finished_at=time.time(),
    )


async def _byte_turns(
    engine, config, task, session, contexts, generator, tool_timeout_s
) -> tuple[list[ToolCall], str]:
    """The byte-level agent of Crucible's presets: `<act><tool:NAME>ARGS<end>` turns."""
    prompt = system_prompt(config.agent.tools) + "Task: "
    prompt_limit = min(4 * config.agent.max_observation_bytes, engine.max_context // 2)
    blank = [tokenizer.BOS, *observation(prompt, limit=prompt_limit)]
    state = contexts.live
    state.append_prompt(
        [tokenizer.BOS, *observation(prompt + task.statement, limit=prompt_limit)], blank, engine.version
    )
    calls: list[ToolCall] = []
    finish = "max_turns"
    for turn in range(config.agent.max_turns):
        if config.agent.context_policy == "summarize" and not turn_fits(engine, config, state, []):
            state.append_env(observation(SUMMARY_REQUEST, limit=SUMMARY_OVERHEAD), engine.version)  # whole
            summary = await engine.sample_summary(state, generator=generator)
            state = await contexts.restart()
            summarised = tokenizer.encode(SUMMARY_INTRO + summary)  # never cut: it is all the policy keeps
            state.append_prompt(
                [tokenizer.BOS, *observation(prompt + task.statement, limit=prompt_limit), *summarised],
                blank,
                engine.version,
            )
            if not turn_fits(engine, config, state, []):
                finish = "context"  # the task and the summary alone leave no room for a turn
                break
        state.append_env([tokenizer.ACT], engine.version)
        start = contexts.offset + len(state)
        name, args, exhausted = await engine.sample_action(state, generator=generator)
        end, version = contexts.offset + len(state), state.versions[-1]
        if exhausted:
            finish = "context"
            break
        if name == "submit":
            finish = "submitted"
            calls.append(_call(turn, "submit", args, True, "", 0.0, start, end, version))
            break
        t0 = time.perf_counter()
        result = await session.tool(name, **tool_arguments(name, args, timeout_s=tool_timeout_s))
        text = result.output if result.ok else f"error: {result.error}"
        calls.append(_call(turn, name, args, result.ok, text, time.perf_counter() - t0, start, end, version))
        room = engine.max_context - len(state) - CONTEXT_RESERVE
        if room <= 8:
            finish = "context"
            break
        state.append_env(
            observation(text, limit=min(config.agent.max_observation_bytes, room)), engine.version
        )
    state.append_env([tokenizer.EOS], engine.version)
    return calls, finish


async def _chat_turns(
    engine, config, task, session, contexts, generator, tool_timeout_s
) -> tuple[list[ToolCall], str]:
    """A pretrained model in its own chat template: each turn one tool call under the grammar, each
    result the template's tool turn (environment tokens)."""
    tok, tools = engine.tokenizer, agent_tools(config.agent.tools)
    messages = chat_prompt(task.statement)
    blank = render_prompt(tok, chat_prompt(""), tools=tools)
    state = contexts.live
    state.append_prompt(render_prompt(tok, messages, tools=tools), blank, engine.version)
    calls: list[ToolCall] = []
    finish = "max_turns"
    for turn in range(config.agent.max_turns):
        start = contexts.offset + len(state)
        name, arguments, exhausted = await engine.sample_tool_call(state, generator=generator)
        end, version = contexts.offset + len(state), state.versions[-1]
        if exhausted:
            finish = "context"
            break
        action = tok.decode(state.tokens[start - contexts.offset :], skip_special_tokens=False).removesuffix(
            tok.eos_token
        )
        args_text = json.dumps(arguments) if arguments is not None else ""
        if name == "submit":
            finish = "submitted"
            calls.append(_call(turn, "submit", args_text, True, "", 0.0, start, end, version))
            break
        t0 = time.perf_counter()
        if name is None or arguments is None:  # both or neither
            ok, text = False, "error: the tool call did not close within the action budget"
        else:
            result, text = await run_chat_tool(
                session, name, arguments, config=config, timeout_s=tool_timeout_s
            )
            ok = result.ok
        text = clip(text, config.agent.max_observation_bytes)
        calls.append(
            _call(turn, name or "invalid", args_text, ok, text, time.perf_counter() - t0, start, end, version)
        )
        messages += [{"role": "assistant", "content": action}, {"role": "tool", "content": text}]
        following = after_action(tok, messages, tools=tools)
        if turn_fits(engine, config, state, following):
            state.append_env(following, engine.version)
            continue
        if config.agent.context_policy != "summarize":
            finish = "context"
            break
        request = after_turn(
            tok, messages[:-1], [*messages, {"role": "user", "content": SUMMARY_REQUEST}], tools=tools
        )
        if len(state) + len(request) + config.agent.max_summary_tokens + 1 > engine.max_context:
            finish = "context"  # the tool's output was longer than the reserve held for it
            break
        state.append_env(request, engine.version)
        summary = await engine.sample_summary(state, generator=generator)
        state = await contexts.restart()
        messages = chat_prompt(task.statement + SUMMARY_INTRO + summary)
        state.append_prompt(render_prompt(tok, messages, tools=tools), blank, engine.version)
        if not turn_fits(engine, config, state, []):
            finish = "context"  # the task and the summary alone leave no room for a turn
            break
    return calls, finish


async def run_chat_tool(
    session: SandboxSession, name: str, arguments: dict, *, config: RunConfig, timeout_s: float
) -> tuple[ToolResult, str]:
    """Run a pretrained model's tool call in the sandbox: the result, and what the policy sees of it."""
    extra = {"timeout_s": timeout_s} if name == "run" else {}
    result = await session.tool(name, **arguments, **extra)
    text = result.output if result.ok else f"error: {result.error}"
    return result, clip(text, config.agent.max_observation_bytes)


def turn_fits(engine: Actor, config: RunConfig, state: EpisodeState, following: list[int]) -> bool:
    """Whether the tokens before the next action (a chat template's, or none), and a whole action, fit
    in the context (with room for what a summary would need after it, under agent.context_policy =
    "summarize")."""
    need = len(following) + CONTEXT_RESERVE + config.agent.max_action_tokens + summary_reserve(config)
    return len(state) + need <= engine.max_context


def packed_arrays(*states: EpisodeState) -> dict[str, Any]:
    """An episode's per-token arrays (of its contexts, one after the other) as a Trajectory carries them
    (packed little-endian)."""
    routes_shape: list[int] = []
    routes = b""
    steps = [step for state in states for step in state.routes]
    if steps:
        routes_shape = [len(steps), len(steps[0]), len(steps[0][0])]
        routes = pack("u8", (e for layer in steps for k in layer for e in k))

    def column(name: str) -> list:
        return [v for state in states for v in getattr(state, name)]

    return {
        "tokens": pack("u32", column("tokens")),
        "logprobs": pack("f32", column("logprobs")),
        "versions": pack("u32", column("versions")),
        "loss_mask": pack("u8", column("loss_mask")),
        "constraints": pack("u8", column("constraints")),
        "routes": routes,
        "routes_shape": routes_shape,
    }


def _call(index, name, args, ok, output, duration, start, end, version) -> ToolCall:
    return ToolCall(
        index=index,
        name=name,
        arguments=args,
        ok=ok,
        output=output,
        duration_s=duration,
        token_start=start,
        token_end=end,
        policy_version=version,
    )
