"""Probes: a generated task's hidden tests record what the code gives, under real pytest with Crucible's
report plugin, and `crucible.probes.judge` decides outside; the expected values never reach the files."""

from __future__ import annotations

import ast
import textwrap

import pytest

from crucible.contracts import messages
from crucible.contracts.messages import Expected, Probed
from crucible.probes import judge
from services.catalog.generator import HIDDEN_TESTS, generate_task
from services.catalog.verify import run_tests, write_files

PROBES = """
from mod import answer


def test_value(crucible_probe):
    def call():
        n = 2
        return answer(n)

    crucible_probe(call)


def test_error(crucible_probe):
    crucible_probe(lambda: answer(-1))


def test_floats(crucible_probe):
    crucible_probe(lambda: [answer(1) / 3, 1.0])


def test_no_call(crucible_probe):
    pass
"""
EXPECTED = {
    "tests/test_probes.py::test_value": Expected(value="42"),
    "tests/test_probes.py::test_error": Expected(error="ValueError"),
    "tests/test_probes.py::test_floats": Expected(value="[7.0, 1.0]"),
    "tests/test_probes.py::test_no_call": Expected(value="None"),
}
COMMAND = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_probes.py"]


def outcomes(tmp_path, module: str) -> dict[str, str]:
    repo = tmp_path / "repo"
    write_files(root=repo, files={"mod.py": textwrap.dedent(module), "tests/test_probes.py": PROBES})
    return run_tests(repo=repo, command=COMMAND, timeout=60, probes=EXPECTED)


def test_the_right_outcomes_pass(tmp_path):
    module = """
    def answer(n):
        if n < 0:
            raise ValueError(n)
        return 21 * n if n > 1 else 21.0000001
    """
    got = outcomes(tmp_path, module)
    assert got == {name: "passed" for name in EXPECTED} | {"tests/test_probes.py::test_no_call": "failed"}


@pytest.mark.parametrize(
    "module",
    [
        # wrong values and no error
        "def answer(n):\n    return 41\n",
        # an object equal to anything, and an int subclass that prints as the answer
        "class A:\n    def __eq__(self, o):\n        return True\n\ndef answer(n):\n    return A()\n",
        "class I(int):\n    def __repr__(self):\n        return '42'\n\ndef answer(n):\n    return I(41)\n",
        # an exception of its own, named like the builtin
        "class ValueError(Exception):\n    pass\n\ndef answer(n):\n    raise ValueError(n)\n",
    ],
    ids=["wrong", "equal-to-anything", "int-subclass", "own-valueerror"],
)
def test_what_is_not_the_outcome_fails(tmp_path, module):
    assert set(outcomes(tmp_path, module).values()) == {"failed"}


def test_judge_keeps_pytest_failures_and_other_tests_and_hides_the_expected_value():
    tests = [
        messages.TestResult(nodeid="a", outcome="passed", probe=Probed(value="[1, 2]")),
        messages.TestResult(nodeid="b", outcome="passed", probe=Probed(value="[1, 3]")),
        messages.TestResult(
            nodeid="c", outcome="error", message="setup failed", probe=Probed(value="[1, 2]")
        ),
        messages.TestResult(nodeid="d", outcome="passed"),
        messages.TestResult(nodeid="e", outcome="passed", probe=Probed(value="__import__('os')")),
        messages.TestResult(nodeid="visible", outcome="passed"),
    ]
    wanted = {name: Expected(value="[1, 2]") for name in "abcde"}
    judged = {t.nodeid: t for t in judge(tests, wanted)}
    assert {k: t.outcome for k, t in judged.items()} == {
        "a": "passed", "b": "failed", "c": "error", "d": "failed", "e": "failed", "visible": "passed"
    }  # fmt: skip
    assert judged["b"].message == "returned [1, 3], not the expected value"
    assert judged["d"].message == "the probe recorded nothing"
    assert "does not read back" in judged["e"].message
    assert all("[1, 2]" not in t.message for t in judged.values())


@pytest.mark.parametrize(("difficulty", "index"), [(1, 0), (2, 1), (3, 2), (1, 5), (2, 7)])
def test_generated_hidden_tests_hold_no_expected_value(difficulty, index):
    task = generate_task(seed=3, difficulty=difficulty, index=index)
    source = task.hidden_files[HIDDEN_TESTS]
    tree = ast.parse(source)
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Assert, ast.Compare, ast.With))]
    assert set(task.probes) == {f"{HIDDEN_TESTS}::{name}" for name in _test_names(tree)}
    assert set(task.fail_to_pass) <= set(task.probes)
    for expected in task.probes.values():
        assert (expected.value is None) != (expected.error is None)


def _test_names(tree: ast.Module) -> list[str]:
    return [
        node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    ]
