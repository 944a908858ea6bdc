"""`crucible serve` driven by the official `openai` client: chat and text completions, tools under the
grammar, logprobs that equal the model's own, streaming, Crucible's token-id extensions, and bad
requests answered with a 400 while the server goes on serving."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from chat_model import save_chat_model
from crucible_serve import crucible_serve

from crucible.agent.toolcalls import render_text
from crucible.model.hf import load_pretrained

MAX_POSITIONS = 1024
MESSAGES = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "Fix add() in calc/ops.py."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string", "maxLength": 12}},
                "required": [arg],
            },
        },
    }
    for name, description, arg in (
        ("read_file", "Read a file.", "path"),
        ("grep", "Search the code.", "pattern"),
    )
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("chat") / "hf", max_positions=MAX_POSITIONS)


@pytest.fixture(scope="module")
def base_url(checkpoint: Path) -> Iterator[str]:
    with crucible_serve(str(checkpoint), "--name", "tiny-chat", "--threads", "1") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    model = load_pretrained(checkpoint).eval()
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(checkpoint)
    return model, tokenizer


def model_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] log-softmax of the model at each completion position (one full forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_greedy_chat_equals_the_model_with_its_logprobs(client, reference) -> None:
    model, tokenizer = reference
    response = client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3
    )
    choice = response.choices[0]
    prompt, tokens = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    assert prompt == tokenizer.encode(render_text(tokenizer, MESSAGES, tools=[]), add_special_tokens=False)
    assert 1 <= len(tokens) <= 12 and choice.finish_reason in ("stop", "length")
    logp = model_logprobs(model, prompt, tokens)
    assert tokens == logp.argmax(-1).tolist()  # greedy, one token at a time == one full forward
    recorded = torch.tensor([entry.logprob for entry in choice.logprobs.content])
    assert torch.allclose(recorded, logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-4)
    assert all(
        len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == entry.logprob
        for entry in choice.logprobs.content
    )
    assert choice.model_extra["policy_versions"] == [0] * len(tokens)
    assert choice.message.content == tokenizer.decode(tokens, skip_special_tokens=True)
    assert response.usage.completion_tokens == len(tokens) and response.usage.prompt_tokens == len(prompt)


def test_sampled_completions_are_seeded_and_their_logprobs_are_the_sampled_distribution(
    client, reference
) -> None:
    model, tokenizer = reference
    prompt = [5, 17, 42, 99, 7, 3]  # token in
    kwargs = dict(model="tiny-chat", prompt=prompt, n=3, temperature=0.7, seed=11, max_tokens=8, logprobs=2)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert len(first.choices) == 3
    outs = [c.model_extra["token_ids"] for c in first.choices]
    assert outs == [c.model_extra["token_ids"] for c in again.choices]  # same seed, same tokens
    assert len({tuple(o) for o in outs}) > 1  # the n choices are sampled apart
    for choice, tokens in zip(first.choices, outs, strict=True):
        assert choice.model_extra["prompt_token_ids"] == prompt
        logp = torch.log_softmax(model_logprobs(model, prompt, tokens) / 0.7, dim=-1)  # temperature applied
        expected = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs), expected, atol=1e-4)
        assert choice.text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_stop_strings_cut_the_text(client) -> None:
    full = client.completions.create(model="tiny-chat", prompt="Fix the bug", temperature=0, max_tokens=16)
    text = full.choices[0].text
    assert len(text) >= 6, text
    stop = text[3:6]
    cut = client.completions.create(
        model="tiny-chat", prompt="Fix the bug", temperature=0, max_tokens=16, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_required_and_named_tool_calls_parse(client) -> None:
    names = set()
    for seed in range(3):
        response = client.chat.completions.create(
            model="tiny-chat",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            seed=seed,
            max_tokens=120,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        expected = {"read_file": {"path"}, "grep": {"pattern"}}[call.function.name]
        assert set(arguments) == expected and all(len(v) <= 12 for v in arguments.values())
        names.add(call.function.name)
    named = client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, tools=TOOLS, seed=0, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "grep"}},
    )  # fmt: skip
    assert named.choices[0].message.tool_calls[0].function.name == "grep"
    # the conversation goes on with the call and its result in the history
    follow = client.chat.completions.create(
        model="tiny-chat",
        temperature=0,
        max_tokens=4,
        tools=TOOLS,
        messages=[
            *MESSAGES,
            named.choices[0].message.model_dump(exclude_none=True),
            {
                "role": "tool",
                "tool_call_id": named.choices[0].message.tool_calls[0].id,
                "content": "no match",
            },
        ],
    )
    assert (
        follow.choices[0].model_extra["prompt_token_ids"][
            : len(named.choices[0].model_extra["prompt_token_ids"])
        ]
        == named.choices[0].model_extra["prompt_token_ids"]
    )


def test_streaming_gives_the_same_completion(client) -> None:
    kwargs = dict(model="tiny-chat", messages=MESSAGES, temperature=0, max_tokens=16, logprobs=True)
    whole = client.chat.completions.create(**kwargs).choices[0]
    text, ids, logprobs, finish = "", [], [], None
    for chunk in client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    ):
        if not chunk.choices:
            assert chunk.usage.completion_tokens == len(whole.model_extra["token_ids"])
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        ids += choice.model_extra.get("token_ids", [])
        logprobs += [e.logprob for e in (choice.logprobs.content if choice.logprobs else [])]
        finish = choice.finish_reason or finish
    assert text == whole.message.content
    assert ids == whole.model_extra["token_ids"]
    assert logprobs == pytest.approx([e.logprob for e in whole.logprobs.content], abs=1e-6)
    assert finish == whole.finish_reason
    # a streamed tool call arrives whole in the last chunk
    calls = [
        call
        for chunk in client.chat.completions.create(
            model="tiny-chat",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            seed=1,
            max_tokens=120,
            stream=True,
        )
        for choice in chunk.choices
        for call in choice.delta.tool_calls or []
    ]
    assert len(calls) == 1 and calls[0].function.name in ("read_file", "grep")
    json.loads(calls[0].function.arguments)


def test_bad_requests_are_400s_and_the_server_keeps_serving(client, base_url) -> None:
    bad = [
        dict(prompt=list(range(1, MAX_POSITIONS + 5))),  # over the context
        dict(prompt=[1, 2, 10**6]),  # a token the model does not have
        dict(prompt="x", temperature=5),
        dict(prompt="x", n=0),
        dict(prompt="x", echo=True),
    ]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny-chat", **{"max_tokens": 4, **kwargs})
        assert caught.value.body["message"], kwargs
    assert "context" in str(
        _refusal(client.completions.create, model="tiny-chat", prompt=list(range(1, MAX_POSITIONS + 1)))
    )
    for kwargs in (
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "rm_rf"}}),
        dict(tool_choice="required"),  # no tools
        dict(
            messages=[
                *MESSAGES,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "grep", "arguments": "{not json"},
                        }
                    ],
                },
            ]
        ),
        dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        dict(messages=[]),
    ):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="tiny-chat", **{"messages": MESSAGES, "max_tokens": 4, **kwargs}
            )
    raw = httpx.post(
        base_url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert raw.status_code == 400 and "error" in raw.json()
    huge = httpx.post(base_url + "/completions", json={"prompt": "x", "model": "m" * 100_000})
    assert huge.status_code == 400 and len(huge.text) < 2000  # the input is not echoed back
    assert (
        client.completions.create(model="tiny-chat", prompt="Fix", max_tokens=3)
        .choices[0]
        .model_extra["token_ids"]
    )


def _refusal(call, **kwargs) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        call(**kwargs)
    return caught.value.body["message"]


def test_a_client_gone_mid_stream_frees_its_sequence(base_url) -> None:
    root = base_url.removesuffix("/v1")
    body = {
        "model": "tiny-chat",
        "prompt": "Fix the bug",
        "max_tokens": 200,
        "temperature": 1.0,
        "stream": True,
    }
    with httpx.stream("POST", base_url + "/completions", json=body, timeout=30) as stream:
        first = next(stream.iter_lines())
        assert first.startswith("data: {")
    deadline = time.monotonic() + 30
    while httpx.get(root + "/health").json()["sequences"] != 0:
        assert time.monotonic() < deadline, "the abandoned sequence kept its slot"
    reply = httpx.post(base_url + "/completions", json={**body, "stream": False, "max_tokens": 4})
    assert reply.status_code == 200 and reply.json()["choices"][0]["token_ids"]
