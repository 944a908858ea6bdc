"""Probes: how a generated task's hidden tests are judged where the code under test cannot reach.

A generated task knows what each hidden test expects: the value (or the builtin exception) the fixed
code gives for one call. Written into the test as `assert f(x) == 3`, the expected value would enter the
sandbox, where the code under test runs in pytest's process and can read it from the caller's frame, or
return an object equal to anything, or rewrite pytest's reports. So the hidden tests hold only the call:
each hands a function to the `crucible_probe` fixture (`crucible.pytest_report`), which runs it and
writes what came back, as a Python literal, or the exception's class name, into the report. The
expected values stay in the task's secret (`TaskSecret.probes`), and `judge` compares outside the
sandbox: a probe test passes only when pytest passed it and what it recorded is the expected outcome.
Forging the record buys nothing without knowing the value, which never entered the sandbox.

The comparison is the one the generator uses to tell the fixed code from the buggy one (`same_value`):
floats (and flat containers of numbers holding one) as `pytest.approx` does, everything else by type
and equality.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgspec

from crucible import pyast
from crucible.contracts.messages import Expected, Probed, TestResult
from crucible.pytest_report import VALUE_CHARS


def wants_approx(value: object) -> bool:
    """Floats, and flat lists, tuples or dicts of numbers that hold a float, compare approximately."""
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        return numbers and any(isinstance(v, float) for v in value)
    return False


def approx_equal(expected: object, actual: object) -> bool:
    """The comparison `pytest.approx` makes with its default tolerances."""

    def close(a: object, b: object) -> bool:
        if not isinstance(b, (int, float)) or isinstance(b, bool):
            return False
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)  # type: ignore[arg-type]

    if isinstance(expected, float):
        return close(expected, actual)
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and expected.keys() == actual.keys()
            and all(close(expected[k], actual[k]) for k in expected)
        )
    return (
        isinstance(actual, type(expected))
        and len(actual) == len(expected)  # type: ignore[arg-type]
        and all(close(a, b) for a, b in zip(expected, actual, strict=True))  # type: ignore[call-overload]
    )


def same_value(expected: object, actual: object) -> bool:
    """Whether a test expecting `expected` passes when the code returns `actual`."""
    if wants_approx(expected):
        return approx_equal(expected, actual)
    return type(expected) is type(actual) and expected == actual


def read_literal(text: str) -> tuple[bool, object]:
    """(True, the value) when `text` is a Python literal of bounded size, else (False, None)."""
    if len(text) > VALUE_CHARS:
        return False, None
    try:
        return True, pyast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def mismatch(expected: Expected, probed: Probed | None) -> str:
    """Why `probed` is not the expected outcome ("" when it is). The reason never tells the expected value."""
    if probed is None:
        return "the probe recorded nothing"
    if probed.unusable:
        return f"the probe's value is not a plain literal: {probed.unusable}"[:300]
    if expected.error is not None:
        if probed.raised is not None:
            return (
                ""
                if probed.raised == expected.error
                else f"raised {probed.raised[:100]}, not the expected error"
            )
        return "returned a value where an error was expected"
    if probed.raised is not None:
        return f"raised {probed.raised[:100]} where a value was expected"
    if probed.value is None:
        return "the probe recorded nothing"
    ok, actual = read_literal(probed.value)
    if not ok:
        return f"the probe's value does not read back: {probed.value[:200]!r}"
    wanted_ok, wanted = read_literal(expected.value or "")
    if not wanted_ok:
        raise ValueError(f"expected value {expected.value!r} is not a literal")
    return "" if same_value(wanted, actual) else f"returned {probed.value[:200]}, not the expected value"


def judge(tests: Sequence[TestResult], expected: Mapping[str, Expected]) -> list[TestResult]:
    """The results with each probe test's outcome decided here: passed when pytest passed it and it
    recorded the expected outcome, failed otherwise. Other tests keep pytest's outcome."""
    judged = []
    for test in tests:
        wanted = expected.get(test.nodeid)
        if wanted is not None and test.outcome == "passed":
            why = mismatch(wanted, test.probe)
            if why:
                test = msgspec.structs.replace(test, outcome="failed", message=why)
        judged.append(test)
    return judged
