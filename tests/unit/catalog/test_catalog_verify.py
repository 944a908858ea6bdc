"""Verification runs the real tests: a task is served only when the bug fails and the patch fixes it."""

from __future__ import annotations

import dataclasses

import pytest

from services.catalog.generator import HIDDEN_TESTS, generate_task, generate_taskset
from services.catalog.render import unified_patch
from services.catalog.verify import parse_junit, verify_task


@pytest.fixture(scope="module")
def task():
    return generate_task(seed=5, difficulty=2, index=1)


def test_every_task_of_a_small_set_verifies():
    for task in generate_taskset(seed=11, per_difficulty=1):
        result = verify_task(task)
        assert result.ok, (task.task_id, result.reason)
        hidden = {k: v for k, v in result.buggy.items() if "test_hidden" in k}
        assert "failed" in hidden.values() and "passed" in hidden.values()
        assert set(result.fixed.values()) == {"passed"}
        assert len(result.fixed) == len(result.buggy) >= 3


@pytest.mark.slow
def test_every_task_of_a_larger_set_verifies():
    failures = {
        t.task_id: r.reason
        for t in generate_taskset(seed=2, per_difficulty=6)
        if not (r := verify_task(t)).ok
    }
    assert not failures


def test_a_patch_that_does_not_fix_the_bug_is_refused(task):
    noop = unified_patch(
        before=task.files, after={**task.files, "README.md": task.files["README.md"] + "More.\n"}
    )
    result = verify_task(dataclasses.replace(task, reference_patch=noop))
    assert not result.ok and result.reason == "a test fails with the reference patch applied"


def test_a_patch_that_does_not_apply_is_refused(task):
    broken = task.reference_patch.replace("\n ", "\n # a context line that is not in the file", 1)
    result = verify_task(dataclasses.replace(task, reference_patch=broken))
    assert not result.ok and "does not apply" in result.reason


def test_hidden_tests_that_all_pass_on_the_bug_are_refused(task):
    hidden = {HIDDEN_TESTS: "def test_one():\n    assert True\n\n\ndef test_two():\n    assert 1\n"}
    result = verify_task(dataclasses.replace(task, hidden_files=hidden))
    assert not result.ok and result.reason == "no hidden test fails on the buggy repository"


def test_tests_that_hang_time_out(task):
    hidden = {HIDDEN_TESTS: "import time\n\n\ndef test_slow():\n    time.sleep(60)\n"}
    result = verify_task(dataclasses.replace(task, hidden_files=hidden), timeout=3)
    assert not result.ok and "ran past 3" in result.reason


def test_junit_outcomes():
    xml = """<testsuites><testsuite>
      <testcase classname="tests.test_hidden" name="test_a"/>
      <testcase classname="tests.test_hidden" name="test_b"><failure message="x"/></testcase>
      <testcase classname="tests.test_x" name="test_c"><error message="y"/></testcase>
      <testcase classname="tests.test_x" name="test_d"><skipped/></testcase>
    </testsuite></testsuites>"""
    assert parse_junit(xml) == {
        "tests.test_hidden::test_a": "passed",
        "tests.test_hidden::test_b": "failed",
        "tests.test_x::test_c": "error",
        "tests.test_x::test_d": "skipped",
    }
