"""Reward arithmetic, checked against values worked out by hand."""

from __future__ import annotations

import pytest

from crucible.contracts import messages
from services.grader.reward import compute_reward, tool_success_fraction, zero_reward


def results(*outcomes: str) -> list[messages.TestResult]:
    return [messages.TestResult(nodeid=f"t::{i}", outcome=o) for i, o in enumerate(outcomes)]


def calls(*oks: bool) -> list[messages.ToolCall]:
    return [
        messages.ToolCall(
            index=i,
            name="read_file",
            arguments="{}",
            ok=ok,
            output="",
            duration_s=0.1,
            token_start=0,
            token_end=1,
            policy_version=0,
        )  # fmt: skip
        for i, ok in enumerate(oks)
    ]


def test_partial_credit_plus_shaping():
    # 3 of 4 tests pass: 0.75; 2 of 5 tool calls succeed: 0.1 * 0.4 = 0.04; total 0.79.
    reward = compute_reward(
        tests=results("passed", "passed", "failed", "passed"),
        tool_calls=calls(True, False, True, False, False),
    )
    assert reward.tests_passed == 3
    assert reward.tests_total == 4
    assert reward.components == {"tests": pytest.approx(0.75), "tool_success": pytest.approx(0.04)}
    assert reward.total == pytest.approx(0.79)
    assert len(reward.tests) == 4


def test_skipped_and_errors_are_not_passes_and_weight_is_a_parameter():
    # 1 of 4 passes: 0.25; 1 of 1 tool calls: 0.5 * 1.0; total 0.75.
    reward = compute_reward(
        tests=results("passed", "skipped", "error", "failed"), tool_calls=calls(True), shaping_weight=0.5
    )
    assert reward.total == pytest.approx(0.75)
    assert reward.components["tests"] == pytest.approx(0.25)


def test_full_solution_without_tool_calls_scores_one():
    reward = compute_reward(tests=results("passed", "passed"), tool_calls=[])
    assert reward.total == 1.0
    assert reward.components["tool_success"] == 0.0


def test_no_tests_scores_no_test_credit_and_says_so():
    reward = compute_reward(tests=[], tool_calls=calls(True, True))
    assert reward.components["tests"] == 0.0
    assert reward.total == pytest.approx(0.1)
    assert reward.note == "no hidden test ran"


def test_tool_success_fraction_and_zero_reward():
    assert tool_success_fraction(calls()) == 0.0
    assert tool_success_fraction(calls(True, True, False)) == pytest.approx(2 / 3)
    reward = zero_reward(note="diff touches tests/test_x.py")
    assert reward.total == 0.0 and reward.tests_total == 0
    assert set(reward.components.values()) == {0.0}
    assert "tests/test_x.py" in reward.note
