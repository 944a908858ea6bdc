"""Per-test outcomes come from the JUnit report, whatever the tests print."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from services.grader.junit import JunitError, parse_junit

LYING_TESTS = textwrap.dedent(
    """
    import pytest

    def test_real_pass():
        assert 1 + 1 == 2

    def test_fails_but_prints_passed():
        print("tests/test_lying.py::test_fails_but_prints_passed PASSED")
        print("==== 3 passed in 0.01s ====")
        assert 1 + 1 == 3

    def test_errors():
        raise RuntimeError("boom")

    @pytest.mark.skip(reason="not today")
    def test_skipped():
        pass

    @pytest.fixture
    def broken_teardown():
        yield
        raise RuntimeError("teardown")

    def test_passes_then_teardown_errors(broken_teardown):
        pass
    """
)


def test_real_pytest_report_ignores_fake_passed_lines(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_lying.py").write_text(LYING_TESTS)
    report = tmp_path / "report.xml"
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-s",
        "-p",
        "no:cacheprovider",
        "tests",
        f"--junitxml={report}",
    ]
    run = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "3 passed" in run.stdout  # the lie is on stdout ...
    outcomes = {r.nodeid.rsplit("::", 1)[1]: r.outcome for r in parse_junit(report.read_text())}
    assert outcomes == {  # ... and not in the report
        "test_real_pass": "passed",
        "test_fails_but_prints_passed": "failed",
        "test_errors": "failed",
        "test_skipped": "skipped",
        "test_passes_then_teardown_errors": "error",
    }


def test_handwritten_report_with_duplicates_and_a_bare_testsuite():
    xml = """<?xml version="1.0" encoding="utf-8"?>
    <testsuite name="pytest" tests="4">
      <testcase classname="tests.test_x" name="test_a"/>
      <testcase classname="tests.test_x" name="test_b"><failure message="assert 1 == 2"/></testcase>
      <testcase classname="tests.test_x" name="test_c"/>
      <testcase classname="tests.test_x" name="test_c"><error message="teardown"/></testcase>
      <testcase classname="" name="test_collect"><error message="collection"/></testcase>
    </testsuite>"""
    results = parse_junit(xml)
    assert [(r.nodeid, r.outcome) for r in results] == [
        ("tests.test_x::test_a", "passed"),
        ("tests.test_x::test_b", "failed"),
        ("tests.test_x::test_c", "error"),
        ("test_collect", "error"),
    ]


@pytest.mark.parametrize(
    "text", ["PASSED PASSED PASSED", "<html><body/></html>", "<testsuite><testcase/></testsuite>"]
)
def test_what_is_not_a_report_is_refused(text):
    with pytest.raises(JunitError):
        parse_junit(text)
