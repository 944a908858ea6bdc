"""The sandbox service over real NATS and S3: sessions from snapshots, tools, diffs, patches, errors."""

from __future__ import annotations

import asyncio
import sys

import psutil
import pytest
from cli_runner import settings_env
from sandbox_archives_integration import tar_gz

from crucible.bus import Bus, BusTimeout, RemoteError
from crucible.clients.sandbox import PROBE_EVERY_S, PROBE_MISSES, SandboxClient, SandboxLost, SandboxSession
from crucible.contracts.messages import ObjectRef
from crucible.contracts.runconfig import RunConfig
from crucible.outage import Unavailable
from services.api.commands import ConfigCheck, Unservable

pytestmark = pytest.mark.integration

REPO = {
    "calc/__init__.py": "",
    "calc/ops.py": "def add(a, b):\n    return a - b\n",
    "tests/test_ops.py": "from calc.ops import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
}
HIDDEN = {
    "tests/test_hidden.py": "from calc.ops import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"
}


@pytest.fixture
async def snapshot(store):
    return await store.put_bytes(
        "tasksets/test/calc/snapshot.tar.gz", tar_gz(REPO), content_type="application/gzip"
    )


async def test_an_episode_then_grading_in_a_fresh_session(bus, store, snapshot, service):
    client = SandboxClient(bus)
    async with await client.create(run_id="run-1", task_id="calc-1", snapshot=snapshot) as box:
        assert box.replica == service.settings.replica
        listing = await box.tool("list_dir", path="calc")
        assert listing.ok and [line.split()[0] for line in listing.output.splitlines()] == [
            "__init__.py",
            "ops.py",
        ]
        found = await box.tool("grep", pattern="return", include="*.py")
        assert found.output == "calc/ops.py:2:    return a - b"
        edited = await box.tool("replace", path="calc/ops.py", old="a - b", new="a + b")
        assert edited.ok, edited
        refused = await box.tool("read_file", path="../../etc/passwd")
        assert not refused.ok and "outside the workspace" in (refused.error or "")
        diff = await box.diff()
        assert "+    return a + b" in diff

    with pytest.raises(RemoteError) as err:
        await box.tool("list_dir")
    assert err.value.code == "unknown_session"

    hidden = await store.put_bytes("tasksets/test/calc/hidden.tar.gz", tar_gz(HIDDEN))
    async with await client.create(run_id="run-1", task_id="calc-1", snapshot=snapshot) as grading:
        assert (await grading.apply_patch(diff)).ok
        assert (await grading.overlay(hidden)).ok
        tests = await grading.run(
            ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], timeout_s=60
        )
        assert tests.ok and "2 passed" in tests.output, tests.output
        shell = await grading.run("echo $HOME; exit 4", timeout_s=10, output_cap=1024)
        assert (shell.output, shell.exit_code) == ("/tmp\n", 4)


async def test_fork_copies_a_prepared_workspace_into_independent_sessions(bus, snapshot, service):
    async with await SandboxClient(bus).create(run_id="r", task_id="t", snapshot=snapshot) as prepared:
        assert (await prepared.tool("replace", path="calc/ops.py", old="a - b", new="a + b")).ok
        copies = await prepared.fork(3)
        assert len({c.session_id for c in copies} | {prepared.session_id}) == 4
        assert {c.replica for c in copies} == {service.settings.replica}
        await copies[0].tool("create_file", path="only_here.txt", content="0")
        for i, copy in enumerate(copies):
            async with copy:
                assert "return a + b" in (await copy.tool("read_file", path="calc/ops.py")).output
                here = await copy.tool("read_file", path="only_here.txt")
                assert here.ok == (i == 0)
        assert not (await prepared.tool("read_file", path="only_here.txt")).ok
    with pytest.raises(RemoteError) as err:
        await copies[1].diff()
    assert err.value.code == "unknown_session"


@pytest.mark.parametrize("sandbox_settings", [{"max_sessions": 3}], indirect=True)
async def test_fork_beyond_the_replica_capacity_answers_busy(bus, snapshot):
    async with await SandboxClient(bus).create(run_id="r", task_id="t", snapshot=snapshot) as prepared:
        with pytest.raises(RemoteError) as err:
            await prepared.fork(3)
        assert err.value.code == "busy"
        with pytest.raises(RemoteError) as err:
            await prepared.fork(0)
        assert err.value.code == "bad_request"


async def test_unknown_session_and_bad_requests(bus, snapshot, service):
    ghost = SandboxSession(
        bus, session_id="no-such-session", replica=service.settings.replica, call_timeout_s=10
    )
    with pytest.raises(RemoteError) as err:
        await ghost.diff()
    assert err.value.code == "unknown_session"
    assert await ghost.destroy() is False
    async with await SandboxClient(bus).create(run_id="r", task_id="t", snapshot=snapshot) as box:
        unknown = await box.tool("rm_rf")
        assert not unknown.ok and "unknown tool" in (unknown.error or "")
        with pytest.raises(RemoteError) as err:
            await box.run([], timeout_s=5)
        assert err.value.code == "bad_request"


async def test_snapshot_with_a_wrong_checksum_is_refused(bus, snapshot):
    forged = ObjectRef(uri=snapshot.uri, sha256="0" * 64, size=snapshot.size)
    with pytest.raises(RemoteError) as err:
        await SandboxClient(bus).create(run_id="r", task_id="t", snapshot=forged)
    assert err.value.code == "bad_snapshot" and "IntegrityError" in err.value.detail


@pytest.mark.parametrize("sandbox_settings", [{"max_sessions": 1}], indirect=True)
async def test_a_full_replica_answers_busy(bus, snapshot):
    client = SandboxClient(bus)
    async with await client.create(run_id="r", task_id="t", snapshot=snapshot):
        with pytest.raises(RemoteError) as err:
            await client.create(run_id="r", task_id="t", snapshot=snapshot)
        assert err.value.code == "busy"


async def test_shutdown_destroys_every_session(bus, snapshot, service):
    box = await SandboxClient(bus).create(run_id="r", task_id="t", snapshot=snapshot)
    root = service.settings.workspace_root / service.settings.replica
    assert (root / "sessions" / box.session_id / "merged" / "calc" / "ops.py").exists()
    service.stopping.set()
    for _ in range(100):
        if not root.exists():
            break
        await asyncio.sleep(0.1)
    assert not root.exists()


async def test_a_call_on_a_replica_that_dies_fails_within_seconds_not_at_its_deadline(
    sandbox_settings, store, snapshot, tmp_path
):
    """A long command runs when its replica is killed outright: the client's probes find the replica
    gone and raise SandboxLost (an outage, for the caller to ride out) instead of waiting two minutes."""
    log = (tmp_path / "sandbox.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.sandbox", env=settings_env(sandbox_settings), stdout=log, stderr=log
    )
    bus = await Bus.connect(sandbox_settings, store=store, name="test-client")
    loop = asyncio.get_running_loop()
    try:
        deadline = loop.time() + 60
        while True:  # until the replica serves
            assert process.returncode is None, (tmp_path / "sandbox.log").read_text()
            try:
                box = await SandboxClient(bus).create(run_id="run-1", task_id="calc-1", snapshot=snapshot)
                break
            except BusTimeout:
                assert loop.time() < deadline, "the sandbox replica never served"
        call = asyncio.create_task(box.run("sleep 120", timeout_s=120))
        while not any(p.name() == "sleep" for p in psutil.Process(process.pid).children(recursive=True)):
            assert loop.time() < deadline and not call.done(), "the command never started"
            await asyncio.sleep(0.05)
        process.kill()
        await process.wait()
        killed = loop.time()
        with pytest.raises(SandboxLost, match="stopped answering"):
            await asyncio.wait_for(call, timeout=60)
        assert loop.time() - killed <= (PROBE_MISSES + 1) * PROBE_EVERY_S + 1
        assert issubclass(SandboxLost, Unavailable)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        log.close()
        await bus.close()


@pytest.mark.parametrize("sandbox_settings", [{"max_fork": 2}], indirect=True)
async def test_the_api_refuses_a_run_whose_groups_are_wider_than_a_sandbox_forks(bus, service):
    """The run config check asks a sandbox replica its limits: a group of 3 with forks of at most 2 is
    refused at creation, naming the field and the limit; a group of 2 passes."""
    check = ConfigCheck()
    wide = RunConfig.model_validate({"schedule": {"group_size": 3}})
    with pytest.raises(Unservable) as refused:
        await check(bus, wide)
    assert refused.value.loc == ("body", "config", "schedule", "group_size")
    assert "forks at most 2 copies" in refused.value.msg
    await check(bus, RunConfig.model_validate({"schedule": {"group_size": 2}}))
