"""A session's life on a real replica: snapshots unpacked once, forks, the overlay's upper layer as
the agent's work, and the limits (disk quota, memory, process count) that stop a command."""

from __future__ import annotations

import os
import shutil
import stat
import uuid

import pytest
from sandbox_archives import REPO, make_tar

from crucible.bus import RequestError
from services.sandbox.manager import SessionManager
from services.sandbox.settings import Settings
from services.sandbox.tools import call_tool

MiB = 1024 * 1024


@pytest.fixture
async def limited_manager(sandbox_root, archives):
    """Factory: a started replica with some settings changed (closed at the end)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    started: list[SessionManager] = []

    async def fetch(ref):
        return archives[ref.sha256]

    async def start(**overrides) -> SessionManager:
        settings = Settings(workspace_root=sandbox_root, replica=f"unit-{uuid.uuid4().hex[:6]}", **overrides)
        manager = SessionManager(settings=settings, fetch=fetch)
        await manager.start()
        started.append(manager)
        return manager

    yield start
    for manager in started:
        await manager.close()


async def create(manager, archive_ref, files=REPO):
    return await manager.create(run_id="run", task_id="task", snapshot=archive_ref(make_tar(files)), ttl_s=60)


def files_under(folder) -> dict[str, str]:
    """Relative path -> 'file', 'whiteout' (overlay's mark of a deletion) or 'link' below `folder`."""
    found = {}
    for top, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(top, name)
            mode = os.lstat(path).st_mode
            kind = "file" if stat.S_ISREG(mode) else "whiteout" if stat.S_ISCHR(mode) else "link"
            found[os.path.relpath(path, folder)] = kind
    return found


async def edit_the_parent(session) -> None:
    """A replace, a new file from a command, a deletion by a tool and one by a command."""
    assert (await call_tool(session, "replace", {"path": "calc/ops.py", "old": "a - b", "new": "a + b"})).ok
    assert (await call_tool(session, "run", {"command": "echo draft > notes.txt && rm tests/test_ops.py"})).ok
    assert (await call_tool(session, "delete_file", {"path": "README.md"})).ok


async def test_a_snapshot_is_fetched_and_unpacked_once(manager, archive_ref):
    fetched = []
    fetch = manager.fetch

    async def counting(ref):
        fetched.append(ref.sha256)
        return await fetch(ref)

    manager.fetch = counting
    ref = archive_ref(make_tar(REPO))
    first = await manager.create(run_id="run", task_id="task", snapshot=ref, ttl_s=60)
    second = await manager.create(run_id="run", task_id="task", snapshot=ref, ttl_s=60)
    children = await first.exclusive(lambda: manager.fork(first, count=2, ttl_s=60))
    assert fetched == [ref.sha256]
    assert list(manager.snapshots.ready) == [ref.sha256]
    assert {id(s.workspace.snapshot) for s in [first, second, *children]} == {id(first.workspace.snapshot)}
    assert first.workspace.snapshot.users == 4
    # Each session writes its own copy; the shared snapshot is never touched.
    assert (
        await call_tool(first, "create_file", {"path": "calc/ops.py", "content": "", "overwrite": True})
    ).ok
    assert (second.workspace.path / "calc/ops.py").read_text() == REPO["calc/ops.py"]
    assert (first.workspace.snapshot.tree / "calc/ops.py").read_text() == REPO["calc/ops.py"]
    for session in [first, second, *children]:
        await manager.destroy(session.id)
    assert first.workspace.snapshot.users == 0 and list(manager.snapshots.ready) == [ref.sha256]
    await manager.create(run_id="run", task_id="task", snapshot=ref, ttl_s=60)
    assert fetched == [ref.sha256]


async def test_fork_copies_the_current_files_into_independent_sessions(manager, session):
    await edit_the_parent(session)
    parent_diff = await session.diff()
    left, right = await session.exclusive(lambda: manager.fork(session, count=2, ttl_s=60))
    assert {left.id, right.id, session.id} == set(manager.sessions)
    for child in (left, right):
        ws = child.workspace.path
        assert (ws / "calc/ops.py").read_text().startswith("def add(a, b):\n    return a + b\n")
        assert (ws / "notes.txt").read_text() == "draft\n"
        assert not (ws / "README.md").exists() and not (ws / "tests/test_ops.py").exists()
        assert await child.diff() == parent_diff
    # Edits after the fork stay where they were made.
    assert (
        await call_tool(left, "create_file", {"path": "notes.txt", "content": "left\n", "overwrite": True})
    ).ok
    assert (await call_tool(right, "run", {"command": "echo back > README.md"})).ok
    assert (await call_tool(session, "delete_file", {"path": "notes.txt"})).ok
    assert (left.workspace.path / "notes.txt").read_text() == "left\n"
    assert (right.workspace.path / "notes.txt").read_text() == "draft\n"
    assert not (session.workspace.path / "notes.txt").exists()
    assert (right.workspace.path / "README.md").read_text() == "back\n"
    assert (
        not (left.workspace.path / "README.md").exists()
        and not (session.workspace.path / "README.md").exists()
    )
    # A fork's edit history starts empty; a destroyed parent leaves its forks working.
    assert not (await call_tool(left, "undo_edit", {"path": "calc/ops.py"})).ok
    await manager.destroy(session.id)
    tests = await call_tool(
        right, "run", {"command": "python -c 'from calc.ops import add; print(add(2, 3))'"}
    )
    assert tests.ok and tests.output == "5\n"


async def test_fork_refuses_a_bad_count(manager, session):
    for count in (0, manager.settings.max_fork + 1):
        with pytest.raises(RequestError) as err:
            await manager.fork(session, count=count, ttl_s=60)
        assert err.value.code == "bad_request"
    assert list(manager.sessions) == [session.id]


async def test_the_agents_work_is_exactly_the_upper_layer(manager, session):
    if not manager.privileged:
        pytest.skip("overlay workspaces need the service to run as root with mount(2)")
    assert files_under(session.workspace.upper) == {}
    await edit_the_parent(session)
    assert files_under(session.workspace.upper) == {
        "calc/ops.py": "file",
        "notes.txt": "file",
        "tests/test_ops.py": "whiteout",
        "README.md": "whiteout",
    }
    (child,) = await session.exclusive(lambda: manager.fork(session, count=1, ttl_s=60))
    assert files_under(child.workspace.upper) == files_under(session.workspace.upper)


async def test_the_disk_quota_stops_a_large_write(limited_manager, archive_ref, sandbox_root):
    manager = await limited_manager(disk_quota_bytes=8 * MiB)
    if not manager.privileged:
        pytest.skip("the disk quota needs the service to run as root with mount(2)")
    session = await create(manager, archive_ref)
    result = await call_tool(session, "run", {"command": "head -c 20M /dev/zero > big.bin"})
    assert not result.ok and result.limit == "disk", result
    assert "No space left on device" in result.output
    big = session.workspace.upper / "big.bin"
    # What was written sits on the session's tmpfs, within the quota, not on the host's disk.
    assert os.stat(big).st_size <= 8 * MiB
    assert os.stat(big).st_dev == os.stat(session.workspace.root).st_dev != os.stat(sandbox_root).st_dev
    full = await call_tool(session, "create_file", {"path": "more.txt", "content": "x" * 100_000})
    assert not full.ok and "disk quota is full" in (full.error or "")
    assert (await call_tool(session, "delete_file", {"path": "big.bin"})).ok
    again = await call_tool(session, "run", {"command": "head -c 4M /dev/zero > ok.bin"})
    assert again.ok and again.limit is None, again


@pytest.mark.slow
async def test_the_memory_limit_stops_a_large_allocation(limited_manager, archive_ref):
    manager = await limited_manager(memory_bytes=256 * MiB)
    session = await create(manager, archive_ref)
    alone = await call_tool(session, "run", {"command": "python -c 'b = bytearray(1 << 30); print(len(b))'"})
    assert not alone.ok and alone.exit_code != 0 and "MemoryError" in alone.output, alone
    assert alone.limit == "memory"
    if manager.cgroups is None:
        pytest.skip("the session's memory together needs cgroups")
    # Each process stays under its own address-space limit; together they pass the session's memory.
    grab = "python -c 'import time; b = b\"x\" * (150 << 20); time.sleep(3)'"
    command = f"for i in 1 2 3 4; do {grab} & done; fail=0; for p in $(jobs -p); do wait $p || fail=1; done; "
    command += "exit $fail"
    together = await call_tool(session, "run", {"command": command})
    assert not together.ok and together.limit == "memory", together


async def test_the_process_limit_stops_a_fork_loop(limited_manager, archive_ref):
    manager = await limited_manager(max_processes=32)
    session = await create(manager, archive_ref)
    spawn = (
        "python -c 'import subprocess\n"
        "started = []\n"
        "for _ in range(100):\n"
        '    started.append(subprocess.Popen(["sleep", "3"]))\n'
        "print(len(started))'"
    )
    result = await call_tool(session, "run", {"command": spawn})
    assert not result.ok and "100" not in result.output.splitlines(), result
    assert "Resource temporarily unavailable" in result.output
    if manager.cgroups is None:
        pytest.skip("naming the process limit needs cgroups")
    assert result.limit == "processes", result


async def test_copied_workspaces_where_overlays_are_off(settings, archives, archive_ref):
    """The path a service that may not mount takes: full copies, same tools, diff and fork."""

    async def fetch(ref):
        return archives[ref.sha256]

    manager = SessionManager(settings=settings.model_copy(update={"overlay_workspaces": False}), fetch=fetch)
    await manager.start()
    try:
        ref = archive_ref(make_tar({"calc/ops.py": "def add(a, b):\n    return a - b\n", "old.txt": "x\n"}))
        session = await manager.create(run_id="r", task_id="t", snapshot=ref, ttl_s=60)
        assert not session.workspace.overlay and not session.workspace.upper.exists()
        assert (
            await call_tool(session, "replace", {"path": "calc/ops.py", "old": "a - b", "new": "a + b"})
        ).ok
        assert (await session.sandboxed(["bash", "-c", "rm old.txt && echo new > new.txt"])).ok
        diff = await session.diff()
        assert "+    return a + b" in diff and "deleted file mode" in diff and "+new" in diff
        (child,) = await manager.fork(session, count=1, ttl_s=60)
        assert await child.diff() == diff
        assert (await call_tool(child, "create_file", {"path": "only_child.txt", "content": "c"})).ok
        assert "only_child" not in await session.diff()
        roots = [session.workspace.root, child.workspace.root]
    finally:
        await manager.close()
    assert not any(root.exists() for root in roots)
