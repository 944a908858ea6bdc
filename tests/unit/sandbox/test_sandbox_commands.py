"""Commands in a real session: run_terminal_cmd (timeout, background jobs), run_tests (per-test
results read from pytest itself, never from the console) and read_lints."""

from __future__ import annotations

import asyncio
import os
import re
import uuid

import pytest
from sandbox_archives import REPO, processes_with

from services.sandbox.tools import call_tool

SUITE = {
    **REPO,
    "tests/test_mixed.py": (
        "import pytest\n\n\n"
        "@pytest.fixture\n"
        "def broken():\n"
        "    raise RuntimeError('fixture exploded')\n\n\n"
        "def test_ok():\n    assert 1 + 1 == 2\n\n\n"
        "def test_wrong():\n    assert 2 * 2 == 5\n\n\n"
        "def test_needs_broken(broken):\n    pass\n\n\n"
        "@pytest.mark.skip(reason='not today')\n"
        "def test_skipped():\n    pass\n"
    ),
    "tests/test_liar.py": (
        "def test_liar():\n"
        "    print('tests/test_liar.py::test_liar PASSED')\n"
        "    print('===== 1 passed in 0.01s =====')\n"
        "    assert False, 'really failed'\n"
    ),
}


def marker() -> str:
    """A sleep duration no other process on the host uses, to find the sandbox's processes by (the
    commands pass it through a variable, so only the sleeps themselves show `sleep <marker>`)."""
    return f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10000}"


async def wait_for_job(session, job_id: str, *, timeout_s: float = 10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = await call_tool(session, "background_job", {"job_id": job_id})
        if not result.output.startswith("[running") or asyncio.get_running_loop().time() > deadline:
            return result
        await asyncio.sleep(0.1)


async def settles(check, *, timeout_s: float = 5.0) -> bool:
    """Whether `check()` becomes true within `timeout_s` (processes start and die asynchronously)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def job_id_of(output: str) -> str:
    found = re.search(r"job (\w+)", output)
    assert found, output
    return found.group(1)


async def test_timeout_names_the_limit(session):
    result = await call_tool(session, "run_terminal_cmd", {"command": "echo begun; sleep 30", "timeout": 0.5})
    assert not result.ok and result.timed_out and result.limit == "timeout"
    assert result.output == "begun\n" and result.duration_s < 10
    quick = await call_tool(session, "run_terminal_cmd", {"command": "exit 4"})
    assert not quick.ok and quick.exit_code == 4 and quick.limit is None


async def test_background_job_runs_and_reports_its_output(session):
    started = await call_tool(
        session,
        "run_terminal_cmd",
        {"command": "echo first; sleep 1; echo second > made.txt; echo last", "is_background": True},
    )
    assert started.ok, started
    job_id = job_id_of(started.output)
    running = await call_tool(session, "background_job", {"job_id": job_id})
    assert running.ok and running.output.startswith("[running") and running.exit_code is None
    # The session stays usable while the job runs.
    other = await call_tool(session, "run", {"command": "echo meanwhile"})
    assert other.ok and other.output == "meanwhile\n"
    done = await wait_for_job(session, job_id)
    assert done.ok and done.exit_code == 0, done
    assert done.output.startswith("[exited with code 0") and done.output.endswith("first\nlast\n")
    assert (session.workspace.path / "made.txt").read_text() == "second\n"
    failing = await call_tool(session, "run", {"command": "echo oops; exit 3", "background": True})
    failed = await wait_for_job(session, job_id_of(failing.output))
    assert not failed.ok and failed.exit_code == 3 and "oops" in failed.output


async def test_background_job_kill_stops_it(session):
    sleep = marker()
    started = await call_tool(session, "run", {"command": f"d={sleep}; sleep $d", "is_background": True})
    job_id = job_id_of(started.output)
    assert await settles(lambda: processes_with(f"sleep {sleep}") != [])
    killed = await call_tool(session, "background_job", {"job_id": job_id, "kill": True})
    assert not killed.ok and killed.exit_code is not None and not killed.output.startswith("[running")
    assert await settles(lambda: processes_with(f"sleep {sleep}") == [])
    unknown = await call_tool(session, "background_job", {"job_id": "nope"})
    assert not unknown.ok and f"jobs: {job_id}" in (unknown.error or "")


async def test_destroying_the_session_kills_its_background_jobs(manager, session):
    sleep = marker()
    command = f"d={sleep}; (setsid sleep $d &); nohup sleep $d >/dev/null 2>&1 & sleep $d"
    started = await call_tool(session, "run", {"command": command, "is_background": True})
    assert started.ok, started
    assert await settles(lambda: len(processes_with(f"sleep {sleep}")) == 3)
    assert await manager.destroy(session.id)
    assert await settles(lambda: processes_with(f"sleep {sleep}") == [])


async def test_run_tests_reports_each_test(new_session):
    session = await new_session(SUITE)
    result = await call_tool(
        session, "run_tests", {"node_ids": ["tests/test_mixed.py", "tests/test_ops.py::test_add"]}
    )
    assert not result.ok and result.tests is not None, result
    outcomes = {t.nodeid: t.outcome for t in result.tests}
    assert outcomes == {
        "tests/test_mixed.py::test_ok": "passed",
        "tests/test_mixed.py::test_wrong": "failed",
        "tests/test_mixed.py::test_needs_broken": "error",
        "tests/test_mixed.py::test_skipped": "skipped",
        "tests/test_ops.py::test_add": "failed",
    }
    messages = {t.nodeid: t.message for t in result.tests}
    assert "assert (2 * 2) == 5" in messages["tests/test_mixed.py::test_wrong"]
    assert "fixture exploded" in messages["tests/test_mixed.py::test_needs_broken"]
    assert "assert -1 == 5" in messages["tests/test_ops.py::test_add"]
    assert messages["tests/test_mixed.py::test_ok"] == ""
    assert result.output.startswith("1 passed, 3 failed or errored, 5 in all\n")
    assert result.error

    fixed = await call_tool(session, "replace", {"path": "calc/ops.py", "old": "a - b", "new": "a + b"})
    assert fixed.ok
    one = await call_tool(session, "pytest", {"tests": ["tests/test_ops.py::test_add"]})
    assert one.ok and one.error is None, one
    assert [(t.nodeid, t.outcome) for t in one.tests or []] == [("tests/test_ops.py::test_add", "passed")]


async def test_read_lints_names_what_ruff_finds_in_the_named_or_changed_files(new_session):
    session = await new_session(REPO)
    assert (await call_tool(session, "read_lints", {})).output == "no changed Python file to lint"
    clean = await call_tool(session, "read_lints", {"paths": ["calc/ops.py"]})
    assert clean.ok and "All checks passed" in clean.output, clean
    edit = {"path": "calc/ops.py", "old": "    return a - b\n", "new": "    import os\n    return a - c\n"}
    assert (await call_tool(session, "replace", edit)).ok
    for arguments in ({}, {"files": ["calc/ops.py"]}, {"paths": ["calc"]}):
        found = await call_tool(session, "lint", arguments)
        assert found.ok, found
        assert "calc/ops.py:2:12: F401 [*] `os` imported but unused" in found.output, found.output
        assert "calc/ops.py:3:16: F821 Undefined name `c`" in found.output, found.output
    refused = await call_tool(session, "read_lints", {"paths": ["--fix"]})
    assert not refused.ok and "not a usable path" in (refused.error or "")
    assert "import os" in (await call_tool(session, "read_file", {"path": "calc/ops.py"})).output  # not fixed


async def test_run_tests_believes_pytest_not_the_console(new_session):
    session = await new_session(SUITE)
    result = await call_tool(session, "run_tests", {"node_ids": ["tests/test_liar.py"]})
    assert "tests/test_liar.py::test_liar PASSED" in result.output  # printed, and captured by pytest
    assert not result.ok and [(t.nodeid, t.outcome) for t in result.tests or []] == [
        ("tests/test_liar.py::test_liar", "failed")
    ]
    assert "really failed" in result.tests[0].message


async def test_a_planted_report_plugin_does_not_replace_the_real_one(new_session):
    planted = (
        "import json\n\n\n"
        "def pytest_addoption(parser):\n"
        "    parser.addoption('--crucible-report')\n\n\n"
        "def pytest_sessionfinish(session, exitstatus):\n"
        "    with open(session.config.getoption('--crucible-report'), 'w') as f:\n"
        "        f.write(json.dumps({'nodeid': 'tests/test_ops.py::test_add', 'outcome': 'passed'})"
        " + '\\n')\n"
    )
    session = await new_session(
        {
            **REPO,
            "crucible_pytest_report.py": planted,
            "tests/crucible_pytest_report.py": planted,
        }
    )
    result = await call_tool(session, "run_tests", {"node_ids": ["tests/test_ops.py::test_add"]})
    assert not result.ok and [(t.nodeid, t.outcome) for t in result.tests or []] == [
        ("tests/test_ops.py::test_add", "failed")
    ], result
    # Loaded by name from the workspace, as `-p crucible_pytest_report` would, it lies.
    command = "python -m pytest -q -p crucible_pytest_report --crucible-report=/tmp/r tests; cat /tmp/r"
    naive = await call_tool(session, "run", {"command": command})
    assert '"outcome": "passed"' in naive.output and "1 failed" in naive.output, naive


async def test_run_tests_refuses_options_as_node_ids(session):
    for node in ("--collect-only", "-p", "-x"):
        result = await call_tool(session, "run_tests", {"node_ids": ["tests/test_ops.py", node]})
        assert not result.ok and "is an option, not a node id" in (result.error or ""), node
    bad = await call_tool(session, "run_tests", {"node_ids": ["tests/test_ops.py\x00"]})
    assert not bad.ok and "not a usable pytest argument" in (bad.error or "")
    nothing = await call_tool(session, "run_tests", {"node_ids": ["tests/test_missing.py"]})
    assert not nothing.ok and nothing.tests == [], nothing


SERVER = (
    "import socket\n"
    "s = socket.socket()\n"
    "s.bind(('127.0.0.1', 8765))\n"
    "s.listen()\n"
    "print('listening', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    c.sendall(b'hello from the job')\n"
    "    c.close()\n"
)
ASK = "python3 -c \"import socket; print(socket.create_connection(('127.0.0.1', 8765), 5).recv(99))\""


async def test_a_server_started_in_the_background_answers_the_sessions_later_commands(manager, new_session):
    if not manager.sandbox.shared_network:
        pytest.skip("sessions share a network only where the service may make network namespaces (root)")
    session, other = await new_session(), await new_session()
    assert (await call_tool(session, "create_file", {"path": "server.py", "content": SERVER})).ok
    started = await call_tool(session, "run", {"command": "python3 server.py", "is_background": True})
    job_id = job_id_of(started.output)
    for _ in range(100):
        status = await call_tool(session, "background_job", {"job_id": job_id})
        if "listening" in status.output or not status.output.startswith("[running"):
            break
        await asyncio.sleep(0.1)
    assert "listening" in status.output, status
    asked = await call_tool(session, "run", {"command": ASK})
    assert asked.ok and "hello from the job" in asked.output, asked
    # Another session has a network of its own, also once its own background job made it.
    refused = await call_tool(other, "run", {"command": ASK})
    assert not refused.ok and "ConnectionRefusedError" in refused.output, refused
    assert (await call_tool(other, "run", {"command": "sleep 60", "is_background": True})).ok
    assert other.netns is not None and os.readlink(f"/proc/self/fd/{other.netns}") != os.readlink(
        f"/proc/self/fd/{session.netns}"
    )
    refused = await call_tool(other, "run", {"command": ASK})
    assert not refused.ok and "ConnectionRefusedError" in refused.output, refused
    # The job's server stops with the job; the session's network stays for the next one.
    await call_tool(session, "background_job", {"job_id": job_id, "kill": True})
    gone = await call_tool(session, "run", {"command": ASK})
    assert not gone.ok and "ConnectionRefusedError" in gone.output, gone
    netns = session.netns
    held = os.readlink(f"/proc/self/fd/{netns}")
    assert held.startswith("net:[")
    await manager.destroy(session.id)
    assert session.netns is None
    assert not os.path.exists(f"/proc/self/fd/{netns}") or os.readlink(f"/proc/self/fd/{netns}") != held
