"""A chat tokenizer trained here (no download), shared by the agent's tests."""

from __future__ import annotations

import pytest
import transformers
from chat_model import chat_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here (no download), with a chat template and an end of turn."""
    return chat_tokenizer()
