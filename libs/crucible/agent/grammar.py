"""Constrained decoding for tool calls.

An agent turn is `<act> <tool:NAME> ARGUMENT-BYTES <end>`; for a tool that takes no argument
(`tokenizer.NO_ARGUMENT_TOOLS`) it is `<act> <tool:NAME> <end>` with the `<end>` added by the
environment, not sampled. At each sampled position one constraint is in force: the tool token must be
one of the run's tools (agent.tools), argument bytes must be printable ASCII or newline (or <end>).
Sampling renormalises over the allowed tokens, and the constraint index is recorded per token so that the
trainer recomputes exactly the distribution the rollout sampled from.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from crucible.agent.tokenizer import END, TOOLS, VOCAB_SIZE, tool_token

FREE, TOOL, ARGS = 0, 1, 2
NUM_CONSTRAINTS = 3
TOOL_CALL = 3
"""A token of a pretrained model's tool call, sampled under the llguidance grammar that the trainer
replays (crucible.agent.toolcalls); not a row of the byte-level table."""


def allowed_table(
    vocab_size: int = VOCAB_SIZE, device: torch.device | str = "cpu", *, tools: Sequence[str] = TOOLS
) -> torch.Tensor:
    """Boolean [NUM_CONSTRAINTS, vocab] on `device`: which tokens each constraint allows, the tool token
    being one of `tools` (a run's agent.tools).

    Built once per vocabulary size and tool set (and copied once per device), then shared by every
    caller: it is read-only by contract, never modify it in place (clone it first).
    """
    return _table(int(vocab_size), torch.device(device), tuple(tools))


@functools.cache
def _table(vocab_size: int, device: torch.device, tools: tuple[str, ...]) -> torch.Tensor:
    if device != torch.device("cpu"):
        return _table(vocab_size, torch.device("cpu"), tools).to(device)
    unknown = set(tools) - set(TOOLS)
    if unknown:
        raise ValueError(f"unknown tools {sorted(unknown)}; the agent's are {TOOLS}")
    table = torch.zeros(NUM_CONSTRAINTS, vocab_size, dtype=torch.bool)
    table[FREE] = True
    table[TOOL, [tool_token(name) for name in tools]] = True
    table[ARGS, 0x20:0x7F] = True
    table[ARGS, ord("\n")] = True
    table[ARGS, END] = True
    return table


def masked_logprobs(logits: torch.Tensor, allowed: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log-softmax of logits / temperature over the allowed tokens: the distribution a constrained token
    is sampled from, and the one the trainer recomputes. logits [..., V] (any float dtype, computed in
    fp32), allowed bool [..., V]; returns fp32 [..., V]."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    return torch.log_softmax((logits.float() / temperature).masked_fill(~allowed, float("-inf")), dim=-1)


def constrained_logprobs(
    logits: torch.Tensor,
    constraints: torch.Tensor,
    *,
    temperature: float = 1.0,
    tools: Sequence[str] = TOOLS,
) -> torch.Tensor:
    """`masked_logprobs` under each position's constraint of the byte-level table (constraints [...] long)."""
    table = allowed_table(logits.shape[-1], logits.device, tools=tools)
    return masked_logprobs(logits, table[constraints], temperature=temperature)
