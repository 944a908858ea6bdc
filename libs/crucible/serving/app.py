"""The OpenAI-compatible HTTP API over a ServingEngine: `/v1/chat/completions`, `/v1/completions`,
`/v1/models`, with streaming (server-sent events), tools and logprobs.

Tools: with `tool_choice` "required" or a named function, the call is decoded under the tools' JSON-schema
grammar (crucible.agent.toolcalls), so it always parses; with "auto" the model writes freely and a
`<tool_call>{...}</tool_call>` block in its answer becomes `tool_calls` (a block that is not valid JSON
naming a given tool stays text). Crucible's extensions, on every choice (and on streamed chunks):
`token_ids` (the completion's), `policy_versions` (per token, the weights that sampled it) and
`prompt_token_ids` (what the model was fed), so that a caller can record an episode token-in-token-out.
A logprob is that of the distribution the token was drawn from (see crucible.serving.engine).

For rollouts that drive an external engine (services.rollout.external), the server also speaks that
client's two dialects: vLLM's `structured_outputs: {"grammar": ...}` on `/v1/completions`, and SGLang's
native `/generate` (token ids in and out) and `/update_weights_from_disk` (with `--weights-dir`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from crucible.agent.toolcalls import CLOSE, OPEN, ToolCallError, ToolCallGrammar, render_text
from crucible.serving.engine import Finished, RequestError, Sampled, SamplingParams, ServingEngine
from crucible.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    Message,
    NamedToolChoice,
    UpdateWeightsRequest,
)


def create_app(engine: ServingEngine, *, weights_dir: Path | None = None) -> FastAPI:
    """The API over `engine`; with `weights_dir`, `/update_weights_from_disk` loads checkpoints from
    under that directory (and nowhere else)."""
    app = FastAPI(title="Crucible OpenAI-compatible API", version="1")
    openai_errors(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": engine.name,
            "version": engine.version,
            "sequences": engine.batcher.residents,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": engine.name,
            "object": "model",
            "created": 0,
            "owned_by": "crucible",
            "max_model_len": engine.max_context,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if body.echo:
            raise RequestError("echo is not supported", param="echo")
        prompts = _completion_prompts(engine, body.prompt)
        for prompt in prompts:
            engine.check_prompt(prompt)
        params = SamplingParams(
            max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
            top_logprobs=body.logprobs or 0, seed=body.seed,
        )  # fmt: skip
        grammar = None
        if body.structured_outputs is not None:
            lark = body.structured_outputs.grammar
            if lark is None:
                raise RequestError("structured_outputs names no grammar", param="structured_outputs")
            grammar = await asyncio.to_thread(engine.lark_grammar, lark, param="structured_outputs.grammar")
        jobs = [
            _Job(engine, prompt, _seeded(params, i * body.n + j), body.stops(), grammar)
            for i, prompt in enumerate(prompts)
            for j in range(body.n)
        ]
        reply = _Reply("text_completion", engine.name)
        if body.stream:
            return _sse(_stream_completion(reply, jobs, body.logprobs is not None, _usage_wanted(body)))
        await asyncio.gather(*(job.collect() for job in jobs))
        choices = [
            _completion_choice(engine, i, job, body.logprobs is not None) for i, job in enumerate(jobs)
        ]
        return reply.body(choices, usage=_usage(prompts, jobs))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        # rendering and a first compile of the tools' grammar take a while: off the event loop
        prompt, grammar, tools = await asyncio.to_thread(_chat_prompt, engine, body)
        engine.check_prompt(prompt)
        params = SamplingParams(
            max_tokens=body.max_completion_tokens or body.max_tokens, temperature=body.temperature,
            top_p=body.top_p, top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0, seed=body.seed,
        )  # fmt: skip
        hold = OPEN.strip() if tools and grammar is None else None
        jobs = [_Job(engine, prompt, _seeded(params, j), body.stops(), grammar, hold) for j in range(body.n)]
        reply = _Reply("chat.completion", engine.name)
        if body.stream:
            return _sse(_stream_chat(reply, jobs, grammar, tools, body.logprobs, _usage_wanted(body)))
        await asyncio.gather(*(job.collect() for job in jobs))
        choices = [_chat_choice(engine, i, job, grammar, tools, body.logprobs) for i, job in enumerate(jobs)]
        return reply.body(choices, usage=_usage([prompt], jobs))

    @app.post("/generate")
    async def generate(body: GenerateRequest) -> dict[str, Any]:
        """SGLang's native generation, token ids in and out (with Crucible's per-token versions)."""
        sampling = body.sampling_params
        engine.check_prompt(body.input_ids)
        grammar = None
        if sampling.ebnf is not None:
            grammar = await asyncio.to_thread(
                engine.lark_grammar, sampling.ebnf, param="sampling_params.ebnf"
            )
        params = SamplingParams(
            max_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            seed=sampling.sampling_seed,
        )  # fmt: skip
        job = _Job(engine, body.input_ids, params, [], grammar)
        await job.collect()
        ids = [s.token for s in job.sampled]
        if not sampling.no_stop_trim and ids and ids[-1] == engine.tokenizer.eos_token_id:
            ids = ids[:-1]  # SGLang leaves the stop token out unless asked to keep it
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": {"type": job.finish},
            "prompt_tokens": len(body.input_ids),
            "completion_tokens": len(job.sampled),
            "weight_version": str(job.sampled[0].version if job.sampled else engine.version),
            "policy_versions": [s.version for s in job.sampled][: len(ids)],
        }
        if body.return_logprob:
            meta["output_token_logprobs"] = [[s.logprob, s.token, None] for s in job.sampled][: len(ids)]
        text = engine.tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens)
        return {"text": text, "output_ids": ids, "meta_info": meta}

    reload_lock = asyncio.Lock()

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsRequest) -> dict[str, Any]:
        """SGLang's weight reload: a Hugging Face checkpoint directory under the server's weights
        directory becomes the served weights, as `weight_version` (default: the next one)."""
        if weights_dir is None:
            raise RequestError(
                "this server was started without --weights-dir: it loads no weights", param="model_path"
            )
        root = weights_dir.resolve()
        path = Path(body.model_path).resolve()
        if not path.is_relative_to(root):
            raise RequestError("model_path is not under the server's weights directory", param="model_path")
        try:
            version = engine.version + 1 if body.weight_version is None else int(body.weight_version)
        except ValueError:
            raise RequestError("weight_version must be an integer", param="weight_version") from None
        async with reload_lock:
            await asyncio.to_thread(engine.reload, str(path), version)
        return {"success": True, "message": f"loaded version {version}", "num_paused_requests": 0}

    return app


def openai_errors(app: FastAPI) -> None:
    """Bad requests answered as the OpenAI API does: a 400 with {"error": {"message", "param", ...}}."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])  # never the input: it may be huge
        return _error(f"{where}: {first.get('msg', 'invalid request')}"[:1000], param=where or None)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return _error(str(exc), param=exc.param)


def _error(message: str, *, param: str | None = None, status: int = 400) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={
            "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
        },
    )


# --- prompts ---


def _completion_prompts(engine: ServingEngine, prompt: Any) -> list[list[int]]:
    """A string, a list of token ids, or a list of either: one prompt per entry."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    return [
        engine.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
        for p in prompt
    ]


def _chat_prompt(
    engine: ServingEngine, body: ChatCompletionRequest
) -> tuple[list[int], ToolCallGrammar | None, list[dict]]:
    """The rendered conversation's token ids, the grammar its answer is decoded under (None: free), and
    the tools an answer may call."""
    tools = [tool.model_dump() for tool in body.tools or []]
    choice = body.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise RequestError("tool_choice asks for a tool call but no tools were given", param="tool_choice")
    callable_tools = [] if choice == "none" else tools
    if isinstance(choice, NamedToolChoice):
        callable_tools = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not callable_tools:
            raise RequestError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
    messages = [template_message(i, m) for i, m in enumerate(body.messages)]
    try:
        text = render_text(engine.tokenizer, messages, tools=tools)
    except ToolCallError as exc:
        raise RequestError(str(exc), param="messages") from None
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    grammar = engine.tool_grammar(callable_tools) if forced else None
    return prompt, grammar, callable_tools


def template_message(index: int, message: Message) -> dict[str, str]:
    """An API message as the chat template takes it: text content, assistant tool calls in the
    `<tool_call>` format the model writes them in."""
    content = message.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise RequestError("only text content parts are supported", param=f"messages.{index}.content")
        content = "".join(part.text or "" for part in content)
    content = content or ""
    for call in message.tool_calls or []:
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except ValueError:
            raise RequestError(
                "tool call arguments are not JSON", param=f"messages.{index}.tool_calls"
            ) from None
        content += OPEN + json.dumps({"name": call.function.name, "arguments": arguments}) + CLOSE
    return {"role": "system" if message.role == "developer" else message.role, "content": content}


# --- generation ---


@dataclass
class _Delta:
    text: str
    sampled: list[Sampled]


@dataclass(eq=False)
class _Job:
    """One choice: its prompt, sampling, and what it produced."""

    engine: ServingEngine
    prompt: list[int]
    params: SamplingParams
    stops: list[str]
    grammar: ToolCallGrammar | None = None
    hold: str | None = None  # text from this marker on is held back from the stream (a tool call)
    sampled: list[Sampled] = field(default_factory=list)
    text: str = ""
    finish: str = "stop"
    streamed: int = 0  # characters of `text` handed out as deltas

    async def deltas(self) -> AsyncIterator[_Delta]:
        """The completion's text as it grows (held back while it may be the start of a stop string or a
        held marker, or an incomplete UTF-8 character); the job holds the whole when it ends."""
        tokenizer, pending = self.engine.tokenizer, []
        async with aclosing(self.engine.generate(self.prompt, self.params, grammar=self.grammar)) as events:
            async for event in events:
                if isinstance(event, Finished):
                    self.finish = event.reason
                    break
                self.sampled.append(event)
                pending.append(event)
                text = tokenizer.decode([s.token for s in self.sampled], skip_special_tokens=True)
                stop = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
                if stop >= 0:
                    self.text, self.finish = text[:stop], "stop"
                    break
                self.text = text
                safe = len(text) - _held(text, [*self.stops, *([self.hold] if self.hold else [])])
                if self.hold and self.hold in text:
                    safe = min(safe, text.index(self.hold))
                if text.endswith("\ufffd"):
                    safe = min(safe, len(text) - 1)
                if safe > self.streamed:
                    yield _Delta(text[self.streamed : safe], pending)
                    self.streamed, pending = safe, []
        if self.hold and self.hold in self.text:
            if pending:
                yield _Delta("", pending)
            return  # the caller decides what the held text is
        if len(self.text) > self.streamed or pending:
            yield _Delta(self.text[self.streamed :], pending)
            self.streamed = len(self.text)

    async def collect(self) -> None:
        async for _ in self.deltas():
            pass


def _held(text: str, markers: list[str]) -> int:
    """Length of the longest end of `text` that begins one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def _seeded(params: SamplingParams, offset: int) -> SamplingParams:
    if params.seed is None or offset == 0:
        return params
    return SamplingParams(**{**params.__dict__, "seed": (params.seed + offset) % 2**63})


def parse_tool_calls(text: str, tools: list[dict]) -> tuple[str | None, list[dict]] | None:
    """(content before the calls, calls) when `text` holds closed `<tool_call>` blocks naming given tools
    with JSON object arguments; None otherwise (the text stays text)."""
    opening, closing = OPEN.strip(), CLOSE.strip()
    names = {t["function"]["name"] for t in tools}
    head, found, rest = text.partition(opening)
    if not found:
        return None
    calls = []
    for block in rest.split(opening):
        body, closed, _ = block.partition(closing)
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        if not closed or name not in names or not isinstance(arguments, dict):
            return None
        calls.append(tool_call(name, arguments))
    return head.strip() or None, calls


def tool_call(name: str, arguments: dict) -> dict:
    """A tool call as the API returns it."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _chat_outcome(
    job: _Job, grammar: ToolCallGrammar | None, tools: list[dict]
) -> tuple[str | None, list[dict] | None, str]:
    """(content, tool_calls, finish_reason) of a finished chat job."""
    if (
        grammar is not None
        and job.finish == "stop"
        and job.sampled
        and job.sampled[-1].token == job.engine.tokenizer.eos_token_id
    ):
        try:
            name, arguments = grammar.parse(job.text)
            return None, [tool_call(name, arguments)], "tool_calls"
        except ToolCallError:  # cut by a stop string: the text stays text
            pass
    parsed = parse_tool_calls(job.text, tools) if tools and grammar is None else None
    if parsed is not None:
        content, calls = parsed
        return content, calls, "tool_calls"
    return job.text, None, job.finish


# --- responses ---


@dataclass
class _Reply:
    object: str
    model: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, choices: list[dict], *, usage: dict | None = None, chunk: bool = False) -> dict[str, Any]:
        out = {
            "id": self.id,
            "object": self.object + (".chunk" if chunk else ""),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return out


def _usage(prompts: list[list[int]], jobs: list[_Job]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(job.sampled) for job in jobs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _usage_wanted(body: Any) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _extensions(sampled: list[Sampled]) -> dict[str, list[int]]:
    return {"token_ids": [s.token for s in sampled], "policy_versions": [s.version for s in sampled]}


def _piece(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(tokenizer: Any, sampled: list[Sampled]) -> dict[str, list]:
    """A chat choice's `logprobs`: per token its text, logprob, bytes and alternatives."""

    def entry(token: int, logprob: float) -> dict:
        text = _piece(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]} for s in sampled
        ]
    }


def _completion_logprobs(engine: ServingEngine, sampled: list[Sampled], offset: int = 0) -> dict[str, list]:
    tokens = [_piece(engine.tokenizer, s.token) for s in sampled]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [s.logprob for s in sampled],
        "top_logprobs": [{_piece(engine.tokenizer, t): lp for t, lp in s.top} for s in sampled],
        "text_offset": offsets,
    }


def _chat_choice(engine, index, job, grammar, tools, logprobs) -> dict:
    content, calls, finish = _chat_outcome(job, grammar, tools)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(engine.tokenizer, job.sampled) if logprobs else None,
        "finish_reason": finish,
        "prompt_token_ids": job.prompt,
        **_extensions(job.sampled),
    }


def _completion_choice(engine, index, job, logprobs) -> dict:
    return {
        "index": index,
        "text": job.text,
        "logprobs": _completion_logprobs(engine, job.sampled) if logprobs else None,
        "finish_reason": job.finish,
        "prompt_token_ids": job.prompt,
        **_extensions(job.sampled),
    }


# --- streaming ---


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except RequestError as exc:
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'invalid_request_error'}})}\n\n"
        except RuntimeError as exc:  # the model failed mid-stream: say so, then end the stream
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


async def _merged(jobs: list[_Job]) -> AsyncIterator[tuple[int, _Delta | None]]:
    """Every job's deltas as they come, tagged with its index; (index, None) when a job ends."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, job: _Job) -> None:
        try:
            async for delta in job.deltas():
                await queue.put((index, delta))
            await queue.put((index, None))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        for _ in range(len(jobs)):
            while True:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield index, item
                if item is None:
                    break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream_chat(reply, jobs, grammar, tools, logprobs, usage) -> AsyncIterator[dict]:
    engine = jobs[0].engine
    for i, job in enumerate(jobs):
        first = {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        yield reply.body([{**first, "prompt_token_ids": job.prompt}], chunk=True)
    async for i, delta in _merged(jobs):
        job = jobs[i]
        if delta is not None:
            text = "" if grammar is not None else delta.text
            chunk = {
                "index": i, "delta": {"content": text},
                "logprobs": chat_logprobs(engine.tokenizer, delta.sampled) if logprobs else None,
                "finish_reason": None, **_extensions(delta.sampled),
            }  # fmt: skip
            yield reply.body([chunk], chunk=True)
            continue
        _content, calls, finish = _chat_outcome(job, grammar, tools)
        rest = job.text[job.streamed :] if grammar is None else ""  # what was held back
        end: dict[str, Any] = {"content": rest} if rest else {}
        if calls:
            end = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
            unsent = job.text[job.streamed : job.text.find(OPEN.strip())].strip() if grammar is None else ""
            if unsent:
                end["content"] = unsent
        yield reply.body([{"index": i, "delta": end, "logprobs": None, "finish_reason": finish}], chunk=True)
    if usage:
        yield reply.body([], usage=_usage([jobs[0].prompt], jobs), chunk=True)


async def _stream_completion(reply, jobs, logprobs, usage) -> AsyncIterator[dict]:
    engine = jobs[0].engine
    sent = [0] * len(jobs)
    async for i, delta in _merged(jobs):
        if delta is None:
            yield reply.body(
                [{"index": i, "text": "", "logprobs": None, "finish_reason": jobs[i].finish}], chunk=False
            )
            continue
        chunk = {
            "index": i, "text": delta.text,
            "logprobs": _completion_logprobs(engine, delta.sampled, sent[i]) if logprobs else None,
            "finish_reason": None, **_extensions(delta.sampled),
        }  # fmt: skip
        if sent[i] == 0:
            chunk["prompt_token_ids"] = jobs[i].prompt
        sent[i] += len(delta.text)
        yield reply.body([chunk], chunk=False)
    if usage:
        yield reply.body([], usage=_usage([job.prompt for job in jobs], jobs), chunk=False)
