"""What a run's `model` section means, resolved once: the policy's architecture, tokenizer and chat
template, tool-call grammar, context, precision, and the identity and digest of its source.

The trainer, the rollout engines and `crucible serve` all start from a `PolicySpec` instead of each
reading the source again. A spec is plain data (it pickles to a worker rank as its config does); the
heavy parts, the tokenizer and the grammar compiled for it, load on first use and are kept per process,
keyed by the source's digest, so every engine and rank of a process shares one of each.

The digest is a fingerprint, cheap enough to take at every start: for every file of the source its
relative path, size and the sha256 of its first and last MiB (the whole of a small file); for a preset,
its configuration. It changes when a checkpoint is replaced, resized or rewritten; it is the same on
every machine that holds the same files, wherever they are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crucible.model.config import PRECISIONS, PRESETS, LoraSpec, ModelConfig
from crucible.model.sources import (
    Source,
    SourceError,
    SourceKind,
    load_initial,
    read_config,
    read_tokenizer,
    resolve,
)

if TYPE_CHECKING:
    from crucible.agent.toolcalls import ToolCallGrammar
    from crucible.contracts.runconfig import AgentSection, RunConfig
    from crucible.model.transformer import Transformer

EDGE_BYTES = 1 << 20  # of each end of a file, in its fingerprint


@dataclass(frozen=True, kw_only=True)
class PolicySpec:
    """A model source resolved: build one with `resolve_policy` or `PolicySpec.resolve`."""

    source: str
    """The source as the run config names it (a preset, package:NAME, a path)."""
    kind: SourceKind
    location: str
    """The preset's name, or the checkpoint directory or .gguf file the source resolved to."""
    digest: str
    """sha256 fingerprint of the source (see the module's docstring)."""
    architecture: ModelConfig
    precision: str
    """Of the linear layers, for training and inference alike."""
    max_context: int
    """Tokens per sequence: the model's max_seq_len, or less where the caller asked for less."""
    action_chars: int | None = None
    """Longest string argument of an agent's tool call (the agent's action budget); None: unbounded."""
    tools: tuple[str, ...] | None = None
    """The agent's tools (agent.tools) the action grammar allows; None: all of them."""
    lora: LoraSpec | None = None
    """The run's adapters (model.lora): every model built from this spec carries them; None: none."""

    @classmethod
    def resolve(cls, config: RunConfig, *, max_context: int | None = None) -> PolicySpec:
        """A run's policy: its `model` section, with its agent's tool-call bounds."""
        spec = resolve_policy(
            config.model.source, precision=config.model.precision, agent=config.agent, max_context=max_context
        )
        if (lora := config.model.lora) is None:
            return spec
        return dataclasses.replace(
            spec, lora=LoraSpec(rank=lora.rank, alpha=lora.alpha, targets=tuple(lora.targets))
        )

    @property
    def byte_level(self) -> bool:
        """A Crucible preset: no tokenizer of its own, the agent speaks the byte-level `<act>` format."""
        return self.kind == "preset"

    @property
    def tokenizer(self) -> Any | None:
        """The source's own tokenizer (None for a preset); loaded once per process."""
        return None if self.byte_level else _tokenizer(self.kind, self.location, self.digest)

    @property
    def chat_template(self) -> str | None:
        tokenizer = self.tokenizer
        return None if tokenizer is None else getattr(tokenizer, "chat_template", None)

    @property
    def tool_calls(self) -> ToolCallGrammar | None:
        """The agent's action grammar (its `tools`, strings bounded by `action_chars`): the one rollouts
        sample under and the trainer replays. None for a preset; compiled once per process."""
        if self.byte_level:
            return None
        return _agent_grammar(
            self.kind, self.location, self.digest, self.architecture.vocab_size, self.action_chars, self.tools
        )

    def grammar(
        self,
        *,
        tools: list[dict[str, Any]] | None = None,
        max_chars: int | None = None,
        lark: str | None = None,
    ) -> ToolCallGrammar:
        """A new grammar of one call to one of `tools` (default: the agent's), or of a Lark grammar."""
        from crucible.agent.toolcalls import TOOLS, ToolCallGrammar

        if self.byte_level:
            raise SourceError(f"preset {self.source!r} has no tokenizer to build a tool-call grammar for")
        return ToolCallGrammar(
            self.tokenizer, tools=TOOLS if tools is None else tools, vocab_size=self.architecture.vocab_size,
            max_chars=max_chars, lark=lark,
        )  # fmt: skip

    def with_context(self, max_context: int) -> PolicySpec:
        """The same policy on at most `max_context` tokens per sequence."""
        return dataclasses.replace(self, max_context=min(max_context, self.architecture.max_seq_len))

    def initial_model(self, *, seed: int = 0) -> Transformer:
        """The starting weights: a preset initialised from `seed`, or the checkpoint's, at `precision`;
        with the run's fresh adapters (drawn from `seed`) if it has any."""
        model = load_initial(Source(self.kind, self.location), seed=seed, precision=self.precision)
        if model.cfg != self.architecture:
            raise SourceError(f"{self.location} changed since it was resolved: another architecture")
        return self.adapt(model, seed=seed)

    def empty_model(self) -> Transformer:
        """The architecture with uninitialised weights (and the run's adapters), for a state dict to fill."""
        from crucible.model.transformer import Transformer

        return self.adapt(Transformer(self.architecture, precision=self.precision))

    def adapt(self, model: Transformer, *, seed: int = 0) -> Transformer:
        """`model` with the run's fresh adapters (crucible.model.lora), or as it is without model.lora."""
        if self.lora is not None:
            from crucible.model.lora import attach

            attach(model, self.lora, seed=seed)
        return model


def resolve_policy(
    source: str,
    *,
    precision: str = "bf16",
    agent: AgentSection | None = None,
    max_context: int | None = None,
) -> PolicySpec:
    """Resolve `source` (crucible.model.sources) into a PolicySpec, reading no weights and, until they are
    first used, neither tokenizer nor grammar. `agent` bounds the tool calls' string arguments by its
    action budget; `max_context` caps the model's context."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")
    found = resolve(source)
    kind = found.kind
    digest = _digest(kind, found.value)
    architecture = _architecture(kind, found.value, digest)
    limit = architecture.max_seq_len if max_context is None else min(max_context, architecture.max_seq_len)
    if limit < 1:
        raise ValueError(f"max_context must be positive, got {max_context}")
    return PolicySpec(
        source=source, kind=kind, location=found.value, digest=digest, architecture=architecture,
        precision=precision, max_context=limit,
        action_chars=None if agent is None else agent.max_action_tokens,
        tools=None if agent is None else tuple(agent.tools),
    )  # fmt: skip


def _digest(kind: str, location: str) -> str:
    digest = hashlib.sha256(f"{kind}\n".encode())
    if kind == "preset":
        digest.update(PRESETS[location].to_json().encode())
        return digest.hexdigest()
    path = Path(location)
    if path.is_file():
        files = [(path.name, path)]
    else:
        files = sorted(
            (str(p.relative_to(path)), p)
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
    for name, file in files:
        digest.update(json.dumps([name, _fingerprint(file)]).encode())
    return digest.hexdigest()


def _fingerprint(file: Path) -> list[Any]:
    size = file.stat().st_size
    with file.open("rb") as handle:
        if size <= 2 * EDGE_BYTES:
            return [size, hashlib.sha256(handle.read()).hexdigest()]
        head = hashlib.sha256(handle.read(EDGE_BYTES)).hexdigest()
        handle.seek(size - EDGE_BYTES)
        return [size, head, hashlib.sha256(handle.read(EDGE_BYTES)).hexdigest()]


@lru_cache(maxsize=16)
def _architecture(kind: SourceKind, location: str, digest: str) -> ModelConfig:
    return read_config(Source(kind, location))


@lru_cache(maxsize=8)
def _tokenizer(kind: SourceKind, location: str, digest: str) -> Any:
    return read_tokenizer(Source(kind, location))


@lru_cache(maxsize=8)
def _agent_grammar(
    kind: SourceKind,
    location: str,
    digest: str,
    vocab_size: int,
    max_chars: int | None,
    tools: tuple[str, ...] | None,
) -> ToolCallGrammar:
    from crucible.agent.toolcalls import ToolCallGrammar, agent_tools

    return ToolCallGrammar(
        _tokenizer(kind, location, digest), tools=agent_tools(tools), vocab_size=vocab_size,
        max_chars=max_chars,
    )  # fmt: skip
