"""Token ids in, sampled tokens out, on the continuous batcher (crucible.model.batcher): the sampling an
OpenAI-compatible request asks for, with the exact logprob of every token under the distribution it was
drawn from (temperature, top-p and grammar applied; a greedy token's is under the grammar-masked
distribution at temperature 1) and the version of the weights that made it.

Each request is one sequence on the batcher, released when the request ends, normally or not (a client
that goes away mid-stream frees its slot at once). Concurrent requests over one prompt prefill it once,
and a conversation's next request continues the cache its last one left, while the slot is not needed.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import torch

from crucible.agent.toolcalls import ToolCallGrammar
from crucible.model.batcher import BatcherError, ContinuousBatcher
from crucible.model.sampling import sample
from crucible.model.transformer import Transformer


class RequestError(ValueError):
    """What the client asked for cannot be served (the message says why): a 400, never a 5xx."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: up to the context
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_logprobs: int = 0  # alternatives reported per token
    seed: int | None = None


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float
    top: list[tuple[int, float]]
    version: int


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (end of turn), "length" (max_tokens or the context)


@dataclass(eq=False)
class _Sequence:
    tokens: list[int]
    fed: int = 0
    routes: list = field(default_factory=list)


class ServingEngine:
    """One model (with its tokenizer) behind a continuous batcher."""

    def __init__(
        self,
        *,
        model: Transformer,
        tokenizer: Any,
        name: str,
        version: int = 0,
        max_context: int | None = None,
        max_sequences: int = 64,
        prefill_chunk: int = 256,
        precision: str = "fp32",
    ) -> None:
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise ValueError("serving needs the model's own tokenizer, with an end-of-turn (eos) token")
        self.name = name
        self.precision = precision  # of weights loaded later (`reload`)
        self.tokenizer = tokenizer
        self.vocab_size = model.cfg.vocab_size
        self.max_context = min(max_context or model.cfg.max_seq_len, model.cfg.max_seq_len)
        self.batcher = ContinuousBatcher(
            max_context=self.max_context, max_slots=max_sequences, prefill_chunk=prefill_chunk
        )
        self.batcher.swap(model, version)
        self._grammars: OrderedDict[str, ToolCallGrammar] = OrderedDict()

    @classmethod
    def from_source(
        cls,
        source: str,
        *,
        precision: str = "fp32",
        max_context: int | None = None,
        adapter: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> ServingEngine:
        """A model source as a run names it (crucible.model.spec): a checkpoint directory, a GGUF file, a
        packaged checkpoint; with `adapter`, a PEFT LoRA adapter directory merged into its weights (what
        `crucible model export --adapter` writes for a model.lora run). Presets have no tokenizer of their
        own and cannot be served."""
        from crucible.model.lora import merge, read_adapter
        from crucible.model.spec import resolve_policy

        policy = resolve_policy(source, precision=precision, max_context=max_context)
        if policy.byte_level:
            raise ValueError(
                f"{source!r} is a preset: it speaks the byte-level format and has no chat template to serve"
            )
        model = policy.initial_model().eval().requires_grad_(False)
        if adapter is not None:
            adapted = {**model.state_dict(), **read_adapter(adapter, model.cfg)}
            model.load_state_dict(merge(adapted, model.cfg), strict=True)
        return cls(
            model=model, tokenizer=policy.tokenizer, name=kwargs.pop("name", source),
            precision=policy.precision, max_context=policy.max_context, **kwargs,
        )  # fmt: skip

    @property
    def version(self) -> int:
        return self.batcher.version

    def swap(self, model: Transformer, version: int) -> None:
        """New weights for the next decode step; sequences in flight go on (their tokens say which made
        them)."""
        self.batcher.swap(model, version)

    def close(self) -> None:
        self.batcher.close()

    def tool_grammar(self, tools: list[dict[str, Any]]) -> ToolCallGrammar:
        """The grammar of one call to one of `tools` (compiled once per tool set, a few kept)."""
        build = lambda: ToolCallGrammar(self.tokenizer, tools=tools, vocab_size=self.vocab_size)  # noqa: E731
        return self._grammar(
            "tools:" + json.dumps(tools, sort_keys=True), build, "the tools' JSON schemas", "tools"
        )

    def lark_grammar(self, lark: str, *, param: str) -> ToolCallGrammar:
        """A client's own grammar, in llguidance's Lark dialect (compiled once, a few kept)."""
        build = lambda: ToolCallGrammar(self.tokenizer, lark=lark, vocab_size=self.vocab_size)  # noqa: E731
        return self._grammar("lark:" + lark, build, "the grammar", param)

    def _grammar(self, key: str, build: Any, what: str, param: str) -> ToolCallGrammar:
        grammar = self._grammars.get(key)
        if grammar is None:
            try:
                grammar = build()
            except Exception as exc:  # a grammar llguidance cannot compile is the client's
                raise RequestError(f"{what} cannot be compiled: {exc}", param=param) from None
            self._grammars[key] = grammar
            if len(self._grammars) > 16:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        return grammar

    def reload(self, path: str, version: int) -> None:
        """New weights from a Hugging Face checkpoint directory, as `version` (never older than the one
        served; the same one when a client loads the weights the server started on under its own number):
        the next decode step uses them, sequences in flight go on."""
        from crucible.model.sources import initial_model

        if version < self.version:
            raise RequestError(
                f"weight version {version} is older than {self.version}", param="weight_version"
            )
        try:
            model = initial_model(path, seed=0, precision=self.precision).eval().requires_grad_(False)
        except Exception as exc:  # a missing, foreign or truncated checkpoint is the caller's
            raise RequestError(f"cannot load {path}: {exc}", param="model_path") from None
        served = self.batcher.model
        assert served is not None  # the engine gave the batcher its model when it started
        if model.cfg != served.cfg:
            raise RequestError(
                f"{path} is a different architecture from the model served", param="model_path"
            )
        self.batcher.swap(model, version)

    def check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise RequestError("the prompt is empty", param="prompt")
        if len(prompt) >= self.max_context:
            raise RequestError(
                f"the prompt is {len(prompt)} tokens; this model's context is {self.max_context}",
                param="messages",
            )
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise RequestError(f"token ids must be in [0, {self.vocab_size})", param="prompt")

    async def generate(
        self, prompt: list[int], params: SamplingParams, *, grammar: ToolCallGrammar | None = None
    ) -> AsyncGenerator[Sampled | Finished, None]:
        """Every token as it is sampled, then how the completion ended. Leaving the iteration early
        (a stop string, a client gone) releases the sequence."""
        self.check_prompt(prompt)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        sequence = _Sequence(list(prompt))
        limit = min(self.max_context, len(prompt) + (params.max_tokens or self.max_context))
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        generator = torch.Generator().manual_seed(seed)
        matcher = grammar.matcher() if grammar is not None else None
        eos = self.tokenizer.eos_token_id

        def choose(logits: torch.Tensor, version: int) -> bool:
            allowed = grammar.allowed(matcher) if grammar is not None else None
            logp = distribution(logits, params, allowed)
            if params.temperature == 0:
                token = int(torch.argmax(logp))
            else:
                token = sample(logp, generator)
            top = []
            if params.top_logprobs:
                values, ids = torch.topk(logp, min(params.top_logprobs, logp.numel()))
                top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True) if v > float("-inf")]
            sequence.tokens.append(token)
            loop.call_soon_threadsafe(events.put_nowait, Sampled(token, float(logp[token]), top, version))
            if token == eos:
                loop.call_soon_threadsafe(events.put_nowait, Finished("stop"))
                return True
            if grammar is not None:
                grammar.advance(matcher, token)
            if len(sequence.tokens) >= limit:
                loop.call_soon_threadsafe(events.put_nowait, Finished("length"))
                return True
            return False

        def ended(future) -> None:  # the batcher's future resolves to None or to the error that ended it
            error = future.result()
            if error is not None:
                loop.call_soon_threadsafe(events.put_nowait, error)

        try:
            self.batcher.submit(sequence, choose).add_done_callback(ended)
        except BatcherError as exc:
            raise RequestError(str(exc)) from None
        try:
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise RuntimeError(f"generation failed: {event}") from event
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            self.batcher.release(sequence)


def distribution(logits: torch.Tensor, params: SamplingParams, allowed: torch.Tensor | None) -> torch.Tensor:
    """fp32 log-probabilities of the distribution the next token is drawn from."""
    scores = logits.float()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if params.temperature == 0:
        return torch.log_softmax(scores, dim=-1)
    logp = torch.log_softmax(scores / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_logp, order = torch.sort(logp, descending=True)
        before = torch.cumsum(sorted_logp.exp(), dim=-1) - sorted_logp.exp()  # mass of the tokens ahead
        drop = torch.zeros_like(logp, dtype=torch.bool).scatter(0, order, before >= params.top_p)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp
