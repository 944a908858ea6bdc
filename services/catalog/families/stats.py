"""Descriptive statistics over lists of numbers."""

from __future__ import annotations

from random import Random

from services.catalog.families.base import Family, Mutation, Unit, call


def _numbers(rng: Random, *, low: int = 1, high: int = 9) -> list[int]:
    return [rng.randint(-20, 60) for _ in range(rng.randint(low, high))]


def _samples(rng: Random, *, low: int = 1) -> list[list[int]]:
    """Odd and even lengths, a single value, repeated values: the shapes that expose edge cases."""
    constant = [rng.randint(0, 9)] * rng.randint(2, 5)
    return [_numbers(rng, low=low) for _ in range(4)] + [
        _numbers(rng, low=4, high=4),
        _numbers(rng, low=5, high=5),
        [rng.randint(1, 9)],
        constant,
    ]


MEAN = Unit(
    key="mean",
    layer=0,
    names=("mean", "average", "arithmetic_mean"),
    summary="arithmetic mean of a non-empty list of numbers",
    source='''
def $mean(values):
    """Arithmetic mean of a non-empty list of numbers."""
    if not values:
        raise ValueError("mean of empty data")
    return sum(values) / len(values)
''',
    mutations=(
        Mutation(kind="off_by_one", find="/ len(values)", replace="/ (len(values) - 1)"),
        Mutation(
            kind="missing_edge_case",
            find='    if not values:\n        raise ValueError("mean of empty data")\n',
            replace="",
        ),
    ),
    probes=lambda rng: [call("mean", xs) for xs in _samples(rng)] + [call("mean", [])],
)

MEDIAN = Unit(
    key="median",
    layer=0,
    names=("median", "middle_value", "median_of"),
    summary="middle value of a non-empty list of numbers; the mean of the two middle values for even lengths",
    source='''
def $median(values):
    """Middle value of a non-empty list; the mean of the two middle values for even lengths."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of empty data")
    mid = n // 2
    if n % 2 == 0:
        return (ordered[mid - 1] + ordered[mid]) / 2
    return ordered[mid]
''',
    mutations=(
        Mutation(kind="comparison", find="if n % 2 == 0:", replace="if n % 2 == 1:"),
        Mutation(
            kind="off_by_one",
            find="(ordered[mid - 1] + ordered[mid])",
            replace="(ordered[mid] + ordered[mid + 1])",
        ),
        Mutation(kind="wrong_operator", find="+ ordered[mid]) / 2", replace="+ ordered[mid]) // 2"),
        Mutation(kind="missing_edge_case", find="ordered = sorted(values)", replace="ordered = list(values)"),
    ),
    probes=lambda rng: [call("median", xs) for xs in _samples(rng)],
)

SPREAD = Unit(
    key="spread",
    layer=0,
    names=("spread", "value_range", "span_of"),
    summary="difference between the largest and the smallest value (0 for an empty list)",
    source='''
def $spread(values):
    """Difference between the largest and the smallest value (0 for an empty list)."""
    if not values:
        return 0
    return max(values) - min(values)
''',
    mutations=(
        Mutation(kind="missing_edge_case", find="    if not values:\n        return 0\n", replace=""),
        Mutation(kind="swapped_args", find="max(values) - min(values)", replace="min(values) - max(values)"),
    ),
    probes=lambda rng: [call("spread", xs) for xs in _samples(rng)] + [call("spread", [])],
)

PERCENTILE = Unit(
    key="percentile",
    layer=0,
    names=("percentile", "nearest_rank", "quantile_pct"),
    summary=(
        "nearest-rank percentile: the smallest value with at least pct percent of the data at or below it"
    ),
    imports=("math",),
    source='''
def $percentile(values, pct):
    """Nearest-rank percentile: the smallest value with at least pct% of the data at or below it."""
    if not 0 <= pct <= 100:
        raise ValueError(f"percentile must be within 0..100, got {pct}")
    if not values:
        raise ValueError("percentile of empty data")
    ordered = sorted(values)
    rank = math.ceil(pct / 100 * len(ordered))
    return ordered[max(rank - 1, 0)]
''',
    mutations=(
        Mutation(kind="off_by_one", find="ordered[max(rank - 1, 0)]", replace="ordered[max(rank, 0)]"),
        Mutation(kind="comparison", find="if not 0 <= pct <= 100:", replace="if not 0 < pct <= 100:"),
        Mutation(kind="wrong_call", find="math.ceil(pct", replace="math.floor(pct"),
    ),
    probes=lambda rng: (
        [call("percentile", xs, rng.choice([0, 10, 25, 50, 75, 90, 100])) for xs in _samples(rng)]
        + [call("percentile", _numbers(rng, low=3), 0), call("percentile", _numbers(rng, low=3), 100)]
        + [call("percentile", [1, 2, 3], 101)]
    ),
)

STDEV = Unit(
    key="stdev",
    layer=1,
    names=("stdev", "std_dev", "deviation"),
    summary="standard deviation; with sample=True divides by n - 1 (Bessel's correction)",
    imports=("math",),
    calls=("mean",),
    params={"sample": lambda rng: rng.choice([True, False])},
    source='''
def $stdev(values, *, sample=$p_sample):
    """Standard deviation; sample=True divides by n - 1 (Bessel's correction)."""
    m = $mean(values)
    n = len(values)
    if sample and n < 2:
        raise ValueError("sample standard deviation needs at least two values")
    denom = n - 1 if sample else n
    return round(math.sqrt(sum((x - m) ** 2 for x in values) / denom), 6)
''',
    mutations=(
        Mutation(
            kind="boolean", find="denom = n - 1 if sample else n", replace="denom = n if sample else n - 1"
        ),
        Mutation(kind="off_by_one", find="if sample and n < 2:", replace="if sample and n < 1:"),
    ),
    probes=lambda rng: [call("stdev", xs, sample=rng.choice([True, False])) for xs in _samples(rng)],
)

IQR = Unit(
    key="iqr",
    layer=1,
    names=("iqr", "interquartile_range", "quartile_spread"),
    summary="interquartile range: the 75th minus the 25th nearest-rank percentile",
    calls=("percentile",),
    source='''
def $iqr(values):
    """Interquartile range: the 75th minus the 25th nearest-rank percentile."""
    return $percentile(values, 75) - $percentile(values, 25)
''',
    mutations=(
        Mutation(
            kind="swapped_args",
            find="$percentile(values, 75) - $percentile(values, 25)",
            replace="$percentile(values, 25) - $percentile(values, 75)",
        ),
    ),
    probes=lambda rng: [call("iqr", xs) for xs in _samples(rng)],
)

NORMALIZE = Unit(
    key="normalize",
    layer=1,
    names=("normalize", "rescale", "min_max_scale"),
    summary="values rescaled linearly onto 0..1; constant data maps to all zeros",
    calls=("spread",),
    source='''
def $normalize(values):
    """Rescale values linearly onto 0..1; constant data maps to all zeros."""
    width = $spread(values)
    if width == 0:
        return [0.0] * len(values)
    low = min(values)
    return [round((x - low) / width, 4) for x in values]
''',
    mutations=(
        Mutation(
            kind="missing_edge_case",
            find="    if width == 0:\n        return [0.0] * len(values)\n",
            replace="",
        ),
        Mutation(kind="wrong_call", find="low = min(values)", replace="low = max(values)"),
    ),
    probes=lambda rng: [call("normalize", xs) for xs in _samples(rng)],
)

ZSCORES = Unit(
    key="zscores",
    layer=2,
    names=("zscores", "standard_scores", "z_values"),
    summary="how many standard deviations each value lies from the mean",
    calls=("mean", "stdev"),
    source='''
def $zscores(values):
    """How many (population) standard deviations each value lies from the mean."""
    m = $mean(values)
    sd = $stdev(values, sample=False)
    if sd == 0:
        return [0.0 for _ in values]
    return [round((x - m) / sd, 3) for x in values]
''',
    mutations=(
        Mutation(
            kind="missing_edge_case",
            find="    if sd == 0:\n        return [0.0 for _ in values]\n",
            replace="",
        ),
        Mutation(kind="swapped_args", find="round((x - m) / sd, 3)", replace="round((m - x) / sd, 3)"),
    ),
    probes=lambda rng: [call("zscores", xs) for xs in _samples(rng)],
)

SUMMARIZE = Unit(
    key="summarize",
    layer=2,
    names=("summarize", "describe", "summary_of"),
    summary="count, mean, median, standard deviation and spread of a non-empty list, rounded for display",
    calls=("mean", "median", "stdev", "spread"),
    params={"digits": lambda rng: rng.choice([2, 3])},
    source='''
def $summarize(values):
    """Count, mean, median, standard deviation and spread of a non-empty list, rounded for display."""
    return {
        "count": len(values),
        "mean": round($mean(values), $p_digits),
        "median": $median(values),
        "stdev": round($stdev(values, sample=False), $p_digits),
        "spread": $spread(values),
    }
''',
    mutations=(
        Mutation(kind="wrong_constant", find='"count": len(values),', replace='"count": len(values) - 1,'),
    ),
    probes=lambda rng: [call("summarize", xs) for xs in _samples(rng)],
)

OUTLIERS = Unit(
    key="outliers",
    layer=2,
    names=("outliers", "find_outliers", "fence_outliers"),
    summary="values further than k interquartile ranges outside the quartiles (Tukey's fences)",
    calls=("percentile", "iqr"),
    params={"k": lambda rng: rng.choice([1.0, 1.5, 2.0])},
    source='''
def $outliers(values, *, k=$p_k):
    """Values further than k interquartile ranges outside the quartiles (Tukey's fences)."""
    width = $iqr(values)
    low = $percentile(values, 25) - k * width
    high = $percentile(values, 75) + k * width
    return [x for x in values if x < low or x > high]
''',
    mutations=(
        Mutation(kind="comparison", find="x < low or x > high", replace="x <= low or x >= high"),
        Mutation(kind="boolean", find="x < low or x > high", replace="x < low and x > high"),
    ),
    probes=lambda rng: (
        [call("outliers", [*xs, rng.choice([-90, 150])]) for xs in _samples(rng, low=3)]
        + [call("outliers", xs) for xs in _samples(rng, low=2)[:4]]
    ),
)

STATS = Family(
    key="stats",
    description="Small descriptive statistics helpers for lists of numbers.",
    packages=("tallyho", "numkit", "statlet", "meanwhile", "figures"),
    topics=("stats", "report", "metrics"),
    units=(MEAN, MEDIAN, SPREAD, PERCENTILE, STDEV, IQR, NORMALIZE, ZSCORES, SUMMARIZE, OUTLIERS),
)
