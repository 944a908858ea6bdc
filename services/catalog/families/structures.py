"""Small containers (bounded buffer, LRU cache, priority queue) and the helpers built on them."""

from __future__ import annotations

from random import Random

from services.catalog.families.base import Family, Mutation, Probe, Unit, call


def _values(rng: Random, *, high: int = 9) -> list[int]:
    return [rng.randint(0, 30) for _ in range(rng.randint(1, high))]


def _keys(rng: Random) -> list[str]:
    alphabet = "abcde"[: rng.randint(2, 5)]
    return [rng.choice(alphabet) for _ in range(rng.randint(3, 12))]


def _jobs(rng: Random) -> list[tuple[str, int]]:
    names = rng.sample(
        ["build", "test", "lint", "docs", "deploy", "fetch", "pack", "sign"], rng.randint(2, 6)
    )
    return [(name, rng.choice([0, 1, 1, 2, 5])) for name in names]


def _buffer_probe(rng: Random) -> Probe:
    capacity, values = rng.randint(1, 4), _values(rng)
    return Probe(
        setup=f"buf = $ring_buffer({capacity})\nfor item in {values!r}:\n    buf.push(item)",
        expr="(buf.items(), len(buf))",
    )


def _cache_probe(rng: Random) -> Probe:
    lines = [f"cache = $lru_cache({rng.randint(1, 3)})"]
    for key in _keys(rng):
        lines.append(
            f"cache.get({key!r})" if rng.random() < 0.4 else f"cache.put({key!r}, {rng.randint(0, 9)})"
        )
    return Probe(setup="\n".join(lines), expr="cache.keys()")


def _queue_probe(rng: Random) -> Probe:
    pushes = "\n".join(f"queue.push({name!r}, {priority})" for name, priority in _jobs(rng))
    return Probe(setup=f"queue = $task_queue()\n{pushes}", expr="[queue.pop() for _ in range(len(queue))]")


RING_BUFFER = Unit(
    key="ring_buffer",
    layer=0,
    names=("RingBuffer", "RecentItems", "BoundedLog"),
    summary="a buffer keeping the last `capacity` items pushed, oldest first",
    source='''
class $ring_buffer:
    """A buffer keeping the last `capacity` items pushed, oldest first."""

    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._items = []

    def push(self, item):
        self._items.append(item)
        if len(self._items) > self.capacity:
            del self._items[0]

    def items(self):
        return list(self._items)

    def __len__(self):
        return len(self._items)
''',
    mutations=(
        Mutation(
            kind="comparison",
            find="if len(self._items) > self.capacity:",
            replace="if len(self._items) >= self.capacity:",
        ),
        Mutation(kind="wrong_call", find="del self._items[0]", replace="del self._items[-1]"),
    ),
    probes=lambda rng: [_buffer_probe(rng) for _ in range(6)] + [Probe(expr="$ring_buffer(0)")],
)

LRU_CACHE = Unit(
    key="lru_cache",
    layer=0,
    names=("LRUCache", "RecentCache", "LruMap"),
    summary="a mapping that forgets its least recently used key once it holds more than `capacity` keys",
    source='''
class $lru_cache:
    """A mapping that forgets its least recently used key once it holds more than `capacity` keys."""

    def __init__(self, capacity):
        self.capacity = capacity
        self._data = {}

    def get(self, key, default=None):
        if key not in self._data:
            return default
        value = self._data.pop(key)
        self._data[key] = value
        return value

    def put(self, key, value):
        self._data.pop(key, None)
        self._data[key] = value
        if len(self._data) > self.capacity:
            del self._data[next(iter(self._data))]

    def keys(self):
        """Keys from least to most recently used."""
        return list(self._data)
''',
    mutations=(
        Mutation(
            kind="missing_edge_case",
            find=(
                "        value = self._data.pop(key)\n        self._data[key] = value\n        return value\n"
            ),
            replace="        return self._data[key]\n",
        ),
        Mutation(kind="missing_edge_case", find="        self._data.pop(key, None)\n", replace=""),
        Mutation(
            kind="comparison",
            find="if len(self._data) > self.capacity:",
            replace="if len(self._data) >= self.capacity:",
        ),
    ),
    probes=lambda rng: [_cache_probe(rng) for _ in range(7)],
)

TASK_QUEUE = Unit(
    key="task_queue",
    layer=0,
    names=("TaskQueue", "JobQueue", "PriorityQueue"),
    summary="a queue that pops the lowest priority first, equal priorities in insertion order",
    imports=("heapq",),
    source='''
class $task_queue:
    """A queue that pops the lowest priority first, equal priorities in insertion order."""

    def __init__(self):
        self._heap = []
        self._pushed = 0

    def push(self, item, priority=0):
        heapq.heappush(self._heap, (priority, self._pushed, item))
        self._pushed += 1

    def pop(self):
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[2]

    def __len__(self):
        return len(self._heap)
''',
    mutations=(
        Mutation(
            kind="swapped_args",
            find="(priority, self._pushed, item)",
            replace="(priority, item, self._pushed)",
        ),
        Mutation(
            kind="wrong_operator",
            find="(priority, self._pushed, item)",
            replace="(-priority, self._pushed, item)",
        ),
    ),
    probes=lambda rng: (
        [_queue_probe(rng) for _ in range(6)] + [Probe(setup="queue = $task_queue()", expr="queue.pop()")]
    ),
)

ROLLING_MEANS = Unit(
    key="rolling_means",
    layer=1,
    names=("rolling_means", "moving_average", "running_means"),
    summary="the mean of the last `window` values at each position (fewer at the start), rounded to 4 places",
    calls=("ring_buffer",),
    source='''
def $rolling_means(values, window):
    """The mean of the last `window` values at each position (fewer at the start), rounded to 4 places."""
    recent = $ring_buffer(window)
    means = []
    for value in values:
        recent.push(value)
        means.append(round(sum(recent.items()) / len(recent), 4))
    return means
''',
    mutations=(),
    probes=lambda rng: [call("rolling_means", _values(rng), rng.randint(1, 4)) for _ in range(6)],
)

CACHE_HITS = Unit(
    key="cache_hits",
    layer=1,
    names=("cache_hits", "count_hits", "simulate_cache"),
    summary="how many lookups in a key sequence an LRU cache of the given capacity would answer",
    calls=("lru_cache",),
    source='''
def $cache_hits(keys, capacity):
    """How many lookups in a key sequence an LRU cache of the given capacity would answer."""
    cache = $lru_cache(capacity)
    hits = 0
    for key in keys:
        if cache.get(key) is not None:
            hits += 1
        else:
            cache.put(key, True)
    return hits
''',
    mutations=(
        Mutation(kind="boolean", find="if cache.get(key) is not None:", replace="if cache.get(key) is None:"),
    ),
    probes=lambda rng: [call("cache_hits", _keys(rng), rng.randint(1, 3)) for _ in range(6)],
)

RUN_ORDER = Unit(
    key="run_order",
    layer=1,
    names=("run_order", "schedule", "execution_order"),
    summary="the names of (name, priority) jobs in the order a priority queue runs them",
    calls=("task_queue",),
    source='''
def $run_order(jobs):
    """The names of (name, priority) jobs in the order a priority queue runs them."""
    queue = $task_queue()
    for name, priority in jobs:
        queue.push(name, priority)
    return [queue.pop() for _ in range(len(queue))]
''',
    mutations=(
        Mutation(
            kind="swapped_args", find="queue.push(name, priority)", replace="queue.push(priority, name)"
        ),
    ),
    probes=lambda rng: [call("run_order", _jobs(rng)) for _ in range(6)],
)

HIT_RATES = Unit(
    key="hit_rates",
    layer=2,
    names=("hit_rates", "cache_report", "hit_ratio_table"),
    summary="the hit rate of an LRU cache for each capacity, rounded to 3 places",
    calls=("cache_hits",),
    source='''
def $hit_rates(keys, capacities):
    """The hit rate of an LRU cache for each capacity, rounded to 3 places."""
    if not keys:
        return {capacity: 0.0 for capacity in capacities}
    return {capacity: round($cache_hits(keys, capacity) / len(keys), 3) for capacity in capacities}
''',
    mutations=(),
    probes=lambda rng: (
        [call("hit_rates", _keys(rng), [1, 2, 3]) for _ in range(6)] + [call("hit_rates", [], [1])]
    ),
)

TREND = Unit(
    key="trend",
    layer=2,
    names=("trend", "direction", "trend_of"),
    summary="'up', 'down' or 'flat': how the last rolling mean compares with the first",
    calls=("rolling_means",),
    params={"window": lambda rng: rng.choice([2, 3])},
    source='''
def $trend(values, window=$p_window):
    """'up', 'down' or 'flat': how the last rolling mean compares with the first."""
    means = $rolling_means(values, window)
    if not means or means[-1] == means[0]:
        return "flat"
    return "up" if means[-1] > means[0] else "down"
''',
    mutations=(
        Mutation(
            kind="comparison", find='"up" if means[-1] > means[0]', replace='"up" if means[-1] < means[0]'
        ),
    ),
    probes=lambda rng: (
        [call("trend", _values(rng), rng.choice([2, 3])) for _ in range(6)] + [call("trend", [])]
    ),
)

BATCHES = Unit(
    key="batches",
    layer=2,
    names=("batches", "batched_order", "plan_batches"),
    summary="job names in run order, grouped into batches of at most `size`",
    calls=("run_order",),
    params={"size": lambda rng: rng.choice([2, 3])},
    source='''
def $batches(jobs, size=$p_size):
    """Job names in run order, grouped into batches of at most `size`."""
    order = $run_order(jobs)
    return [order[i : i + size] for i in range(0, len(order), size)]
''',
    mutations=(
        Mutation(
            kind="off_by_one", find="range(0, len(order), size)", replace="range(0, len(order) - 1, size)"
        ),
    ),
    probes=lambda rng: [call("batches", _jobs(rng), rng.choice([1, 2, 3])) for _ in range(6)],
)

STRUCTURES = Family(
    key="structures",
    description="Small containers (bounded buffer, LRU cache, priority queue) and helpers built on them.",
    packages=("boxes", "holdall", "stowage", "cratekit", "bins"),
    topics=("containers", "queues", "caching"),
    units=(
        RING_BUFFER,
        LRU_CACHE,
        TASK_QUEUE,
        ROLLING_MEANS,
        CACHE_HITS,
        RUN_ORDER,
        HIT_RATES,
        TREND,
        BATCHES,
    ),
)
