"""Tool calls in a real tokenizer's format under the JSON-schema grammar: every sampled action parses,
and the trainer's replayed masks give exactly the logprobs the sampler recorded."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from crucible.agent.grammar import masked_logprobs
from crucible.agent.toolcalls import (
    TOOLS,
    ToolCallError,
    ToolCallGrammar,
    render_prompt,
)
from crucible.model.hf import from_transformers
from crucible.model.scoring import unpack_allowed


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=2048, initializer_range=0.5,
    )  # fmt: skip
    return from_transformers(transformers.LlamaForCausalLM(config).eval())


def sample_action(
    model, grammar: ToolCallGrammar, prompt: list[int], *, seed: int
) -> tuple[list[int], list[float]]:
    """The sampler's loop: each token from the masked distribution, its logprob recorded."""
    generator = torch.Generator().manual_seed(seed)
    matcher = grammar.matcher()
    cache = model.new_cache(batch_size=1, max_len=len(prompt) + 400)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache).logits[0, -1]
        tokens, logprobs = [], []
        while True:
            logp = masked_logprobs(logits, grammar.allowed(matcher))
            token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            tokens.append(token)
            logprobs.append(float(logp[token]))
            if token == grammar.tokenizer.eos_token_id:
                return tokens, logprobs
            grammar.advance(matcher, token)
            logits = model(torch.tensor([[token]]), cache=cache).logits[0, -1]


def test_sampled_actions_parse_and_replay_to_the_recorded_logprobs(tokenizer, model) -> None:
    grammar = ToolCallGrammar(tokenizer, vocab_size=model.cfg.vocab_size, max_chars=12)
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "Fix add()."}])
    assert "<tools>" in tokenizer.decode(
        prompt
    )  # this template does not render tools: the system message does
    names = set()
    for seed in range(4):
        action, recorded = sample_action(model, grammar, prompt, seed=seed)
        name, arguments = grammar.parse(tokenizer.decode(action))
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        assert set(arguments) == set(schema["properties"])
        assert all(isinstance(v, str) and len(v) <= 12 for v in arguments.values())
        names.add(name)
        # the trainer's side: one forward over prompt + action, masks replayed from the sampled tokens
        sequence = prompt + action
        constrained = [False] * len(prompt) + [True] * len(action)
        masks = unpack_allowed(grammar.replay(sequence, constrained), grammar.vocab_size)
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0, len(prompt) - 1 : -1]
        logp = masked_logprobs(logits, masks).gather(-1, torch.tensor(action)[:, None])[:, 0]
        assert torch.allclose(logp, torch.tensor(recorded), atol=1e-4)
    assert len(names) >= 2, names  # the grammar does not force one tool


def test_the_grammar_refuses_what_the_schema_does_not_allow(tokenizer) -> None:
    grammar = ToolCallGrammar(tokenizer)
    bad = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    matcher = grammar.matcher()
    with pytest.raises(ToolCallError, match="not allowed"):
        for token in tokenizer.encode(bad, add_special_tokens=False):
            grammar.advance(matcher, token)
    with pytest.raises(ToolCallError, match="not a tool call"):
        grammar.parse("I think the bug is in add().")
    assert grammar.parse('<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call><|end|>') == (
        "submit",
        {},
    )


def test_a_tokenizer_without_a_chat_template_is_a_clear_error(tokenizer) -> None:
    bare = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|end|>"
    )
    with pytest.raises(ToolCallError, match="no chat template"):
        render_prompt(bare, [{"role": "user", "content": "x"}])


def test_a_template_that_renders_tools_gets_them_natively(tokenizer) -> None:
    native = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|end|>"
    )
    native.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}</tools>{% endif %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|end|>{% endfor %}<assistant>"
    )
    text = native.decode(render_prompt(native, [{"role": "user", "content": "x"}]))
    assert text.startswith("<tools>read_file") and "You may call" not in text
    assert json.dumps(TOOLS[0]) not in text


@pytest.mark.slow
def test_smollm2_asked_to_fix_a_bug_answers_with_a_valid_tool_call() -> None:
    from crucible.model.hf import load_pretrained
    from crucible.model.sources import package_file

    path = package_file("smollm2-135m-instruct")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = load_pretrained(path)
    grammar = ToolCallGrammar(tokenizer, vocab_size=model.cfg.vocab_size, max_chars=64)
    prompt = render_prompt(
        tokenizer, [{"role": "user", "content": "The function add in calc/ops.py is wrong. Look at it."}]
    )
    action, recorded = sample_action(model, grammar, prompt, seed=0)
    name, _arguments = grammar.parse(tokenizer.decode(action))
    assert name in {t["function"]["name"] for t in TOOLS} and len(recorded) == len(action)


def test_a_model_vocabulary_smaller_than_the_tokenizer_s_is_refused(tokenizer) -> None:
    with pytest.raises(ToolCallError, match="smaller than the tokenizer's"):
        ToolCallGrammar(tokenizer, vocab_size=len(tokenizer) - 10)
