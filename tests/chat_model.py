"""A chat model built here (no download): a byte-level BPE tokenizer trained on a small corpus, with a
chat template and an end of turn, and a random Llama over its vocabulary."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "calc/ops.py"}}\n</tool_call>',
    '<tool_call>\n{"name": "replace", "arguments": {"path": "a.py", "old": "a - b", "new": "a + b"}}\n'
    "</tool_call>",
    "Fix the bug in add() so that the tests pass. The user asks; the assistant answers.",
] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def chat_tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tiny_llama(tokenizer, *, seed: int = 0, max_positions: int = 2048) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=max_positions,
        initializer_range=0.5,
        eos_token_id=tokenizer.eos_token_id,
    )
    return transformers.LlamaForCausalLM(config).eval()


def save_chat_model(path: Path, *, max_positions: int = 2048) -> Path:
    """A Hugging Face checkpoint directory (weights, config, tokenizer with its template)."""
    tokenizer = chat_tokenizer()
    tiny_llama(tokenizer, max_positions=max_positions).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
