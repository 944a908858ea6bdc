"""Sessions: diff of the agent's work against the snapshot, patches applied in a fresh copy, overlays."""

from __future__ import annotations

import asyncio

import pytest
from sandbox_archives import make_tar

from crucible.bus import RequestError
from services.sandbox.isolation.archive import BadArchive
from services.sandbox.tools import call_tool


async def test_diff_is_empty_before_any_edit(session):
    assert await session.diff() == ""


async def test_diff_shows_edits_new_and_deleted_files(session):
    await call_tool(session, "replace", {"path": "calc/ops.py", "old": "a - b", "new": "a + b"})
    command = "echo new > notes.txt && rm README.md && mkdir -p __pycache__ && echo x > __pycache__/c.pyc"
    await call_tool(session, "run", {"command": command})
    diff = await session.diff()
    assert "-    return a - b\n+    return a + b\n" in diff
    assert "diff --git a/notes.txt b/notes.txt\nnew file mode 100644" in diff
    assert "diff --git a/README.md b/README.md\ndeleted file mode 100644" in diff
    assert "__pycache__" not in diff


async def test_diff_does_not_leak_a_planted_symlink_target(session):
    await call_tool(session, "run", {"command": "ln -s /etc/shadow leak"})
    diff = await session.diff()
    assert "new file mode 120000" in diff and "+/etc/shadow" in diff
    assert "root:" not in diff


async def test_agent_cannot_touch_the_baseline(session):
    result = await call_tool(session, "run", {"command": "ls -a /crucible 2>&1; git log 2>&1; ls -a"})
    assert "baseline.git" not in result.output and "state" not in result.output.split()
    assert "not a git repository" in result.output
    assert result.output.splitlines()[-1] == "tests"


async def test_apply_patch_reproduces_the_work_in_a_fresh_session(new_session):
    first = await new_session()
    await call_tool(first, "replace", {"path": "calc/ops.py", "old": "a - b", "new": "a + b"})
    await call_tool(first, "run", {"command": "printf '\\x00\\x01binary' > blob.bin"})
    patch = await first.diff()
    second = await new_session()
    applied = await second.apply_patch(patch)
    assert applied.ok, applied
    assert (second.workspace.path / "calc/ops.py").read_text() == (
        first.workspace.path / "calc/ops.py"
    ).read_text()
    assert (second.workspace.path / "blob.bin").read_bytes() == b"\x00\x01binary"
    assert await second.diff() == patch
    tests = await second.sandboxed(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"])
    assert tests.ok and "1 passed" in tests.output


async def test_apply_patch_that_does_not_fit_changes_nothing(session):
    patch = (
        "--- a/calc/ops.py\n+++ b/calc/ops.py\n@@ -1,2 +1,2 @@\n"
        " def add(a, b):\n-    return a * b\n+    return 0\n"
    )
    result = await session.apply_patch(patch)
    assert not result.ok and "patch does not apply" in result.output
    assert await session.diff() == ""
    assert (await session.apply_patch("  \n")).ok


async def test_overlay_lays_files_over_the_workspace(session):
    await session.unpack(make_tar({"tests/test_hidden.py": "def test_hidden():\n    assert True\n"}))
    assert (session.workspace.path / "tests/test_hidden.py").exists()
    assert (session.workspace.path / "tests/test_ops.py").exists()
    with pytest.raises(BadArchive, match="points outside"):
        await session.unpack(make_tar({}, links={"x": "/etc"}))


async def test_overlay_through_a_planted_symlink_cannot_write_outside(session, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (session.workspace.path / "tests_link").symlink_to(outside)
    with pytest.raises(BadArchive, match="cannot unpack"):
        await session.unpack(make_tar({"tests_link/evil.py": "boom"}))
    assert list(outside.iterdir()) == []


async def test_destroy_stops_a_running_call_and_removes_the_workspace(session):
    call = asyncio.create_task(session.exclusive(lambda: call_tool(session, "run", {"command": "sleep 60"})))
    await asyncio.sleep(0.5)
    await session.destroy()
    with pytest.raises(RequestError) as err:
        await asyncio.wait_for(call, timeout=5)
    assert err.value.code == "session_closed"
    assert not session.workspace.root.exists()
    with pytest.raises(RequestError):
        await session.exclusive(session.diff)
