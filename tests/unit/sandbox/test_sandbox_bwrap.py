"""The sandbox policy, run for real: isolation, timeouts that kill the whole tree, output caps."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest
from sandbox_archives import processes_with

from services.sandbox.isolation.bwrap import Bind, Sandbox


@pytest.fixture
def tmp_path(sandbox_root):
    """A folder the unprivileged sandbox uid can reach (pytest's own is below a 0700 one)."""
    path = sandbox_root / f"t-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o755)
    return path


async def run_in(
    sandbox: Sandbox, workspace: Path, command: str, *, timeout_s: float = 30.0, output_cap: int = 65536
):
    workspace.mkdir(parents=True, exist_ok=True)
    if sandbox.owner is not None:
        os.chown(workspace, *sandbox.owner)
    return await sandbox.run(
        ["bash", "-c", command], workspace=workspace, timeout_s=timeout_s, output_cap=output_cap
    )


async def test_runs_a_command_in_the_workspace(sandbox, tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "hello.txt").write_text("hi from the host\n")
    result = await run_in(sandbox, tmp_path / "ws", "pwd; cat hello.txt; echo out > made.txt; id -un; exit 3")
    assert result.output.splitlines() == ["/workspace", "hi from the host", "sandbox"]
    assert (result.ok, result.exit_code, result.timed_out) == (False, 3, False)
    assert (tmp_path / "ws" / "made.txt").read_text() == "out\n"


async def test_python_and_pytest_run_inside(sandbox, tmp_path):
    result = await run_in(
        sandbox,
        tmp_path / "ws",
        "python -c 'import sys; print(sys.version_info[0])' && python -m pytest --version",
    )
    assert result.ok, result.output
    assert result.output.startswith("3\n") and "pytest" in result.output


async def test_timeout_kills_the_child_and_its_grandchildren(sandbox, tmp_path):
    marker = f"{1000 + uuid.uuid4().int % 9000}.{uuid.uuid4().int % 1000}"
    command = (
        f"(setsid sleep {marker} &); (nohup sleep {marker} >/dev/null 2>&1 &); echo started; sleep {marker}"
    )
    result = await run_in(sandbox, tmp_path / "ws", command, timeout_s=1.0)
    assert result.timed_out and not result.ok and result.exit_code is None
    assert result.output == "started\n"
    assert result.duration_s < 10
    assert processes_with(f"sleep {marker}") == []


async def test_output_cap_keeps_head_and_tail(sandbox, tmp_path):
    result = await run_in(sandbox, tmp_path / "ws", "seq 1 100000", output_cap=1000)
    assert result.ok and result.truncated
    assert result.output.startswith("1\n2\n3\n")
    assert result.output.endswith("99999\n100000\n")
    assert "bytes of output omitted" in result.output
    assert len(result.output) < 1100


async def test_network_is_unreachable_inside(sandbox, tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from the host
        probe = f"python -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\""
        result = await run_in(sandbox, tmp_path / "ws", probe + " && echo connected")
    assert not result.ok
    assert "connected" not in result.output and "ConnectionRefusedError" in result.output


async def test_pytest_inside_loads_none_of_the_services_plugins(sandbox, tmp_path):
    """The Python inside is the service's; its plugins (pytest-asyncio warns on every run without a
    config) would fill the agent's observation with text about Crucible's environment, not the task."""
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    result = await run_in(sandbox, tmp_path / "ws", "python -m pytest -q -p no:cacheprovider")
    assert result.ok, result.output
    assert "1 passed" in result.output
    assert "warning" not in result.output.lower() and "asyncio" not in result.output, result.output


async def test_host_environment_and_files_are_not_visible(sandbox, tmp_path, monkeypatch):
    monkeypatch.setenv("CRUCIBLE_SANDBOX_SECRET", "s3cr3t-value")
    host_dir = tmp_path / "host-only"
    host_dir.mkdir()
    (host_dir / "secret.txt").write_text("host data")
    result = await run_in(
        sandbox, tmp_path / "ws", f"env; ls {host_dir} 2>&1; cat /etc/passwd; tr '\\0' '\\n' </proc/1/environ"
    )
    assert "s3cr3t-value" not in result.output and "CRUCIBLE_SANDBOX_SECRET" not in result.output
    assert "HOME=/tmp" in result.output and "PYTHONDONTWRITEBYTECODE=1" in result.output
    assert "No such file or directory" in result.output and "host data" not in result.output
    assert "sandbox:x:1000" in result.output


async def test_system_is_read_only_and_privileges_dropped(sandbox, tmp_path):
    command = "touch /usr/crucible-probe; grep CapEff /proc/self/status; unshare -U true || echo no-userns"
    result = await run_in(sandbox, tmp_path / "ws", command)
    assert "Read-only file system" in result.output
    assert "CapEff:\t0000000000000000" in result.output
    assert not Path("/usr/crucible-probe").exists()
    if sandbox.disable_userns:
        assert "no-userns" in result.output


async def test_read_only_paths_under_the_hosts_tmp_stay_visible(sandbox, tmp_path):
    """An interpreter or venv installed under /tmp (a CI checkout, say) must not vanish behind the
    sandbox's private /tmp."""
    import dataclasses
    import tempfile

    tool_dir = Path(tempfile.mkdtemp(prefix="crucible-ro-"))
    try:
        (tool_dir / "marker.txt").write_text("visible\n")
        tool_dir.chmod(0o755)
        with_tmp = dataclasses.replace(
            sandbox, ro_binds=[*sandbox.ro_binds, Bind(source=tool_dir, dest=str(tool_dir))]
        )
        result = await run_in(with_tmp, tmp_path / "ws", f"cat {tool_dir}/marker.txt; touch {tool_dir}/x")
        assert result.output.startswith("visible\n")
        assert not (tool_dir / "x").exists()
    finally:
        (tool_dir / "marker.txt").unlink()
        tool_dir.rmdir()


async def test_private_tmp_is_size_limited(sandbox, tmp_path):
    if not sandbox.tmp_bytes:
        pytest.skip("this bubblewrap cannot size a tmpfs (--size needs 0.8)")
    result = await run_in(sandbox, tmp_path / "ws", "df -B1 --output=size /tmp | tail -1")
    assert result.ok and int(result.output) == sandbox.tmp_bytes


async def test_bubblewraps_own_process_shows_no_host_path(sandbox, tmp_path):
    result = await run_in(
        sandbox, tmp_path / "ws", "tr '\\0' ' ' </proc/1/cmdline; echo; wc -c </proc/1/environ"
    )
    cmdline, environ = result.output.splitlines()
    words = cmdline.split()
    assert words[1] == "--args" and words[2].isdigit() and words[3] == "--"
    assert str(tmp_path) not in cmdline and "/workspace" not in words[:4]
    assert environ == "0"
