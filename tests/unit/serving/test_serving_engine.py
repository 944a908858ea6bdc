"""The serving engine in process: weights swapped during a generation, a generation abandoned, top-p, and
the model's own malformed tool calls left as text."""

from __future__ import annotations

from contextlib import aclosing

import pytest
import torch
from chat_model import chat_tokenizer, tiny_llama

from crucible.model.hf import from_transformers
from crucible.serving.app import parse_tool_calls
from crucible.serving.engine import (
    Finished,
    RequestError,
    Sampled,
    SamplingParams,
    ServingEngine,
    distribution,
)

TOOLS = [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.fixture
def engine(tokenizer):
    engine = ServingEngine(
        model=from_transformers(tiny_llama(tokenizer, seed=0)), tokenizer=tokenizer, name="t", max_context=128
    )
    yield engine
    engine.close()


async def test_a_swap_mid_generation_changes_the_version_of_the_tokens_after_it(engine, tokenizer) -> None:
    other = from_transformers(tiny_llama(tokenizer, seed=1))
    versions, solo = [], []
    params = SamplingParams(max_tokens=40, temperature=0)
    async for event in engine.generate([5, 6, 7], params):
        if isinstance(event, Sampled):
            solo.append(event.token)
    async with aclosing(engine.generate([5, 6, 7], params)) as events:
        async for event in events:
            if isinstance(event, Finished):
                break
            versions.append(event.version)
            if len(versions) == 3:
                engine.swap(other, 1)
    assert versions[:3] == [0, 0, 0] and versions[-1] == 1 and versions == sorted(versions)
    assert engine.batcher.residents == 0
    # the old weights are gone for new requests; the new ones answer as the new model does
    fresh = [e.token async for e in engine.generate([5, 6, 7], params) if isinstance(e, Sampled)]
    with torch.no_grad():
        expected = other(torch.tensor([[5, 6, 7]])).logits[0, -1].argmax()
    assert fresh[0] == int(expected)


async def test_leaving_a_generation_early_frees_its_slot(engine) -> None:
    async with aclosing(engine.generate([1, 2, 3], SamplingParams(max_tokens=100))) as events:
        async for event in events:
            assert isinstance(event, Sampled)
            assert engine.batcher.residents == 1
            break
    assert engine.batcher.residents == 0


async def test_over_the_context_is_a_request_error(engine) -> None:
    with pytest.raises(RequestError, match="context"):
        async for _ in engine.generate(list(range(1, 200)), SamplingParams()):
            pass
    with pytest.raises(RequestError, match="empty"):
        async for _ in engine.generate([], SamplingParams()):
            pass
    # max_tokens past the context ends the completion at the context, as "length"
    events = [
        e async for e in engine.generate(list(range(1, 120)), SamplingParams(max_tokens=1000, temperature=0))
    ]
    assert isinstance(events[-1], Finished) and len(events) - 1 <= 128 - 119
    assert events[-1].reason == "length" or events[-2].token == engine.tokenizer.eos_token_id


def test_top_p_keeps_the_smallest_set_over_p_and_renormalises() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    logp = distribution(logits, SamplingParams(temperature=1.0, top_p=0.75), None)
    assert torch.allclose(logp.exp(), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    allowed = torch.tensor([False, True, True, True])  # a grammar first, then top-p over what it allows
    logp = distribution(logits, SamplingParams(temperature=1.0, top_p=0.6), allowed)
    assert torch.allclose(logp.exp(), torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_the_models_own_tool_calls_parse_only_when_well_formed() -> None:
    content, calls = parse_tool_calls(
        'Looking.\n<tool_call>\n{"name": "grep", "arguments": {"pattern": "add"}}\n</tool_call>', TOOLS
    )
    assert content == "Looking." and calls[0]["function"] == {
        "name": "grep",
        "arguments": '{"pattern": "add"}',
    }
    for text in (
        "no call at all",
        '<tool_call>\n{"name": "grep", "arguments": {"pattern": "a"\n</tool_call>',  # malformed JSON
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not a given tool
        '<tool_call>\n{"name": "grep", "arguments": {}}',  # never closed
        '<tool_call>\n["grep"]\n</tool_call>',
    ):
        assert parse_tool_calls(text, TOOLS) is None, text
