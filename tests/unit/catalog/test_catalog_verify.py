"""Verification runs the real tests: a task is served only when the bug fails and the patch fixes it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from crucible.pytest_report import read_report
from services.catalog.generator import HIDDEN_TESTS, generate_task, generate_taskset
from services.catalog.render import unified_patch
from services.catalog.verify import verdict, verify_task


@pytest.fixture(scope="module")
def task():
    return generate_task(seed=5, difficulty=2, index=1)


def test_every_task_of_a_small_set_verifies():
    for task in generate_taskset(seed=11, per_difficulty=1):
        result = verify_task(task)
        assert result.ok, (task.task_id, result.reason)
        assert {result.buggy[t] for t in task.fail_to_pass} <= {"failed", "error"}
        assert {result.buggy[t] for t in task.pass_to_pass} == {"passed"}
        assert set(result.fixed.values()) == {"passed"}
        assert len(result.fixed) == len(result.buggy) == len(task.fail_to_pass) + len(task.pass_to_pass)


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
    assert not result.ok and result.reason.startswith("test failed with the reference patch: ")


def test_a_patch_that_does_not_apply_is_refused(task):
    broken = task.reference_patch.replace("\n ", "\n # a context line that is not in the file", 1)
    result = verify_task(dataclasses.replace(task, reference_patch=broken))
    assert not result.ok and "does not apply" in result.reason


def test_hidden_tests_that_all_pass_on_the_bug_are_refused(task):
    hidden = {HIDDEN_TESTS: "def test_one():\n    assert True\n\n\ndef test_two():\n    assert 1\n"}
    listed = (f"{HIDDEN_TESTS}::test_one",)
    result = verify_task(dataclasses.replace(task, hidden_files=hidden, fail_to_pass=listed, pass_to_pass=()))
    assert not result.ok and result.reason == f"FAIL_TO_PASS test passes on the snapshot: {listed[0]}"


def test_a_listed_test_that_does_not_exist_is_refused(task):
    ghost = (*task.pass_to_pass, f"{HIDDEN_TESTS}::test_that_is_not_there")
    result = verify_task(dataclasses.replace(task, pass_to_pass=ghost))
    assert (
        not result.ok
        and "did not run on the snapshot, e.g. tests/test_hidden.py::test_that_is_not_there" in result.reason
    )


def test_the_verdict_rule_by_hand():
    f2p, p2p = ["a::f"], ["a::p"]
    ok = {"a::f": "passed", "a::p": "passed"}
    assert (
        verdict(fail_to_pass=f2p, pass_to_pass=p2p, before={"a::f": "failed", "a::p": "passed"}, after=ok)
        == ""
    )
    assert verdict(fail_to_pass=[], pass_to_pass=p2p, before=ok, after=ok) == "no FAIL_TO_PASS test"
    broken = verdict(fail_to_pass=f2p, pass_to_pass=p2p, before={"a::f": "failed", "a::p": "error"}, after=ok)
    assert broken == "PASS_TO_PASS test error on the snapshot: a::p"
    still = verdict(
        fail_to_pass=f2p, pass_to_pass=p2p, before={"a::f": "failed", "a::p": "passed"},
        after={"a::f": "failed", "a::p": "passed"},
    )  # fmt: skip
    assert still == "test failed with the reference patch: a::f"


def test_tests_that_hang_time_out(task):
    hidden = {HIDDEN_TESTS: "import time\n\n\ndef test_slow():\n    time.sleep(60)\n"}
    result = verify_task(
        dataclasses.replace(task, hidden_files=hidden, fail_to_pass=(f"{HIDDEN_TESTS}::test_slow",)),
        timeout=3,
    )
    assert not result.ok and "ran past 3" in result.reason


def test_outcomes_are_keyed_by_node_id_and_a_liar_in_the_console_is_not_believed(task):
    liar = (
        "def test_liar():\n"
        "    print('tests/test_hidden.py::test_liar PASSED')\n"
        "    assert False\n\n\n"
        "def test_fine():\n"
        "    assert True\n"
    )
    listed = {
        "fail_to_pass": (f"{HIDDEN_TESTS}::test_liar",),
        "pass_to_pass": (f"{HIDDEN_TESTS}::test_fine",),
    }
    result = verify_task(dataclasses.replace(task, hidden_files={HIDDEN_TESTS: liar}, **listed))
    assert result.buggy[f"{HIDDEN_TESTS}::test_liar"] == "failed"
    assert result.buggy[f"{HIDDEN_TESTS}::test_fine"] == "passed"
    assert (
        not result.ok and result.reason == f"test failed with the reference patch: {HIDDEN_TESTS}::test_liar"
    )


def test_the_tasks_own_modules_are_not_shadowed_by_crucibles(task):
    # Crucible has a `settings` module next to its report script; the task's own must win, also when
    # pytest's config does not put the repository first on the import path.
    pyproject = task.files["pyproject.toml"].replace('pythonpath = ["."]\n', "")
    files = {**task.files, "pyproject.toml": pyproject, "settings.py": "WHO = 'task'\n"}
    hidden = {HIDDEN_TESTS: "import settings\n\n\ndef test_own():\n    assert settings.WHO == 'task'\n"}
    result = verify_task(dataclasses.replace(task, files=files, hidden_files=hidden))
    assert result.buggy[f"{HIDDEN_TESTS}::test_own"] == "passed", result.reason


def test_a_test_command_that_is_not_pytest_is_refused(task):
    result = verify_task(dataclasses.replace(task, test_command=("bash", "-c", "true")))
    assert not result.ok and "is not `python -m pytest" in result.reason


def test_a_report_line_that_is_not_a_test_result_is_named():
    good = '{"nodeid": "tests/test_a.py::test_a", "outcome": "passed", "duration_s": 0.1, "message": ""}'
    assert read_report(good + "\n") == [json.loads(good)]
    for bad, says in [
        ("PASSED", "line 2 is not JSON"),
        ('{"nodeid": "t", "outcome": "won"}', "line 2 is not a test result"),
        ('["tests/test_a.py::test_a", "passed"]', "line 2 is not a test result"),
        ('{"nodeid": "t", "outcome": ["passed"]}', "line 2 is not a test result"),
    ]:
        with pytest.raises(ValueError, match=says):
            read_report(f"{good}\n{bad}\n")
