"""The reward of a graded trajectory, as pure functions.

    total = tests + tool_success
    tests        = hidden tests passed / hidden tests run            (0 when none ran)
    tool_success = shaping_weight x tool calls that succeeded / tool calls   (0 without tool calls)

so a full solution with clean tool use scores 1 + shaping_weight. A trajectory disqualified before its
code ran (it touched the tests, or its diff does not apply) scores 0 in every component. Skipped, failed
and erroring tests all count as not passed.
"""

from __future__ import annotations

from collections.abc import Sequence

from crucible.contracts.messages import Reward, TestResult, ToolCall

SHAPING_WEIGHT = 0.1


def tool_success_fraction(tool_calls: Sequence[ToolCall]) -> float:
    if not tool_calls:
        return 0.0
    return sum(1 for call in tool_calls if call.ok) / len(tool_calls)


def compute_reward(
    *,
    tests: Sequence[TestResult],
    tool_calls: Sequence[ToolCall],
    shaping_weight: float = SHAPING_WEIGHT,
    note: str = "",
) -> Reward:
    passed = sum(1 for test in tests if test.outcome == "passed")
    components = {
        "tests": passed / len(tests) if tests else 0.0,
        "tool_success": shaping_weight * tool_success_fraction(tool_calls),
    }
    if not tests and not note:
        note = "no hidden test ran"
    return Reward(
        total=sum(components.values()),
        tests_passed=passed,
        tests_total=len(tests),
        components=components,
        tests=list(tests),
        note=note,
    )


def zero_reward(*, note: str) -> Reward:
    """The reward of a trajectory disqualified before its code ran."""
    return Reward(
        total=0.0, tests_passed=0, tests_total=0, components={"tests": 0.0, "tool_success": 0.0}, note=note
    )
