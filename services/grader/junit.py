"""Per-test outcomes from the JUnit XML report pytest writes: never from its console output, which the
code under test can print anything into."""

from __future__ import annotations

from xml.etree import ElementTree

from crucible.contracts.messages import TestResult

_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


class JunitError(ValueError):
    """The report is not a JUnit XML document."""


def _outcome(case: ElementTree.Element) -> str:
    tags = {child.tag for child in case}
    if "error" in tags:
        return "error"
    if "failure" in tags:
        return "failed"
    if "skipped" in tags:
        return "skipped"
    return "passed"


def parse_junit(xml: str | bytes) -> list[TestResult]:
    """One result per test, in report order; a test reported twice (a teardown error after the call)
    keeps its worse outcome."""
    try:
        root = ElementTree.fromstring(xml)
    except ElementTree.ParseError as exc:
        raise JunitError(f"not XML: {exc}") from exc
    if root.tag not in ("testsuites", "testsuite"):
        raise JunitError(f"root element is <{root.tag}>, not <testsuites> or <testsuite>")
    results: dict[str, str] = {}
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        if not name:
            raise JunitError("a <testcase> has no name")
        nodeid = f"{classname}::{name}" if classname else name
        outcome = _outcome(case)
        if _RANK[outcome] >= _RANK[results.get(nodeid, "passed")]:
            results[nodeid] = outcome
    return [TestResult(nodeid=nodeid, outcome=outcome) for nodeid, outcome in results.items()]
