"""Half-open integer intervals (start, end): overlap, merging, coverage and gaps."""

from __future__ import annotations

from random import Random

from services.catalog.families.base import Family, Mutation, Unit, call


def _interval(rng: Random, *, start: int | None = None) -> tuple[int, int]:
    start = rng.randint(0, 20) if start is None else start
    return (start, start + rng.randint(1, 6))


def _intervals(rng: Random) -> list[tuple[int, int]]:
    """A few random intervals, often with one that touches or nests in another."""
    out = [_interval(rng) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.5:
        out.append(_interval(rng, start=out[0][1]))
    if rng.random() < 0.4:
        out.append((out[0][0], out[0][0] + 1))
    rng.shuffle(out)
    return out


def _pairs(rng: Random) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    a = _interval(rng)
    return [(_interval(rng), _interval(rng)) for _ in range(4)] + [(a, _interval(rng, start=a[1])), (a, a)]


OVERLAPS = Unit(
    key="overlaps",
    layer=0,
    names=("overlaps", "intersects", "do_overlap"),
    summary="whether two half-open intervals share at least one point",
    source='''
def $overlaps(a, b):
    """Whether two half-open intervals share at least one point."""
    return a[0] < b[1] and b[0] < a[1]
''',
    mutations=(
        Mutation(
            kind="comparison", find="a[0] < b[1] and b[0] < a[1]", replace="a[0] <= b[1] and b[0] <= a[1]"
        ),
        Mutation(kind="boolean", find="a[0] < b[1] and b[0]", replace="a[0] < b[1] or b[0]"),
    ),
    probes=lambda rng: [call("overlaps", a, b) for a, b in _pairs(rng)],
)

TOUCHES = Unit(
    key="touches",
    layer=0,
    names=("touches", "adjacent_or_overlapping", "can_join"),
    summary="whether two half-open intervals overlap or meet end to start",
    source='''
def $touches(a, b):
    """Whether two half-open intervals overlap or meet end to start."""
    return a[0] <= b[1] and b[0] <= a[1]
''',
    mutations=(Mutation(kind="comparison", find="b[0] <= a[1]", replace="b[0] < a[1]"),),
    probes=lambda rng: [call("touches", a, b) for a, b in _pairs(rng)],
)

LENGTH = Unit(
    key="length",
    layer=0,
    names=("length", "size_of", "extent"),
    summary="number of points in a half-open interval (0 if it is empty or reversed)",
    source='''
def $length(interval):
    """Number of points in a half-open interval (0 if it is empty or reversed)."""
    return max(0, interval[1] - interval[0])
''',
    mutations=(
        Mutation(
            kind="missing_edge_case",
            find="max(0, interval[1] - interval[0])",
            replace="interval[1] - interval[0]",
        ),
        Mutation(
            kind="off_by_one", find="interval[1] - interval[0])", replace="interval[1] - interval[0] + 1)"
        ),
    ),
    probes=lambda rng: (
        [call("length", _interval(rng)) for _ in range(4)] + [call("length", (5, 5)), call("length", (7, 3))]
    ),
)

INTERSECTION = Unit(
    key="intersection",
    layer=0,
    names=("intersection", "common_part", "overlap_of"),
    summary="the overlap of two intervals, or None when they do not overlap",
    source='''
def $intersection(a, b):
    """The overlap of two intervals, or None when they do not overlap."""
    start = max(a[0], b[0])
    end = min(a[1], b[1])
    if start >= end:
        return None
    return (start, end)
''',
    mutations=(
        Mutation(kind="wrong_call", find="start = max(a[0], b[0])", replace="start = min(a[0], b[0])"),
        Mutation(kind="comparison", find="if start >= end:", replace="if start > end:"),
    ),
    probes=lambda rng: [call("intersection", a, b) for a, b in _pairs(rng)],
)

MERGE = Unit(
    key="merge",
    layer=1,
    names=("merge", "merge_intervals", "coalesce"),
    summary="the intervals sorted, with the ones that overlap or touch merged",
    calls=("touches",),
    source='''
def $merge(intervals):
    """The intervals sorted, with the ones that overlap or touch merged."""
    merged = []
    for start, end in sorted(intervals):
        if merged and $touches(merged[-1], (start, end)):
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
''',
    mutations=(
        Mutation(kind="missing_edge_case", find="max(merged[-1][1], end)", replace="end"),
        Mutation(
            kind="missing_edge_case",
            find="for start, end in sorted(intervals):",
            replace="for start, end in intervals:",
        ),
    ),
    probes=lambda rng: (
        [call("merge", ivs) for ivs in (_intervals(rng) for _ in range(6))] + [call("merge", [])]
    ),
)

CLIP = Unit(
    key="clip",
    layer=1,
    names=("clip", "clip_to", "restrict"),
    summary="the parts of the intervals inside [lo, hi), in input order, dropping the ones outside",
    calls=("intersection",),
    source='''
def $clip(intervals, lo, hi):
    """The parts of the intervals inside [lo, hi), in input order, dropping the ones outside."""
    kept = []
    for interval in intervals:
        part = $intersection(interval, (lo, hi))
        if part is not None:
            kept.append(part)
    return kept
''',
    mutations=(Mutation(kind="swapped_args", find="(interval, (lo, hi))", replace="(interval, (hi, lo))"),),
    probes=lambda rng: [
        call("clip", _intervals(rng), lo, lo + rng.randint(3, 12))
        for lo in (rng.randint(0, 10) for _ in range(6))
    ],
)

OVERLAPPING = Unit(
    key="overlapping",
    layer=1,
    names=("overlapping", "find_overlapping", "conflicts_with"),
    summary="the intervals (in input order) that overlap the query interval",
    calls=("overlaps",),
    source='''
def $overlapping(intervals, query):
    """The intervals (in input order) that overlap the query interval."""
    return [interval for interval in intervals if $overlaps(interval, query)]
''',
    mutations=(
        Mutation(
            kind="boolean", find="if $overlaps(interval, query)", replace="if not $overlaps(interval, query)"
        ),
    ),
    probes=lambda rng: [call("overlapping", _intervals(rng), _interval(rng)) for _ in range(6)],
)

TOTAL_COVERED = Unit(
    key="total_covered",
    layer=2,
    names=("total_covered", "covered_length", "union_length"),
    summary="number of points covered by at least one interval",
    calls=("merge", "length"),
    source='''
def $total_covered(intervals):
    """Number of points covered by at least one interval."""
    return sum($length(interval) for interval in $merge(intervals))
''',
    mutations=(),
    probes=lambda rng: [call("total_covered", _intervals(rng)) for _ in range(7)],
)

GAPS = Unit(
    key="gaps",
    layer=2,
    names=("gaps", "free_slots", "uncovered"),
    summary="the parts of [lo, hi) that no interval covers, in order",
    calls=("merge",),
    source='''
def $gaps(intervals, lo, hi):
    """The parts of [lo, hi) that no interval covers, in order."""
    free = []
    cursor = lo
    for start, end in $merge(intervals):
        if start > cursor:
            free.append((cursor, min(start, hi)))
        cursor = max(cursor, end)
        if cursor >= hi:
            break
    if cursor < hi:
        free.append((cursor, hi))
    return free
''',
    mutations=(
        Mutation(kind="comparison", find="if start > cursor:", replace="if start >= cursor:"),
        Mutation(kind="missing_edge_case", find="cursor = max(cursor, end)", replace="cursor = end"),
    ),
    probes=lambda rng: [
        call("gaps", _intervals(rng), rng.choice([0, 4, 8]), rng.choice([20, 25, 30])) for _ in range(7)
    ],
)

COVERAGE = Unit(
    key="coverage",
    layer=2,
    names=("coverage", "coverage_ratio", "fraction_covered"),
    summary="the fraction of [lo, hi) covered by the intervals, rounded to 4 places",
    calls=("clip", "merge", "length"),
    source='''
def $coverage(intervals, lo, hi):
    """The fraction of [lo, hi) covered by the intervals, rounded to 4 places."""
    if hi <= lo:
        raise ValueError("empty window")
    covered = sum($length(interval) for interval in $merge($clip(intervals, lo, hi)))
    return round(covered / (hi - lo), 4)
''',
    mutations=(
        Mutation(kind="swapped_args", find="$clip(intervals, lo, hi)", replace="$clip(intervals, hi, lo)"),
    ),
    probes=lambda rng: [
        call("coverage", _intervals(rng), lo, lo + rng.randint(4, 16))
        for lo in (rng.randint(0, 8) for _ in range(6))
    ],
)

BUSIEST = Unit(
    key="busiest",
    layer=2,
    names=("busiest", "peak_overlap", "max_concurrent"),
    summary="the largest number of intervals that overlap one query interval taken from the list",
    calls=("overlapping",),
    source='''
def $busiest(intervals):
    """The largest number of intervals that overlap one of the intervals in the list (0 for none)."""
    best = 0
    for interval in intervals:
        best = max(best, len($overlapping(intervals, interval)))
    return best
''',
    mutations=(),
    probes=lambda rng: [call("busiest", _intervals(rng)) for _ in range(6)] + [call("busiest", [])],
)

INTERVALS = Family(
    key="intervals",
    description="Half-open integer intervals (start, end): overlaps, merging, coverage and gaps.",
    packages=("spans", "rangekit", "timeline", "slotter", "intervalia"),
    topics=("intervals", "ranges", "schedule"),
    units=(
        OVERLAPS,
        TOUCHES,
        LENGTH,
        INTERSECTION,
        MERGE,
        CLIP,
        OVERLAPPING,
        TOTAL_COVERED,
        GAPS,
        COVERAGE,
        BUSIEST,
    ),
)
