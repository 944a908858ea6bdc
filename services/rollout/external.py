"""An external inference engine for a replica's episodes: a vLLM or SGLang server on a GPU fleet (or
`crucible serve --weights-dir`, which speaks both dialects), driven token-in-token-out.

The agent loop is the builtin one (crucible.agent.episode); only the sampling moves out. Every request
sends the episode's token ids, the tool-call grammar (the one the trainer replays) and a seed, and reads
back token ids and the logprob of each under the distribution it was drawn from. The two dialects:

- ``vllm``: ``POST /v1/completions`` with vLLM's extensions (``structured_outputs``, ``return_token_ids``);
  weights reload through its development endpoint ``/collective_rpc`` (``reload_weights``), then the
  prefix cache is reset. vLLM must run with ``--logprobs-mode processed_logprobs`` (logprobs after
  temperature and the grammar mask, not the raw model's), ``VLLM_SERVER_DEV_MODE=1`` and
  ``--structured-outputs-config '{"backend": "guidance"}'`` (the grammar is llguidance's Lark dialect).
- ``sglang``: native ``POST /generate`` (``input_ids``, ``sampling_params.ebnf``, ``return_logprob``) and
  ``/update_weights_from_disk``; SGLang must run with ``--grammar-backend llguidance``.

Each announced version is written as a Hugging Face checkpoint directory under ``engine_weights_dir`` (a
directory the server also sees) and the server is told to load it. Requests and reloads never overlap: a
reload waits for the requests in flight and holds new ones back, so every token of a request was made by
the version its tokens are recorded with. Only what the dialects cannot tell is taken on trust: that the
server's logprobs are those of the processed distribution (`benches/device_external_engine.py` checks
that on a GPU against the trainer's recomputation).
"""

from __future__ import annotations

import asyncio
import shutil
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import torch

from crucible.agent import grammar
from crucible.agent.episode import EpisodeState
from crucible.agent.toolcalls import ToolCallError, ToolCallGrammar
from crucible.contracts.runconfig import RunConfig
from crucible.model.hf import export_weights
from crucible.model.spec import PolicySpec

Kind = Literal["vllm", "sglang"]


class ExternalEngineError(RuntimeError):
    """The external engine answered something a trajectory cannot be recorded from (the message says what)."""


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    logprobs: list[float]
    finish: str  # "stop" (the end of turn, included in tokens) or "length"
    versions: list[int] | None = None  # per token, where the server says (crucible serve does)


class _Gate:
    """Requests share the engine; a reload has it alone, and new requests wait while one is pending."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._requests = 0
        self._reloading = False

    @asynccontextmanager
    async def request(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._reloading)
            self._requests += 1
        try:
            yield
        finally:
            async with self._cond:
                self._requests -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def reload(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._reloading)
            self._reloading = True
            await self._cond.wait_for(lambda: self._requests == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._reloading = False
                self._cond.notify_all()


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Any:
    try:
        response = await client.post(path, json=body)
    except httpx.HTTPError as exc:
        raise ExternalEngineError(f"{client.base_url}{path}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise ExternalEngineError(
            f"{client.base_url}{path}: HTTP {response.status_code}: {response.text[:500]}"
        )
    try:
        return response.json()
    except ValueError:
        raise ExternalEngineError(f"{client.base_url}{path}: the answer is not JSON") from None


async def _sample_vllm(client, prompt: list[int], *, max_tokens, temperature, seed, lark) -> Completion:
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0,
        "seed": seed, "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
    }  # fmt: skip
    if lark is not None:
        body["structured_outputs"] = {"grammar": lark}
    answer = await _post(client, "/v1/completions", body)
    try:
        choice = answer["choices"][0]
        tokens = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        finish = "stop" if choice["finish_reason"] == "stop" else "length"
        versions = choice.get("policy_versions")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ExternalEngineError(f"a completion without token ids and logprobs: {exc!r}") from None
    return Completion(tokens, logprobs, finish, versions)


async def _sample_sglang(client, prompt: list[int], *, max_tokens, temperature, seed, lark) -> Completion:
    params: dict[str, Any] = {
        "max_new_tokens": max_tokens, "temperature": temperature, "top_p": 1.0, "sampling_seed": seed,
        "skip_special_tokens": False, "no_stop_trim": True,
    }  # fmt: skip
    if lark is not None:
        params["ebnf"] = lark
    answer = await _post(
        client, "/generate", {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
    )
    try:
        meta = answer["meta_info"]
        tokens = [int(t) for t in answer["output_ids"]]
        logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
        finish = "stop" if meta["finish_reason"]["type"] == "stop" else "length"
        versions = meta.get("policy_versions")
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ExternalEngineError(f"a generation without output ids and logprobs: {exc!r}") from None
    return Completion(tokens, logprobs, finish, versions)


async def _reload_vllm(client: httpx.AsyncClient, path: str, version: int) -> None:
    await _post(client, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
    await _post(client, "/reset_prefix_cache", {})


async def _reload_sglang(client: httpx.AsyncClient, path: str, version: int) -> None:
    answer = await _post(
        client, "/update_weights_from_disk", {"model_path": path, "weight_version": str(version)}
    )
    if not isinstance(answer, dict) or not answer.get("success"):
        raise ExternalEngineError(f"the engine did not load {path}: {answer!r:.500}")


SAMPLE = {"vllm": _sample_vllm, "sglang": _sample_sglang}
RELOAD = {"vllm": _reload_vllm, "sglang": _reload_sglang}


class ExternalEngine:
    """The builtin agent's actor (crucible.agent.episode.Actor) on an external server, for a run whose
    model has its own tokenizer and chat template (a byte-level preset is Crucible's alone)."""

    def __init__(
        self,
        *,
        config: RunConfig,
        url: str,
        kind: Kind,
        weights_dir: Path,
        max_context: int,
        timeout_s: float = 300.0,
    ) -> None:
        self.config = config
        self.policy = PolicySpec.resolve(config, max_context=max_context)
        if self.policy.byte_level:
            raise ValueError(
                f"preset {config.model.source!r} speaks Crucible's byte-level format: "
                "no external engine serves it"
            )
        if config.agent.driver != "builtin":
            raise ValueError(
                "an agent harness drives the replica's own endpoint: "
                "an external engine serves the builtin loop"
            )
        tokenizer, tool_calls = self.policy.tokenizer, self.policy.tool_calls
        assert tokenizer is not None and tool_calls is not None  # a pretrained model's (a preset is refused)
        self.tokenizer = tokenizer
        self.model_config = self.policy.architecture
        self.tool_calls: ToolCallGrammar = tool_calls
        self.max_context = self.policy.max_context
        self.kind = kind
        self.weights_dir = Path(weights_dir)
        self.client = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s)
        self._version = -1
        self._gate = _Gate()
        self._loading = asyncio.Lock()

    @property
    def version(self) -> int:
        return self._version

    async def load(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Write `version` where the server reads it, and have the server load it between requests."""
        async with self._loading:
            if version <= self._version:
                return
            path = self.weights_dir / f"v{version:06d}"
            await asyncio.to_thread(export_weights, state_dict, self.model_config, path)
            async with self._gate.reload():
                await RELOAD[self.kind](self.client, str(path.resolve()), version)
                self._version = version
            for old in self.weights_dir.glob("v*"):
                if old != path:
                    shutil.rmtree(old, ignore_errors=True)

    async def aclose(self) -> None:
        await self.client.aclose()

    def new_episode(self, *, greedy: bool = False) -> EpisodeState:
        if self._version < 0:
            raise RuntimeError("no weights loaded yet")
        return EpisodeState(greedy=greedy)

    def release(self, state: EpisodeState) -> None:
        pass

    async def finish(self, state: EpisodeState) -> None:
        pass

    async def _complete(
        self, state: EpisodeState, budget: int, lark: str | None, generator
    ) -> tuple[Completion, int]:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        temperature = 0.0 if state.greedy else self.config.agent.temperature
        max_tokens = min(budget, self.max_context - len(state) - 1)
        async with self._gate.request():
            version = self._version
            completion = await SAMPLE[self.kind](
                self.client, list(state.tokens), max_tokens=max_tokens, temperature=temperature,
                seed=seed, lark=lark,
            )  # fmt: skip
        if len(completion.tokens) != len(completion.logprobs) or len(completion.tokens) > max_tokens:
            raise ExternalEngineError(
                f"{len(completion.tokens)} tokens with {len(completion.logprobs)} logprobs "
                f"for at most {max_tokens}"
            )
        if completion.versions is not None and any(v != version for v in completion.versions):
            raise ExternalEngineError(
                f"tokens of versions {sorted(set(completion.versions))}, expected {version}"
            )
        if any(not 0 <= t < self.model_config.vocab_size for t in completion.tokens):
            raise ExternalEngineError("token ids outside the model's vocabulary")
        return completion, version

    async def sample_action(self, state: EpisodeState, *, generator: torch.Generator):
        raise NotImplementedError("the byte-level format is sampled in process only")

    def _record(self, state: EpisodeState, completion: Completion, version: int, constraint: int) -> bool:
        """Append the sampled tokens; True if the completion ended at the end of turn (appended as an
        environment token where the engine left it out of its token ids)."""
        eos = self.tokenizer.eos_token_id
        for token, logprob in zip(completion.tokens, completion.logprobs, strict=True):
            state.append_sampled(token, logprob, version, constraint)
        if completion.finish != "stop":
            return False
        if not completion.tokens or completion.tokens[-1] != eos:
            state.append_env([eos], version, part="actions")
        return True

    async def sample_tool_call(
        self, state: EpisodeState, *, generator: torch.Generator
    ) -> tuple[str | None, dict | None, bool]:
        """As PolicyEngine.sample_tool_call: one call under the grammar, closed by the end of turn."""
        if len(state) + 2 >= self.max_context:
            return None, None, True
        budget, lark = self.config.agent.max_action_tokens, self.tool_calls.lark
        completion, version = await self._complete(state, budget, lark, generator)
        if self._record(state, completion, version, grammar.TOOL_CALL):
            try:
                return (*self.tool_calls.parse(self.tokenizer.decode(completion.tokens)), False)
            except ToolCallError:
                return None, None, False  # the grammar holds a call to this; an engine that ignored it
        if len(state) + 2 >= self.max_context:
            return None, None, True
        # the budget ran out before the call closed
        state.append_env([self.tokenizer.eos_token_id], version, part="actions")
        return None, None, False

    async def sample_summary(self, state: EpisodeState, *, generator: torch.Generator) -> str:
        """As PolicyEngine.sample_summary, for a pretrained model: free text closed by the end of turn."""
        eos = self.tokenizer.eos_token_id
        text: list[int] = []
        if len(state) + 2 < self.max_context:
            budget = self.config.agent.max_summary_tokens
            completion, version = await self._complete(state, budget, None, generator)
            text = [t for t in completion.tokens if t != eos]
            if self._record(state, completion, version, grammar.FREE):
                return self.tokenizer.decode(text, skip_special_tokens=True)
        state.append_env([eos], self.version, part="actions")
        return self.tokenizer.decode(text, skip_special_tokens=True)
