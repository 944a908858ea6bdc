"""What the policy sees of a long tool output: its head and its tail, within the budget."""

from __future__ import annotations

from crucible.agent import tokenizer
from crucible.agent.episode import clip, observation

NOISY_RUN = (
    "plugin.py:306: PytestDeprecationWarning: an option is unset. " * 40
    + "\nFAILED tests/test_ops.py::test_add - assert 1 == 3\n1 failed, 8 passed in 0.05s\n"
)


def test_a_long_output_keeps_its_head_and_its_verdict() -> None:
    seen = clip(NOISY_RUN, 300)
    assert len(seen) == 300 and seen.startswith("plugin.py:306")
    assert seen.endswith("1 failed, 8 passed in 0.05s\n") and "\n...\n" in seen
    assert clip("short", 300) == "short" and clip("abcdef", 3) == "\n.."


def test_a_byte_level_observation_is_clipped_byte_for_byte() -> None:
    tokens = observation("é" * 100 + " the end", limit=40)
    assert tokens[0] == tokenizer.OBS and len(tokens) == 41
    # the head is 18 of the 35 bytes the marker leaves: nine two-byte characters
    assert bytes(tokens[1:]).endswith(b"the end") and bytes(tokens[1:19]) == "é".encode() * 9
