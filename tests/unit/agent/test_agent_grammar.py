"""The allowed-token table of constrained decoding is built once per vocabulary size and device, not
on every decode step; its values are those of the grammar."""

from __future__ import annotations

import pytest
import torch

from crucible.agent import grammar, tokenizer

V = tokenizer.VOCAB_SIZE


def _expected(vocab_size: int) -> torch.Tensor:
    table = torch.zeros(grammar.NUM_CONSTRAINTS, vocab_size, dtype=torch.bool)
    table[grammar.FREE] = True
    for name in tokenizer.TOOLS:
        table[grammar.TOOL, tokenizer.tool_token(name)] = True
    for byte in [*range(0x20, 0x7F), ord("\n")]:
        table[grammar.ARGS, byte] = True
    table[grammar.ARGS, tokenizer.END] = True
    return table


def test_the_table_is_built_once_and_shared():
    table = grammar.allowed_table()
    assert grammar.allowed_table() is table
    assert grammar.allowed_table(V) is table
    assert grammar.allowed_table(V, "cpu") is table
    assert grammar.allowed_table(V, torch.device("cpu")) is table
    assert grammar.allowed_table(V + 8) is grammar.allowed_table(V + 8)
    assert grammar.allowed_table(V + 8) is not table


def test_the_table_has_the_grammars_values():
    assert torch.equal(grammar.allowed_table(), _expected(V))
    assert torch.equal(grammar.allowed_table(V + 8), _expected(V + 8))


def test_constrained_logprobs_does_not_rebuild_the_table(monkeypatch):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    constraints = torch.tensor([grammar.FREE, grammar.TOOL, grammar.ARGS])
    first = grammar.constrained_logprobs(logits, constraints, temperature=0.7)
    built = []
    zeros = torch.zeros

    def counting_zeros(*args, **kwargs):
        built.append(args)
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", counting_zeros)
    for _ in range(5):
        again = grammar.constrained_logprobs(logits, constraints, temperature=0.7)
    monkeypatch.undo()
    assert built == [], f"the table was rebuilt {len(built)} times"
    assert torch.equal(first, again)
    # the values: a log-softmax over exactly the allowed tokens of each constraint
    allowed = _expected(V)[constraints]
    reference = torch.log_softmax((logits / 0.7).masked_fill(~allowed, float("-inf")), dim=-1)
    torch.testing.assert_close(again, reference)
    assert torch.isneginf(again[~allowed]).all() and torch.isfinite(again[allowed]).all()


def test_the_table_moves_to_another_device_once():
    on_meta = grammar.allowed_table(V, "meta")
    assert on_meta.device.type == "meta" and on_meta.shape == (grammar.NUM_CONSTRAINTS, V)
    assert grammar.allowed_table(V, "meta") is on_meta
    logits, constraints = torch.empty(2, V, device="meta"), torch.zeros(2, dtype=torch.long, device="meta")
    out = grammar.constrained_logprobs(logits, constraints)
    assert out.device.type == "meta" and out.shape == (2, V)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_table_on_cuda_is_cached_and_equal():
    table = grammar.allowed_table(V, torch.device("cuda", 0))
    assert grammar.allowed_table(V, torch.device("cuda", 0)) is table
    assert torch.equal(table.cpu(), _expected(V))
