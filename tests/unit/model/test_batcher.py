"""The continuous batcher: sequences decoded together give what each gives alone, whatever joins and
leaves around them; shared prefixes are copied, not recomputed; swaps land between steps; a bad request
fails alone."""

from __future__ import annotations

import threading

import pytest
import torch

from crucible.model import PRESETS, build_model
from crucible.model.batcher import BatcherError, ContinuousBatcher


class Seq:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self.fed = 0
        self.routes: list = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []


def greedy(seq: Seq, n: int, *, started: threading.Event | None = None):
    """Greedy decoding of n tokens, recording each token's logprob and version."""

    goal = len(seq.logprobs) + n

    def choose(logits: torch.Tensor, version: int) -> bool:
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logp))
        seq.tokens.append(token)
        seq.logprobs.append(float(logp[token]))
        seq.versions.append(version)
        if started is not None and len(seq.logprobs) == 3:
            started.set()
        return len(seq.logprobs) == goal

    return choose


@pytest.fixture(
    scope="module", params=[("tiny", "fp32"), ("tiny-dense", "fp32"), ("tiny", "bf16"), ("tiny", "mxfp8")]
)
def model(request):
    """MoE and dense, in each precision a run trains (and so samples) in."""
    name, precision = request.param
    return build_model(PRESETS[name], precision=precision, seed=3).eval()


PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],  # the same prompt
    [5, 9, 2],
    list(range(30, 90)),  # longer than a prefill chunk
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 40, 41, 42],  # shares 18 tokens
    [7],
]
LENGTHS = [12, 5, 9, 3, 14, 7]


def one_at_a_time(model) -> list[Seq]:
    batcher = ContinuousBatcher(max_context=128, max_slots=1, prefill_chunk=16)
    batcher.swap(model, 0)
    out = []
    for prompt, n in zip(PROMPTS, LENGTHS, strict=True):
        seq = Seq(prompt)
        batcher.run(seq, greedy(seq, n))
        batcher.release(seq)
        out.append(seq)
    batcher.close()
    return out


def test_batched_equals_one_at_a_time_with_sequences_joining_and_leaving(model):
    alone = one_at_a_time(model)
    batcher = ContinuousBatcher(max_context=128, max_slots=8, prefill_chunk=16)
    batcher.swap(model, 0)
    first_half = [Seq(p) for p in PROMPTS[:3]]
    started = threading.Event()
    futures = [batcher.submit(s, greedy(s, n, started=started if i == 0 else None))
               for i, (s, n) in enumerate(zip(first_half, LENGTHS[:3], strict=True))]  # fmt: skip
    assert started.wait(timeout=60), "the first sequences never decoded"
    second_half = [Seq(p) for p in PROMPTS[3:]]  # join while the first ones decode
    futures += [batcher.submit(s, greedy(s, n)) for s, n in zip(second_half, LENGTHS[3:], strict=True)]
    assert [f.result(timeout=120) for f in futures] == [None] * len(PROMPTS)
    batched = first_half + second_half
    assert batcher.stats.decode_rows > batcher.stats.steps, "nothing was ever decoded together"
    assert batcher.stats.mixed_forwards > 0, "no prefill ever shared a forward with decode rows"
    for a, b in zip(alone, batched, strict=True):
        assert a.tokens == b.tokens
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert a.routes == b.routes
    batcher.close()


def test_sequences_in_scattered_slots_decode_as_they_do_alone(model):
    """Idle residents hold slots 0 and 2, so the decoding rows sit in slots 1 and 3-7: the forward
    attends run by run (slot 1, then 3-7)."""
    alone = one_at_a_time(model)
    batcher = ContinuousBatcher(max_context=128, max_slots=8, prefill_chunk=64)
    batcher.swap(model, 0)
    holders = [Seq([3, 1, 4, 1, 5]) for _ in range(4)]
    for holder in holders:
        batcher.run(holder, None)
    batcher.release(holders[1])
    batcher.release(holders[3])
    seqs = [Seq(p) for p in PROMPTS]
    futures = [batcher.submit(s, greedy(s, n)) for s, n in zip(seqs, LENGTHS, strict=True)]
    assert [f.result(timeout=120) for f in futures] == [None] * len(PROMPTS)
    assert batcher.residents == 2 + len(PROMPTS) and batcher.cache_slots == 8
    for a, b in zip(alone, seqs, strict=True):
        assert a.tokens == b.tokens
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    batcher.close()


def test_the_incremental_logprobs_are_the_full_forward_ones(model):
    seq = one_at_a_time(model)[3]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([seq.tokens])).logits[0], dim=-1)
    prompt = len(PROMPTS[3])
    expected = [float(logp[prompt - 1 + i, seq.tokens[prompt + i]]) for i in range(LENGTHS[3])]
    assert seq.logprobs == pytest.approx(expected, abs=1e-4)


def test_a_shared_prompt_is_prefilled_once(model):
    batcher = ContinuousBatcher(max_context=256, max_slots=8, prefill_chunk=64)
    batcher.swap(model, 0)
    prompt = list(range(1, 201))
    group = [Seq(prompt) for _ in range(8)]
    futures = [batcher.submit(s, greedy(s, 4)) for s in group]
    assert [f.result(timeout=120) for f in futures] == [None] * 8
    assert batcher.stats.prefill_tokens == len(prompt)  # one computed prefill, 7 copies
    assert batcher.stats.shared_tokens == 7 * (len(prompt) - 1)
    assert all(s.tokens == group[0].tokens for s in group)
    assert all(s.routes == group[0].routes for s in group)
    batcher.close()


def test_prompts_of_different_lengths_prefill_together(model):
    """Four prompts of 16, 14, 12 and 10 tokens (the longest first) prefill in one forward, each whole
    (52 tokens within the budget of 64); each sequence decodes what it decodes alone."""
    prompts = [list(range(40 + 7 * i, 56 + 5 * i)) for i in range(4)]
    assert [len(p) for p in prompts] == [16, 14, 12, 10]
    alone = []
    for prompt in prompts:
        single = ContinuousBatcher(max_context=64, max_slots=1, prefill_chunk=64)
        single.swap(model, 0)
        seq = Seq(prompt)
        single.run(seq, greedy(seq, 3))
        single.close()
        alone.append(seq)
    batcher = ContinuousBatcher(max_context=64, max_slots=5, prefill_chunk=64)
    batcher.swap(model, 0)
    barrier = Seq([1, 2])  # holds the engine thread until all four are queued
    gate = threading.Event()
    batcher.submit(barrier, lambda logits, version: gate.wait(60) or True)
    group = [Seq(p) for p in prompts]
    futures = [batcher.submit(s, greedy(s, 3)) for s in group]
    gate.set()
    assert [f.result(timeout=120) for f in futures] == [None] * 4
    # one forward where one per prompt (the longest first, each alone) took four
    assert batcher.stats.prefill_tokens == 2 + sum(len(p) for p in prompts)
    assert (batcher.stats.prefill_parts, batcher.stats.mixed_forwards) == (1 + 4, 1)  # the barrier's, then 4
    for a, b in zip(alone, group, strict=True):
        assert a.tokens == b.tokens and b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    batcher.close()


def test_a_next_turn_continues_the_released_cache_and_a_swap_forgets_it(model):
    """A conversation's next request (its history + new tokens) takes over the slot its last request left,
    computing only the new tokens, with exactly the outputs of a fresh start; after a swap it starts over."""
    batcher = ContinuousBatcher(max_context=256, max_slots=2, prefill_chunk=32)
    batcher.swap(model, 0)
    first = Seq(list(range(1, 41)))
    batcher.run(first, greedy(first, 5))
    batcher.release(first)
    computed = batcher.stats.prefill_tokens
    turn = [*first.tokens, 60, 61, 62]
    second = Seq(turn)
    batcher.run(second, greedy(second, 6))
    assert batcher.stats.prefill_tokens - computed == len(turn) - (len(first.tokens) - 1)  # the new ones only
    assert second.routes[: len(first.routes)] == first.routes
    fresh = ContinuousBatcher(max_context=256, max_slots=1, prefill_chunk=32)
    fresh.swap(model, 0)
    alone = Seq(turn)
    fresh.run(alone, greedy(alone, 6))
    fresh.close()
    assert second.tokens == alone.tokens and second.routes == alone.routes
    assert second.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    batcher.release(second)
    batcher.swap(model, 1)
    third = Seq(list(second.tokens))
    before = batcher.stats.prefill_tokens
    batcher.run(third, greedy(third, 1))
    assert batcher.stats.prefill_tokens - before == len(second.tokens)  # nothing kept from version 0
    assert batcher.residents == 1
    batcher.close()


def test_a_swap_lands_between_steps_and_each_token_knows_its_version(model):
    batcher = ContinuousBatcher(max_context=128, max_slots=4)
    batcher.swap(model, 0)
    newer = build_model(model.cfg, precision=model.precision, seed=4).eval()
    seq = Seq(list(range(1, 30)))
    started = threading.Event()
    release_swap = threading.Event()

    def choose(logits: torch.Tensor, version: int) -> bool:
        seq.tokens.append(int(torch.argmax(logits)))
        seq.versions.append(version)
        if len(seq.versions) == 3:
            started.set()
            release_swap.wait(timeout=30)  # the swap is handed over while this step runs
        return len(seq.versions) == 8

    future = batcher.submit(seq, choose)
    assert started.wait(timeout=60)
    batcher.swap(newer, 1)
    assert batcher.version == 1
    release_swap.set()
    assert future.result(timeout=60) is None
    assert seq.versions == [0, 0, 0, 1, 1, 1, 1, 1]
    # a new sequence does not share a prefix computed by the old weights
    other = Seq([*seq.tokens[:-1], 9])
    batcher.run(other, greedy(other, 1))
    assert batcher.stats.shared_tokens == 0
    batcher.close()


def test_a_bad_request_fails_alone(model):
    batcher = ContinuousBatcher(max_context=64, max_slots=4)
    batcher.swap(model, 0)
    good = Seq([1, 2, 3])
    too_long = Seq(list(range(1, 70)))
    bad_token = Seq([1, model.cfg.vocab_size + 5])
    crashing = Seq([4, 5])

    def explode(logits, version):
        raise ValueError("the caller's decoding failed")

    futures = [
        batcher.submit(good, greedy(good, 10)),
        batcher.submit(too_long, greedy(too_long, 1)),
        batcher.submit(bad_token, greedy(bad_token, 1)),
        batcher.submit(crashing, explode),
    ]
    results = [f.result(timeout=60) for f in futures]
    assert results[0] is None and len(good.tokens) == 13
    assert isinstance(results[1], BatcherError) and "exceed the context" in str(results[1])
    assert isinstance(results[2], BatcherError) and "token ids" in str(results[2])
    assert isinstance(results[3], ValueError)
    empty = Seq([])
    with pytest.raises(BatcherError, match="nothing to feed"):
        batcher.run(empty, greedy(empty, 1))
    # the cache of the good sequence survived its neighbours: it continues exactly as a fresh one would
    batcher.run(good, greedy(good, 2))
    fresh = Seq(good.tokens[:13])
    batcher.run(fresh, greedy(fresh, 2))
    assert fresh.tokens == good.tokens
    batcher.close()


def test_more_sequences_than_slots_wait_for_a_release(model):
    batcher = ContinuousBatcher(max_context=64, max_slots=2)
    batcher.swap(model, 0)
    held = [Seq([1, 2]), Seq([3, 4])]
    for s in held:
        batcher.run(s, greedy(s, 1))  # both slots now hold a parked sequence
    waiting = Seq([5, 6])
    future = batcher.submit(waiting, greedy(waiting, 2))
    assert not future.done()
    batcher.release(held[0])
    assert future.result(timeout=60) is None and len(waiting.tokens) == 4
    batcher.close()
    with pytest.raises(BatcherError, match="closed"):
        batcher.submit(Seq([1]), greedy(Seq([1]), 1))


def test_a_step_feeds_short_pending_tokens_whole_and_the_oldest_long_one_the_rest():
    """Within a budget of 16 prefill tokens: forced tokens (2 and 3 pending) whole, within half the
    budget; the oldest long prompt the rest (11 of 60); a third short one (4) waits for the next step."""
    from crucible.model.batcher import _Request, _Resident

    batcher = ContinuousBatcher(max_context=128, max_slots=4, prefill_chunk=16)
    requests = [_Request(_Resident(Seq(list(range(n))), slot=i, version=0), None)
                for i, n in enumerate((60, 3, 4, 2))]  # fmt: skip
    parts = batcher._prefills(requests)
    assert [(n, [r.resident.slot for r in rows]) for rows, n in parts] == [(2, [3]), (3, [1]), (11, [0])]
    batcher.close()
