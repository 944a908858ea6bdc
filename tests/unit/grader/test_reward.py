"""Reward arithmetic with SWE-bench semantics, checked against values worked out by hand."""

from __future__ import annotations

import pytest
from reward_options import OPTIONS

from crucible.contracts import messages
from crucible.contracts.runconfig import QualitySection, RewardSection
from services.grader.reward import TERMS, compute_reward, zero_reward

F2P = ["t.py::f1", "t.py::f2"]
P2P = ["t.py::p1", "t.py::p2", "t.py::p3", "t.py::p4"]


def results(**outcomes: str) -> list[messages.TestResult]:
    return [messages.TestResult(nodeid=f"t.py::{name}", outcome=o) for name, o in outcomes.items()]


def calls(*named: tuple[str, bool]) -> list[messages.ToolCall]:
    return [
        messages.ToolCall(
            index=i,
            name=name,
            arguments="{}",
            ok=ok,
            output="",
            duration_s=0.1,
            token_start=0,
            token_end=1,
            policy_version=0,
        )
        for i, (name, ok) in enumerate(named)
    ]


SOLVED = results(f1="passed", f2="passed", p1="passed", p2="passed", p3="passed", p4="passed")
HALF = results(f1="passed", f2="failed", p1="passed", p2="passed", p3="passed", p4="passed")
SOLVED_BUT_BROKE_ONE = results(f1="passed", f2="passed", p1="passed", p2="failed", p3="passed", p4="passed")
BEFORE = results(f1="failed", f2="error", p1="passed", p2="passed", p3="passed", p4="passed")


def reward(tests, options=None, **kwargs):
    kwargs.setdefault("changed", True)
    return compute_reward(tests=tests, fail_to_pass=F2P, pass_to_pass=P2P, options=options, **kwargs)


def test_resolved_is_all_or_nothing():
    assert reward(SOLVED).total == 1.0 and reward(SOLVED).resolved
    assert reward(HALF).total == 0.0 and not reward(HALF).resolved
    broke = reward(SOLVED_BUT_BROKE_ONE)
    assert broke.total == 0.0 and not broke.resolved
    assert broke.fail_to_pass == [2, 2] and broke.pass_to_pass == [3, 4]


def test_partial_credit_over_fail_to_pass_is_gated_on_pass_to_pass():
    options = RewardSection(kind="fail_to_pass")
    assert reward(HALF, options).total == pytest.approx(0.5)
    assert reward(SOLVED_BUT_BROKE_ONE, options).total == 0.0


def test_penalties_and_shaping_by_hand():
    # base 1; shaping 0.2 x 2/3 ok (submit not counted); tool errors 0.3 x 1/3; length 0.5 x 30/100.
    options = RewardSection(shaping=0.2, tool_error_penalty=0.3, length_penalty=0.5, pass_to_pass_penalty=1.0)
    tools = calls(("read_file", True), ("replace", True), ("run", False), ("submit", True))
    r = reward(SOLVED, options, tool_calls=tools, sampled_tokens=30, token_budget=100)
    assert r.components == {
        "base": 1.0,
        "shaping": pytest.approx(0.2 * 2 / 3),
        "pass_to_pass_penalty": 0.0,
        "length_penalty": pytest.approx(-0.15),
        "tool_error_penalty": pytest.approx(-0.1),
        "quality": 0.0,
    }
    assert r.total == pytest.approx(1 + 0.2 * 2 / 3 - 0.15 - 0.1)
    # One of four PASS_TO_PASS broken: base 0, penalty 1.0 x 1/4.
    broke = reward(SOLVED_BUT_BROKE_ONE, options, sampled_tokens=0)
    assert broke.components["pass_to_pass_penalty"] == pytest.approx(-0.25)
    assert broke.total == pytest.approx(-0.25)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{v}" for v in o.model_dump().values()))
def test_doing_nothing_scores_exactly_zero_under_every_option(options):
    busy = calls(("read_file", True), ("list_dir", True), ("submit", True))
    for tests in (BEFORE, []):  # the tests run on the unchanged repository, or not run at all
        r = compute_reward(
            tests=tests, fail_to_pass=F2P, pass_to_pass=P2P, changed=False, tool_calls=busy,
            sampled_tokens=80, token_budget=100, options=options,
        )  # fmt: skip
        assert r.total == 0.0 and not r.resolved
        assert set(r.components) == set(TERMS) and set(r.components.values()) == {0.0}
        # Even counted as a change, the snapshot's outcomes earn no base reward: FAIL_TO_PASS all fail.
        assert reward(BEFORE, options).components["base"] == 0.0


def test_missing_tests_count_as_not_passed_and_zero_reward():
    r = reward(results(f1="passed"))
    assert r.fail_to_pass == [1, 2] and r.pass_to_pass == [0, 4] and r.total == 0.0
    z = zero_reward(note="diff touches tests/test_x.py")
    assert z.total == 0.0 and z.tests_total == 0 and set(z.components.values()) == {0.0}
    assert "tests/test_x.py" in z.note
    assert "no FAIL_TO_PASS" in compute_reward(tests=[], fail_to_pass=[], pass_to_pass=[], changed=True).note


MEASURES = {"lint_introduced": 2.0, "diff_size_ratio": 1.5, "files_outside_reference": 6.0,
            "repetition": 0.25, "tests_added": 1.0, "tool_calls": 3.0}  # fmt: skip


def test_quality_terms_by_hand_for_a_resolved_change_only():
    weights = QualitySection(lint=0.1, size=0.2, outside=0.1, repetition=0.4, tests=0.05)
    options = RewardSection(quality=weights)
    r = reward(SOLVED, options, quality=MEASURES)
    # lint 0.1 x 2/5, size 0.2 x 0.5, outside 0.1 x min(1, 6/3), repetition 0.4 x 0.25; tests +0.05.
    expected = -(0.04 + 0.1 + 0.1 + 0.1) + 0.05
    assert r.components["quality"] == pytest.approx(expected) and r.total == pytest.approx(1 + expected)
    assert r.quality == MEASURES
    # Measures no worse than the reference's cost nothing; a measure that could not be taken neither.
    clean = {"lint_introduced": -1.0, "diff_size_ratio": 0.5, "files_outside_reference": 0.0}
    assert reward(SOLVED, options, quality=clean).total == 1.0
    # Unresolved, partly solved or unchanged: no quality term, no measures kept.
    for tests, kind in ((HALF, "resolved"), (HALF, "fail_to_pass"), (SOLVED_BUT_BROKE_ONE, "resolved")):
        r = reward(tests, RewardSection(kind=kind, quality=weights), quality=MEASURES)
        assert r.components["quality"] == 0.0 and r.quality == {}
    # Off (the default): measured (an evaluation) but not paid.
    measured = reward(SOLVED, RewardSection(), quality=MEASURES)
    assert measured.total == 1.0 and measured.quality == MEASURES
