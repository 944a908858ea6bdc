"""Proleptic Gregorian calendar arithmetic on (year, month, day) tuples."""

from __future__ import annotations

from random import Random

from services.catalog.families.base import Family, Mutation, Unit, call

_YEARS = (1800, 1900, 1996, 2000, 2019, 2023, 2024, 2100, 2200, 2400)


def _date(rng: Random) -> tuple[int, int, int]:
    year, month = rng.choice(_YEARS), rng.randint(1, 12)
    last = 29 if month == 2 else 30
    return (year, month, rng.choice([1, rng.randint(1, last), last]))


def _dates(rng: Random) -> list[tuple[int, int, int]]:
    year = rng.choice(_YEARS)
    return [_date(rng) for _ in range(4)] + [(year, 12, 31), (year, 3, 1), (rng.choice((2000, 2024)), 2, 29)]


IS_LEAP = Unit(
    key="is_leap",
    layer=0,
    names=("is_leap", "leap_year", "is_leap_year"),
    summary="whether a year is a leap year in the Gregorian calendar",
    source='''
def $is_leap(year):
    """Whether a year is a leap year in the Gregorian calendar."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
''',
    mutations=(
        Mutation(
            kind="boolean",
            find="(year % 100 != 0 or year % 400 == 0)",
            replace="(year % 100 != 0 and year % 400 == 0)",
        ),
        Mutation(kind="comparison", find="year % 100 != 0", replace="year % 100 == 0"),
        Mutation(kind="wrong_constant", find="year % 400 == 0", replace="year % 200 == 0"),
    ),
    probes=lambda rng: [call("is_leap", y) for y in _YEARS] + [call("is_leap", rng.randint(1901, 2099))],
)

DAYS_IN_MONTH = Unit(
    key="days_in_month",
    layer=0,
    names=("days_in_month", "month_length", "month_days"),
    summary="number of days in a month (1-12) of a year",
    calls=("is_leap",),
    source='''
_MONTH_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def $days_in_month(year, month):
    """Number of days in a month (1-12) of a year."""
    if not 1 <= month <= 12:
        raise ValueError(f"month must be 1..12, got {month}")
    if month == 2 and $is_leap(year):
        return 29
    return _MONTH_DAYS[month - 1]
''',
    mutations=(
        Mutation(kind="off_by_one", find="_MONTH_DAYS[month - 1]", replace="_MONTH_DAYS[month % 12]"),
        Mutation(kind="comparison", find="if not 1 <= month <= 12:", replace="if not 1 <= month < 12:"),
        Mutation(
            kind="wrong_constant",
            find="(31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)",
            replace="(31, 28, 31, 30, 31, 30, 31, 30, 31, 30, 31, 30)",
        ),
    ),
    probes=lambda rng: (
        [call("days_in_month", rng.choice(_YEARS), m) for m in rng.sample(range(1, 13), 6)]
        + [
            call("days_in_month", rng.choice((2000, 2024)), 2),
            call("days_in_month", 2023, 12),
            call("days_in_month", 2023, 13),
        ]
    ),
)

DAY_OF_YEAR = Unit(
    key="day_of_year",
    layer=1,
    names=("day_of_year", "ordinal_day", "yearday"),
    summary="the 1-based position of a date within its year",
    calls=("days_in_month",),
    source='''
def $day_of_year(year, month, day):
    """The 1-based position of a date within its year."""
    if not 1 <= day <= $days_in_month(year, month):
        raise ValueError(f"no day {day} in {year}-{month:02d}")
    return sum($days_in_month(year, m) for m in range(1, month)) + day
''',
    mutations=(
        Mutation(kind="off_by_one", find="range(1, month)", replace="range(1, month + 1)"),
        Mutation(kind="comparison", find="if not 1 <= day <=", replace="if not 1 <= day <"),
    ),
    probes=lambda rng: [call("day_of_year", *d) for d in _dates(rng)] + [call("day_of_year", 2023, 2, 29)],
)

QUARTER = Unit(
    key="quarter",
    layer=0,
    names=("quarter", "quarter_of", "fiscal_quarter"),
    summary="the quarter (1-4) a month (1-12) falls in",
    source='''
def $quarter(month):
    """The quarter (1-4) a month (1-12) falls in."""
    if not 1 <= month <= 12:
        raise ValueError(f"month must be 1..12, got {month}")
    return (month - 1) // 3 + 1
''',
    mutations=(Mutation(kind="off_by_one", find="(month - 1) // 3 + 1", replace="month // 3 + 1"),),
    probes=lambda rng: [call("quarter", m) for m in (1, 3, 4, 6, 9, 12)] + [call("quarter", 0)],
)

ORDINAL = Unit(
    key="ordinal",
    layer=2,
    names=("ordinal", "day_number", "to_ordinal"),
    summary="days since the start of the calendar: 0001-01-01 is day 1",
    calls=("day_of_year",),
    source='''
def $ordinal(date):
    """Days since the start of the calendar: (1, 1, 1) is day 1."""
    year, month, day = date
    y = year - 1
    return y * 365 + y // 4 - y // 100 + y // 400 + $day_of_year(year, month, day)
''',
    mutations=(
        Mutation(kind="wrong_operator", find="- y // 100 + y // 400", replace="+ y // 100 - y // 400"),
    ),
    probes=lambda rng: [call("ordinal", d) for d in _dates(rng)],
)

DAYS_BETWEEN = Unit(
    key="days_between",
    layer=2,
    names=("days_between", "date_diff", "days_from"),
    summary="days from date a to date b (negative if b comes first)",
    calls=("ordinal",),
    source='''
def $days_between(a, b):
    """Days from date a to date b (negative if b comes first)."""
    return $ordinal(b) - $ordinal(a)
''',
    mutations=(
        Mutation(kind="swapped_args", find="$ordinal(b) - $ordinal(a)", replace="$ordinal(a) - $ordinal(b)"),
    ),
    probes=lambda rng: [call("days_between", a, b) for a, b in zip(_dates(rng), _dates(rng), strict=True)],
)

ADD_DAYS = Unit(
    key="add_days",
    layer=2,
    names=("add_days", "shift_date", "days_after"),
    summary="the date a given non-negative number of days after a date",
    calls=("days_in_month",),
    source='''
def $add_days(date, days):
    """The date `days` (non-negative) days after date."""
    if days < 0:
        raise ValueError("days must not be negative")
    year, month, day = date
    day += days
    while day > $days_in_month(year, month):
        day -= $days_in_month(year, month)
        month += 1
        if month > 12:
            month = 1
            year += 1
    return (year, month, day)
''',
    mutations=(),
    probes=lambda rng: (
        [call("add_days", d, rng.choice([0, 1, 30, 59, 365, rng.randint(2, 400)])) for d in _dates(rng)]
        + [call("add_days", (2023, 1, 1), -1)]
    ),
)

WEEKDAY = Unit(
    key="weekday",
    layer=2,
    names=("weekday", "day_name", "weekday_name"),
    summary="the English name of the day of the week of a date",
    calls=("ordinal",),
    source='''
_DAY_NAMES = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def $weekday(date):
    """The English name of the day of the week of a date."""
    return _DAY_NAMES[($ordinal(date) + 6) % 7]
''',
    mutations=(
        Mutation(kind="wrong_constant", find="($ordinal(date) + 6) % 7", replace="($ordinal(date) + 7) % 7"),
    ),
    probes=lambda rng: [call("weekday", d) for d in _dates(rng)],
)

CALENDAR = Family(
    key="calendar",
    description="Calendar arithmetic on (year, month, day) tuples in the proleptic Gregorian calendar.",
    packages=("almanac", "datekit", "daybook", "chronicle", "calends"),
    topics=("dates", "calendar", "days"),
    units=(IS_LEAP, DAYS_IN_MONTH, QUARTER, DAY_OF_YEAR, ORDINAL, DAYS_BETWEEN, ADD_DAYS, WEEKDAY),
)
