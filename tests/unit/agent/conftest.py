"""A chat tokenizer trained here (no download), shared by the agent's tests."""

from __future__ import annotations

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "calc/ops.py"}}\n</tool_call>',
    '<tool_call>\n{"name": "replace", "arguments": {"path": "a.py", "old": "a - b", "new": "a + b"}}\n</tool_call>',
    "Fix the bug in add() so that the tests pass. The user asks; the assistant answers.",
] * 20


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here (no download), with a chat template and an end of turn."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    wrapped.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return wrapped
