"""Continuous batching: one thread steps every sequence that waits for a token, together.

Callers (the rollout's episodes, the OpenAI-compatible server's requests) hand the batcher a sequence, a
growing token list, with a `choose` callback. The batcher runs the sequence's not-yet-fed tokens through
the model and calls `choose(logits, version)` on the engine thread with the last position's fp32 logits
and the version of the weights that made them; `choose` appends the token(s) it picks to the sequence
and says whether it is done. Sequences join and leave between steps; each step is

1. prefix sharing: a sequence about to prefill copies the keys and values of its longest common prefix
   with a resident sequence whose cache was computed by the current weights (the G episodes of a group
   prefill their shared prompt once; different tasks share the system prompt);
2. one forward that feeds every sequence with exactly one token to feed (decode: one position each)
   and the sequences with more, within `prefill_chunk` prefill tokens in all (`_prefills`: short ones,
   such as a grammar's forced tokens, whole; the rest oldest first, so a long observation never stalls
   the others for more than a chunk). Rows fed different numbers of tokens go in packed (`RaggedBatch`):
   the linear layers run once over every token, attention once per distinct length and run of
   consecutive slots (a view of the cache, never a copy), so a step costs one forward whatever its mix.

The cache (`SlotCache`) holds one slot per resident sequence, kept between a sequence's turns (an
episode's KV cache survives its tool calls) until `release`. A released slot keeps its cache until a slot
is needed: a new sequence that begins with its tokens takes it over (an API client's next turn).
Weights swap between steps: `swap` hands a new (model, version) that the next step uses; a sequence
resident across a swap keeps its cache, as an episode spanning a swap does in asynchronous RL, and every
sampled token carries the version that made it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from crucible.model.kvcache import RaggedBatch, SlotCache
from crucible.model.transformer import Transformer

Choose = Callable[[torch.Tensor, int], bool]
"""(logits [V] fp32, weights version) -> done; appends what it picks to the sequence."""


class Sequence(Protocol):
    tokens: list[int]
    fed: int  # tokens already in the cache
    routes: list  # per fed token, its experts per MoE layer (left empty for dense models)


class BatcherError(RuntimeError):
    """A request the batcher cannot serve (past the context, a released sequence, the batcher closed)."""


@dataclass(eq=False)
class _Resident:
    """A sequence holding a slot."""

    sequence: Any
    slot: int
    version: int  # the weights that computed the slot's first position (-1: empty)


@dataclass(frozen=True)
class _Kept:
    """What a released slot still holds: the keys and values of these tokens, by these weights."""

    tokens: list[int]
    routes: list
    version: int


@dataclass(eq=False)
class _Request:
    resident: _Resident
    choose: Choose | None  # None: only feed (record the routing of trailing tokens)
    future: Future = field(default_factory=Future)


@dataclass
class BatcherStats:
    steps: int = 0
    forwards: int = 0
    mixed_forwards: int = 0  # of them, rows fed different numbers of tokens packed together
    decode_rows: int = 0  # summed over steps
    resident_rows: int = 0  # sequences holding a slot, summed over steps
    caller_rows: int = 0  # of them, those with no request in flight (their caller is busy: a tool
    # call, building an observation, the event loop), summed over steps
    prefill_tokens: int = 0  # computed
    prefill_parts: int = 0  # rows fed the same number (> 1) of tokens in one forward
    shared_tokens: int = 0  # copied from a shared prefix instead of computed
    forward_s: float = 0.0  # in the model's forwards
    choose_s: float = 0.0  # in the callers' `choose` (constraints, sampling, bookkeeping)


class ContinuousBatcher:
    def __init__(
        self,
        *,
        max_context: int,
        max_slots: int = 64,
        prefill_chunk: int = 256,
        min_shared_prefix: int = 16,
    ) -> None:
        if max_slots < 1 or prefill_chunk < 1:
            raise ValueError("max_slots and prefill_chunk must be positive")
        self.max_context = max_context
        self.max_slots = max_slots
        self.prefill_chunk = prefill_chunk
        self.min_shared_prefix = min_shared_prefix
        self.stats = BatcherStats()
        self._model: Transformer | None = None
        self._version = -1
        self._incoming: tuple[Transformer, int] | None = None
        self._cache: SlotCache | None = None
        self._residents: dict[int, _Resident] = {}  # id(sequence) -> resident
        self._free: list[int] = []
        self._kept: OrderedDict[int, _Kept] = (
            OrderedDict()
        )  # released slots whose cache is kept, oldest first
        self._queue: list[_Request] = []  # in arrival order
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="continuous-batcher", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        """The newest weights handed to the batcher (those the next step uses)."""
        with self._cond:
            return self._incoming[1] if self._incoming is not None else self._version

    @property
    def model(self) -> Transformer | None:
        """The newest model handed to the batcher."""
        with self._cond:
            return self._incoming[0] if self._incoming is not None else self._model

    @property
    def residents(self) -> int:
        """Sequences holding a slot (submitted and not yet released)."""
        with self._cond:
            return len(self._residents)

    @property
    def cache_slots(self) -> int:
        """Slots the KV cache holds now (it grows by doubling, up to `max_slots`)."""
        with self._cond:
            return 0 if self._cache is None else self._cache.slots

    def swap(self, model: Transformer, version: int) -> None:
        with self._cond:
            self._incoming = (model, version)
            self._cond.notify()

    def submit(self, sequence: Sequence, choose: Choose | None) -> Future:
        """Feed `sequence` and call `choose` until it is done (None: feed only). The future resolves to
        None, or to the exception that ended the request."""
        with self._cond:
            if self._closed:
                raise BatcherError("the batcher is closed")
            if self._model is None and self._incoming is None:
                raise BatcherError("no weights loaded yet")
            resident = self._residents.get(id(sequence))
            if resident is None:
                resident = self._residents[id(sequence)] = _Resident(sequence, slot=-1, version=-1)
                sequence.fed = 0  # a sequence new to this batcher starts its cache from scratch
                sequence.routes.clear()
            request = _Request(resident, choose)
            if any(r.resident is resident for r in self._queue):
                raise BatcherError("this sequence already has a request in flight")
            self._queue.append(request)
            self._cond.notify()
            return request.future

    def run(self, sequence: Sequence, choose: Choose | None) -> None:
        """`submit` and wait (for callers on their own threads)."""
        error = self.submit(sequence, choose).result()
        if error is not None:
            raise error

    def release(self, sequence: Sequence) -> None:
        """Give the sequence's slot back; a no-op for one never submitted. The slot's cache is kept until
        the slot is needed, and a later sequence that begins with the same tokens takes it over (a
        client's next turn continues its conversation's cache instead of prefilling it again)."""
        with self._cond:
            resident = self._residents.pop(id(sequence), None)
            if resident is None:
                return
            for request in [r for r in self._queue if r.resident is resident]:
                self._queue.remove(request)
                request.future.set_result(BatcherError("the sequence was released mid-request"))
            if resident.slot < 0:
                return
            fed = resident.sequence.fed
            if fed and resident.version >= 0:
                routes = list(resident.sequence.routes[:fed])
                self._kept[resident.slot] = _Kept(
                    list(resident.sequence.tokens[:fed]), routes, resident.version
                )
            else:
                self._free.append(resident.slot)  # `_place` empties it for its next sequence

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for request in self._queue:
                request.future.set_result(BatcherError("the batcher is closed"))
            self._queue.clear()
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # --- the engine thread ---

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._queue and (self._model or self._incoming)):
                    self._cond.wait()
                if self._closed:
                    return
                if self._incoming is not None:
                    self._model, self._version = self._incoming
                    self._incoming = None
                queue = list(self._queue)
                residents = list(self._residents.values())
            with torch.inference_mode():
                progressed = self._step(queue, residents)
            if not progressed:  # every waiting request needs a slot: wait for a release or a new request
                with self._cond:
                    self._cond.wait(timeout=1.0)

    def _step(self, queue: list[_Request], residents: list[_Resident]) -> bool:
        """One step; False when nothing could run."""
        checked = [r for r in queue if self._check(r)]
        live = [r for r in checked if self._place(r)]
        if not live:
            return len(checked) < len(queue)
        self.stats.steps += 1
        self.stats.resident_rows += len(residents)
        self.stats.caller_rows += len(residents) - len(queue)
        deferred, ahead = set(), []
        for request in (r for r in live if self._pending(r) > 1):
            if self._share(request, residents, ahead):
                deferred.add(id(request))
            ahead.append(request)
        decode = [r for r in live if self._pending(r) == 1]
        waiting = [r for r in live if self._pending(r) > 1 and id(r) not in deferred]
        parts = ([(decode, 1)] if decode else []) + self._prefills(waiting)
        if parts:
            self._forward([(sorted(rows, key=lambda r: r.resident.slot), n) for rows, n in parts])
        for request in live:
            if not request.future.done() and request.choose is None and self._pending(request) == 0:
                self._finish(request, None)
        return True

    def _prefills(self, waiting: list[_Request]) -> list[tuple[list[_Request], int]]:
        """This step's prefill parts (requests fed n tokens each), within `prefill_chunk` tokens in all.
        The shortest (a grammar's forced tokens, a short observation) are fed whole while they take at
        most half the budget; the rest goes to the others oldest first, so the oldest always progresses
        and a long observation never stalls the decoding sequences for more than a chunk."""
        fed: dict[int, int] = {}
        used = 0
        for request in sorted(waiting, key=self._pending):
            n = self._pending(request)
            if used + n > self.prefill_chunk // 2:
                break
            fed[id(request)], used = n, used + n
        for request in waiting:
            if id(request) not in fed and used < self.prefill_chunk:
                n = min(self._pending(request), self.prefill_chunk - used)
                fed[id(request)], used = n, used + n
        parts: dict[int, list[_Request]] = {}
        for request in waiting:
            if id(request) in fed:
                parts.setdefault(fed[id(request)], []).append(request)
        return sorted(((rows, n) for n, rows in parts.items()), key=lambda part: part[1])

    @staticmethod
    def _pending(request: _Request) -> int:
        sequence = request.resident.sequence
        return len(sequence.tokens) - sequence.fed

    def _place(self, request: _Request) -> bool:
        """Give the request's sequence a slot; False while every slot is taken (it waits)."""
        resident = request.resident
        if resident.slot >= 0:
            return True
        assert self._model is not None
        with self._cond:
            if self._adopt(resident):
                return True
            if not self._free and self._kept:  # the oldest kept cache goes before the cache grows
                self._free.append(self._kept.popitem(last=False)[0])
            if not self._free:
                size = 0 if self._cache is None else self._cache.slots
                if size >= self.max_slots:
                    return False
                grown = min(self.max_slots, max(8, 2 * size))
                if self._cache is None:
                    self._cache = SlotCache.of(
                        self._model.new_cache(batch_size=grown, max_len=self.max_context)
                    )
                else:
                    self._cache.grow(grown)
                self._free = list(range(grown - 1, size - 1, -1))
            resident.slot = self._free.pop()
            self._cache.lengths[resident.slot] = 0  # type: ignore[union-attr]
        resident.version = -1
        return True

    def _adopt(self, resident: _Resident) -> bool:
        """Take over the kept slot with the longest common prefix (at least `min_shared_prefix` tokens,
        computed by the current weights): its cache up to there is the sequence's."""
        sequence = resident.sequence
        best, slot = self.min_shared_prefix - 1, None
        for kept_slot, kept in self._kept.items():
            if kept.version != self._version:
                continue
            n = common_prefix(sequence.tokens, kept.tokens, min(len(sequence.tokens) - 1, len(kept.tokens)))
            if n > best:
                best, slot = n, kept_slot
        if slot is None:
            return False
        kept = self._kept.pop(slot)
        resident.slot, resident.version = slot, kept.version
        self._cache.lengths[slot] = best  # type: ignore[union-attr]
        sequence.fed = best
        sequence.routes[:] = kept.routes[:best]
        self.stats.shared_tokens += best
        return True

    def _check(self, request: _Request) -> bool:
        sequence = request.resident.sequence
        vocab = self._model.cfg.vocab_size  # type: ignore[union-attr]
        if len(sequence.tokens) > self.max_context:
            self._finish(
                request,
                BatcherError(f"{len(sequence.tokens)} tokens exceed the context of {self.max_context}"),
            )
        elif self._pending(request) < 1 and request.choose is not None:
            self._finish(
                request, BatcherError("nothing to feed: a sequence must end with the token to continue from")
            )
        elif any(not 0 <= t < vocab for t in sequence.tokens[sequence.fed :]):
            self._finish(request, BatcherError(f"token ids must be in [0, {vocab})"))
        return not request.future.done()

    def _share(self, request: _Request, residents: list[_Resident], ahead: list[_Request]) -> bool:
        """Copy the longest prefix a resident sequence computed with the current weights. True when a
        request ahead is still prefilling a longer common prefix: this one waits for it, then copies."""
        resident, sequence = request.resident, request.resident.sequence
        want = len(sequence.tokens) - 1  # the last token is fed, for its logits
        least = max(sequence.fed, self.min_shared_prefix - 1)  # share at least min_shared_prefix in all
        best, source = least, None
        for other in residents:
            if (
                other is resident
                or other.slot < 0
                or other.version != self._version
                or other.sequence.fed <= best
            ):
                continue
            n = common_prefix(sequence.tokens, other.sequence.tokens, min(want, other.sequence.fed))
            if n > best:
                best, source = n, other
        coming = max(
            (common_prefix(sequence.tokens, r.resident.sequence.tokens, want) for r in ahead), default=0
        )
        if source is None:
            return coming > least
        assert self._cache is not None
        start = sequence.fed
        self._cache.copy_prefix(source=source.slot, target=resident.slot, start=start, end=best)
        if source.sequence.routes:
            sequence.routes.extend(source.sequence.routes[start:best])
        if start == 0:
            resident.version = self._version
        sequence.fed = best
        self.stats.shared_tokens += best - start
        return coming > best

    def _forward(self, parts: list[tuple[list[_Request], int]]) -> None:
        """One forward over every part (requests fed n tokens each): a plain batch for one part, a
        `RaggedBatch` packing them for several."""
        model, version = self._model, self._version
        assert model is not None and self._cache is not None
        requests = [r for rows, _ in parts for r in rows]
        # Each part as runs of consecutive slots (its rows are in slot order, so they keep their order),
        # each attending to a view of the cache: episodes leave their slots scattered, and gathering them
        # made bench_rollout's forwards 0.62 s against 0.37 s by runs (docs/benchmarks.md).
        batches = [
            (batch, n) for rows, n in parts for batch in self._cache.batches([r.resident.slot for r in rows])
        ]
        tokens = [_next(r.resident.sequence, n) for rows, n in parts for r in rows]
        ragged = RaggedBatch(batches) if len(batches) > 1 else None
        if ragged is None:
            batch, inputs = batches[0][0], torch.tensor(tokens, dtype=torch.long)
        else:
            batch, inputs = ragged, torch.tensor([[t for row in tokens for t in row]])
        started = time.perf_counter()
        try:
            out = model(inputs, cache=batch, last_only=True)
        except Exception as exc:  # the inputs were checked: this is the model's own failure
            for request in requests:
                self._finish(request, exc)
            return
        chosen = time.perf_counter()
        self.stats.forward_s += chosen - started
        self.stats.forwards += 1
        self.stats.mixed_forwards += int(len(parts) > 1)
        for rows, n in parts:
            if n == 1:
                self.stats.decode_rows += len(rows)
            else:
                self.stats.prefill_tokens += n * len(rows)
                self.stats.prefill_parts += 1
        routes = None
        if out.routes is not None:  # per request, [n, L, k]
            routes = out.routes if ragged is None else [r for part in ragged.split(out.routes) for r in part]
        feeds = [n for rows, n in parts for _ in rows]
        for b, (request, n) in enumerate(zip(requests, feeds, strict=True)):
            resident, sequence = request.resident, request.resident.sequence
            if sequence.fed == 0:
                resident.version = version
            sequence.fed += n
            if routes is not None:
                sequence.routes.extend(routes[b].tolist())
            if request.choose is None or sequence.fed < len(sequence.tokens) or request.future.done():
                continue
            try:
                done = request.choose(out.logits[b, -1], version)
            except Exception as exc:  # the caller's decoding failed: that request ends, the others go on
                self._finish(request, exc)
                continue
            if done:
                self._finish(request, None)
        self.stats.choose_s += time.perf_counter() - chosen

    def _finish(self, request: _Request, error: BaseException | None) -> None:
        with self._cond:
            if request in self._queue:
                self._queue.remove(request)
        if not request.future.done():
            request.future.set_result(error)


def _next(sequence: Sequence, n: int) -> list[int]:
    """The sequence's next n tokens to feed."""
    return sequence.tokens[sequence.fed : sequence.fed + n]


def common_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    """How many leading tokens `a` and `b` share (at most `limit`)."""
    n = 0
    for x, y in zip(a[:limit], b[:limit], strict=False):
        if x != y:
            break
        n += 1
    return n
