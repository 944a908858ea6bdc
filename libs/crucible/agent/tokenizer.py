"""Byte-level tokenizer: ids 0-255 are UTF-8 bytes, 256-319 are special tokens.

Byte-level keeps the vocabulary tiny and makes every string representable, which suits a small policy
trained from scratch. The tool tokens let the agent name a tool in one token.
"""

from __future__ import annotations

from crucible.contracts.runconfig import AGENT_TOOLS as TOOLS

NO_ARGUMENT_TOOLS: frozenset[str] = frozenset({"submit"})
"""Tools that take no argument: their action is `<tool:NAME> <end>`, the `<end>` added by the environment,
so the policy samples (and is trained on) only the tool token."""

VOCAB_SIZE = 320
PAD, BOS, EOS, OBS, ACT, END = 256, 257, 258, 259, 260, 261
TOOL_BASE = 262

SPECIAL_NAMES: dict[int, str] = {
    PAD: "<pad>",
    BOS: "<bos>",
    EOS: "<eos>",
    OBS: "<obs>",
    ACT: "<act>",
    END: "<end>",
    **{TOOL_BASE + i: f"<tool:{name}>" for i, name in enumerate(TOOLS)},
}


def tool_token(name: str) -> int:
    return TOOL_BASE + TOOLS.index(name)


def tool_name(token: int) -> str | None:
    index = token - TOOL_BASE
    return TOOLS[index] if 0 <= index < len(TOOLS) else None


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: list[int], *, specials: bool = True) -> str:
    """Bytes back to text (invalid UTF-8 replaced); specials rendered by name, or dropped."""
    out: list[str] = []
    run = bytearray()
    for token in tokens:
        if token < 256:
            run.append(token)
            continue
        if run:
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
        if specials:
            out.append(SPECIAL_NAMES.get(token, f"<special:{token}>"))
    if run:
        out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)
