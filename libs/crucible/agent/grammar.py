"""Constrained decoding for tool calls.

An agent turn is `<act> <tool:NAME> ARGUMENT-BYTES <end>`. At each sampled position one constraint is
in force: the tool token must be a tool, argument bytes must be printable ASCII or newline (or <end>).
Sampling renormalises over the allowed tokens, and the constraint index is recorded per token so that
the trainer recomputes exactly the distribution the rollout sampled from.
"""

from __future__ import annotations

import torch

from crucible.agent.tokenizer import END, TOOL_BASE, TOOLS, VOCAB_SIZE

FREE, TOOL, ARGS = 0, 1, 2
NUM_CONSTRAINTS = 3


def allowed_table(vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """Boolean [NUM_CONSTRAINTS, vocab]: which tokens each constraint allows."""
    table = torch.zeros(NUM_CONSTRAINTS, vocab_size, dtype=torch.bool)
    table[FREE] = True
    table[TOOL, TOOL_BASE : TOOL_BASE + len(TOOLS)] = True
    table[ARGS, 0x20:0x7F] = True
    table[ARGS, ord("\n")] = True
    table[ARGS, END] = True
    return table


def constrained_logprobs(logits: torch.Tensor, constraints: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log-softmax of logits / temperature over the tokens each position's constraint allows.

    logits [..., V] (any float dtype, computed in fp32), constraints [...] long; returns fp32 [..., V].
    """
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    table = allowed_table(logits.shape[-1]).to(logits.device)
    masked = (logits.float() / temperature).masked_fill(~table[constraints], float("-inf"))
    return torch.log_softmax(masked, dim=-1)
