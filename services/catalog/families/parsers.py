"""Parsers for small configuration values: fields, booleans, durations, number ranges, versions."""

from __future__ import annotations

from random import Random

from services.catalog.families.base import Family, Mutation, Unit, call

_KEYS = ("host", "port", "debug", "timeout", "retries", "name", "verbose", "interval")


def _ranges(rng: Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 4)):
        low = rng.randint(0, 30)
        parts.append(str(low) if rng.random() < 0.4 else f"{low}-{low + rng.randint(0, 4)}")
    return rng.choice([",", ", ", " ,"]).join(parts)


def _versions(rng: Random) -> list[str]:
    def one() -> str:
        return ".".join(str(rng.choice([0, 1, 2, 9, 10, 12])) for _ in range(rng.randint(1, 3)))

    return [rng.choice(["", "v"]) + one() for _ in range(rng.randint(2, 4))]


def _config(rng: Random) -> str:
    values = ["8080", "yes", "off", "30s", "1m30s", "db.local", "True", "0", "2h"]
    lines = [f"{key} = {rng.choice(values)}" for key in rng.sample(_KEYS, rng.randint(2, 4))]
    if rng.random() < 0.5:
        lines.insert(rng.randint(0, len(lines)), "# comment")
    return "\n".join(lines)


SPLIT_FIELDS = Unit(
    key="split_fields",
    layer=0,
    names=("split_fields", "fields", "split_clean"),
    summary="the fields of a line split on sep, whitespace stripped, empty fields dropped",
    source='''
def $split_fields(text, sep):
    """The fields of a line split on sep, whitespace stripped, empty fields dropped."""
    return [part.strip() for part in text.split(sep) if part.strip()]
''',
    mutations=(Mutation(kind="missing_edge_case", find="if part.strip()]", replace="if part]"),),
    probes=lambda rng: (
        [call("split_fields", _ranges(rng), ",") for _ in range(4)] + [call("split_fields", "a; ;b;", ";")]
    ),
)

PARSE_BOOL = Unit(
    key="parse_bool",
    layer=0,
    names=("parse_bool", "to_bool", "as_bool"),
    summary="True or False for the usual spellings (1/0, true/false, yes/no, on/off, any case)",
    source='''
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def $parse_bool(text):
    """True or False for the usual spellings (1/0, true/false, yes/no, on/off, any case)."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")
''',
    mutations=(
        Mutation(
            kind="missing_edge_case", find="value = text.strip().lower()", replace="value = text.strip()"
        ),
        Mutation(
            kind="wrong_return",
            find="    if value in _FALSE:\n        return False\n",
            replace="    if value in _FALSE:\n        return None\n",
        ),
    ),
    probes=lambda rng: (
        [call("parse_bool", v) for v in rng.sample(["Yes", "no", " ON", "off", "1", "FALSE", "True"], 5)]
        + [call("parse_bool", "maybe")]
    ),
)

PARSE_DURATION = Unit(
    key="parse_duration",
    layer=0,
    names=("parse_duration", "duration_seconds", "to_seconds"),
    summary="seconds in a duration such as '1h30m' or '45s' (units d, h, m, s)",
    imports=("re",),
    source='''
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def $parse_duration(text):
    """Seconds in a duration such as '1h30m' or '45s' (units d, h, m, s)."""
    compact = text.replace(" ", "").lower()
    if not re.fullmatch(r"(\\d+[dhms])+", compact):
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(amount) * _UNIT_SECONDS[unit] for amount, unit in re.findall(r"(\\d+)([dhms])", compact))
''',
    mutations=(
        Mutation(kind="wrong_constant", find='"d": 86400', replace='"d": 8640'),
        Mutation(kind="wrong_constant", find='"h": 3600', replace='"h": 360'),
        Mutation(kind="missing_edge_case", find='r"(\\d+)([dhms])"', replace='r"(\\d)([dhms])"'),
    ),
    probes=lambda rng: (
        [call("parse_duration", v) for v in ("45s", "1h30m", "2d", "1d 2h", "90m", f"{rng.randint(2, 59)}s")]
        + [call("parse_duration", "soon"), call("parse_duration", "12m5s")]
    ),
)

PARSE_SPAN = Unit(
    key="parse_span",
    layer=0,
    names=("parse_span", "span", "parse_bounds"),
    summary="the inclusive bounds of '3-7' as (3, 7), or of a single number '5' as (5, 5)",
    source='''
def $parse_span(text):
    """The inclusive bounds of '3-7' as (3, 7), or of a single number '5' as (5, 5)."""
    if "-" in text:
        low, high = text.split("-", 1)
        low, high = int(low), int(high)
    else:
        low = high = int(text)
    if low > high:
        raise ValueError(f"reversed range: {text!r}")
    return (low, high)
''',
    mutations=(
        Mutation(kind="comparison", find="if low > high:", replace="if low >= high:"),
        Mutation(kind="swapped_args", find="return (low, high)", replace="return (high, low)"),
    ),
    probes=lambda rng: (
        [call("parse_span", v) for v in ("3-7", "5", f"{rng.randint(0, 9)}-{rng.randint(10, 20)}", "4-4")]
        + [call("parse_span", "9-2")]
    ),
)

PARSE_VERSION = Unit(
    key="parse_version",
    layer=0,
    names=("parse_version", "version_tuple", "split_version"),
    summary="a version string such as 'v1.10' as a tuple of three numbers, missing parts counting as 0",
    source='''
def $parse_version(text):
    """A version string such as 'v1.10' as a tuple of three numbers, missing parts counting as 0."""
    parts = text.strip().lstrip("vV").split(".")
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"not a version: {text!r}")
    numbers = tuple(int(part) for part in parts)
    return numbers + (0,) * (3 - len(numbers))
''',
    mutations=(
        Mutation(
            kind="missing_edge_case",
            find="return numbers + (0,) * (3 - len(numbers))",
            replace="return numbers",
        ),
        Mutation(kind="off_by_one", find="(0,) * (3 - len(numbers))", replace="(0,) * (2 - len(numbers))"),
    ),
    probes=lambda rng: (
        [call("parse_version", v) for v in [*_versions(rng), "1.2.3", "v2", "10.0"]]
        + [call("parse_version", "1.2.3.4")]
    ),
)

EXPAND_RANGES = Unit(
    key="expand_ranges",
    layer=1,
    names=("expand_ranges", "parse_ranges", "number_list"),
    summary="the sorted, de-duplicated numbers of a list like '1-3,7'",
    calls=("split_fields", "parse_span"),
    source='''
def $expand_ranges(text):
    """The sorted, de-duplicated numbers of a list like '1-3,7'."""
    numbers = set()
    for field in $split_fields(text, ","):
        low, high = $parse_span(field)
        numbers.update(range(low, high + 1))
    return sorted(numbers)
''',
    mutations=(Mutation(kind="off_by_one", find="range(low, high + 1)", replace="range(low, high)"),),
    probes=lambda rng: (
        [call("expand_ranges", _ranges(rng)) for _ in range(6)] + [call("expand_ranges", "1-2,,4")]
    ),
)

COMPARE_VERSIONS = Unit(
    key="compare_versions",
    layer=1,
    names=("compare_versions", "version_cmp", "cmp_versions"),
    summary="-1, 0 or 1 as version a is older than, equal to or newer than version b",
    calls=("parse_version",),
    source='''
def $compare_versions(a, b):
    """-1, 0 or 1 as version a is older than, equal to or newer than version b."""
    va, vb = $parse_version(a), $parse_version(b)
    if va < vb:
        return -1
    if va > vb:
        return 1
    return 0
''',
    mutations=(Mutation(kind="wrong_return", find="        return -1\n", replace="        return 1\n"),),
    probes=lambda rng: (
        [call("compare_versions", *_versions(rng)[:2]) for _ in range(5)]
        + [call("compare_versions", "1.2", "v1.2.0"), call("compare_versions", "1.10", "1.9")]
    ),
)

COERCE = Unit(
    key="coerce",
    layer=1,
    names=("coerce", "typed_value", "convert"),
    summary="a setting's value typed: an int, else a boolean, else a duration in seconds, else the string",
    calls=("parse_bool", "parse_duration"),
    source='''
def $coerce(raw):
    """A setting's value typed: an int, else a boolean, else a duration in seconds, else the string."""
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        return $parse_bool(raw)
    except ValueError:
        pass
    try:
        return $parse_duration(raw)
    except ValueError:
        return raw
''',
    mutations=(),
    probes=lambda rng: [
        call("coerce", v) for v in rng.sample(["8080", "yes", "Off", "90s", "1h5m", "db.local", "-3"], 5)
    ],
)

LOAD_SETTINGS = Unit(
    key="load_settings",
    layer=2,
    names=("load_settings", "parse_config", "read_settings"),
    summary="a dict of typed values from 'key = value' lines, where '#' starts a comment",
    calls=("coerce",),
    source='''
def $load_settings(text):
    """A dict of typed values from 'key = value' lines, where '#' starts a comment."""
    settings = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, _, raw = line.partition("=")
        settings[key.strip()] = $coerce(raw.strip())
    return settings
''',
    mutations=(Mutation(kind="wrong_call", find='line.split("#", 1)[0]', replace='line.split("#", 1)[-1]'),),
    probes=lambda rng: [call("load_settings", _config(rng)) for _ in range(6)],
)

NEWEST = Unit(
    key="newest",
    layer=2,
    names=("newest", "latest_version", "max_version"),
    summary="the newest of several version strings (the first one listed on ties)",
    calls=("compare_versions",),
    source='''
def $newest(versions):
    """The newest of several version strings (the first one listed on ties)."""
    best = None
    for version in versions:
        if best is None or $compare_versions(version, best) > 0:
            best = version
    return best
''',
    mutations=(
        Mutation(
            kind="comparison",
            find="$compare_versions(version, best) > 0",
            replace="$compare_versions(version, best) >= 0",
        ),
    ),
    probes=lambda rng: (
        [call("newest", _versions(rng)) for _ in range(5)]
        + [call("newest", ["1.2", "1.2.0", "v1.10", "1.9"]), call("newest", ["2.0", "1.9", "v2"])]
    ),
)

SELECT_IDS = Unit(
    key="select_ids",
    layer=2,
    names=("select_ids", "pick_ids", "resolve_selection"),
    summary="the ids chosen by a range list like '1-3,7' that exist in `available`, in ascending order",
    calls=("expand_ranges",),
    source='''
def $select_ids(selection, available):
    """The ids chosen by a range list like '1-3,7' that exist in `available`, in ascending order."""
    known = set(available)
    return [number for number in $expand_ranges(selection) if number in known]
''',
    mutations=(),
    probes=lambda rng: [
        call("select_ids", _ranges(rng), sorted(rng.sample(range(36), 18))) for _ in range(6)
    ],
)

PARSERS = Family(
    key="parsers",
    description="Parsers for configuration values: fields, booleans, durations, number ranges and versions.",
    packages=("confetti", "parsley", "settle", "knobs", "tuneup"),
    topics=("config", "parsing", "values"),
    units=(
        SPLIT_FIELDS,
        PARSE_BOOL,
        PARSE_DURATION,
        PARSE_SPAN,
        PARSE_VERSION,
        EXPAND_RANGES,
        COMPARE_VERSIONS,
        COERCE,
        LOAD_SETTINGS,
        NEWEST,
        SELECT_IDS,
    ),
)
