"""`crucible sandbox run|tool`, run as the real command: JSON out, limits reported, the workspace
directory never written to, clear usage errors, and nothing left behind (also after Ctrl-C)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest
from cli_runner import crucible as crucible_command

from crucible.contracts.sandbox import ToolResult

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
ROOTS = "crucible-sandbox-cli-*"


crucible = functools.partial(crucible_command, timeout=120)  # a sandbox run may import the whole service


def roots() -> set[Path]:
    """The CLI's workspace roots now on this machine."""
    return set(Path("/tmp").glob(ROOTS))


def run(*args: str, **kwargs) -> dict:
    """`crucible sandbox run ARGS`: its JSON, after checking it exited 0 and left no workspace root."""
    before = roots()
    result = crucible("sandbox", "run", *args, **kwargs)
    assert result.returncode == 0, result.stderr
    assert roots() <= before, "the workspace root was left behind"
    return json.loads(result.stdout)


def tool(workspace: Path, name: str, arguments: dict) -> ToolResult:
    result = crucible("sandbox", "tool", "--workspace", str(workspace), name, json.dumps(arguments))
    assert result.returncode == 0, result.stderr
    return msgspec.json.decode(result.stdout, type=ToolResult)


def tree_state(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (root included): mode, size, mtime, and content hash or link target."""
    state = {}
    for folder, dirs, files in os.walk(root):
        for name in [".", *dirs, *files] if folder == str(root) else [*dirs, *files]:
            path = os.path.normpath(os.path.join(folder, name))
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                content = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                content = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            else:
                content = None
            state[os.path.relpath(path, root)] = (st.st_mode, st.st_size, st.st_mtime_ns, content)
    return state


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("def f():\n    return 1\n")
    (root / "README.md").write_text("hello\n")
    (root / "link").symlink_to("pkg/a.py")
    return root


def cgroups_available() -> bool:
    from services.sandbox.isolation.cgroups import Cgroups

    if os.geteuid() != 0:
        return False
    made = Cgroups.detect(
        replica=f"probe-{uuid.uuid4().hex[:8]}", memory_bytes=2**30, max_processes=64, cpus=1
    )
    if made is None:
        return False
    made.close()
    return True


def test_help_lists_both_commands_and_imports_no_sandbox_code() -> None:
    result = crucible("sandbox", "--help")
    assert result.returncode == 0, result.stderr
    assert "run" in result.stdout and "tool" in result.stdout
    probe = "import sys, crucible.cli.main; print(sorted(m for m in sys.modules if m.startswith('services')))"
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    # The commands' own modules (they live with their services), and none of the services' machinery.
    assert imported.stdout.strip() == (
        "['services', 'services.catalog', 'services.catalog.cli', 'services.sandbox', 'services.sandbox.cli']"
    )


@needs_bwrap
def test_run_prints_the_output_as_json() -> None:
    out = run("--", "python", "-c", "print(1)")
    assert out == {
        "exit_code": 0,
        "stdout": "1\n",
        "stderr": "",
        "timed_out": False,
        "truncated": False,
        "duration_s": out["duration_s"],
        "limit": None,
    }


@needs_bwrap
def test_a_failing_command_is_reported_with_stderr_apart() -> None:
    out = run("--", "bash", "-c", "echo out; echo err >&2; exit 3")
    assert (out["exit_code"], out["stdout"], out["stderr"]) == (3, "out\n", "err\n")
    assert out["limit"] is None and not out["timed_out"]


@needs_bwrap
def test_timeout_stops_the_command() -> None:
    started = time.monotonic()
    out = run("--timeout", "1", "--", "sleep", "30")
    assert out["timed_out"] is True and out["limit"] == "timeout" and out["exit_code"] is None
    assert time.monotonic() - started < 20


@needs_bwrap
def test_memory_limit_stops_a_large_allocation() -> None:
    out = run("--memory", "128", "--", "python", "-c", "x = ' ' * 2**30")
    assert out["exit_code"] not in (0, None)
    assert "MemoryError" in out["stderr"] and out["limit"] == "memory"


@needs_bwrap
def test_memory_limit_of_all_processes_together_is_reported() -> None:
    if not cgroups_available():
        pytest.skip("needs per-session cgroups (root and a writable cgroup hierarchy)")
    # Each process stays under its own address-space limit; together they pass the session's cgroup limit.
    hog = 'import time; x = b"x" * (50 << 20); time.sleep(1)'
    out = run("--memory", "128", "--", "bash", "-c", f"for i in 1 2 3 4; do python -c '{hog}' & done; wait")
    assert out["limit"] == "memory", out


@needs_bwrap
def test_the_workspace_directory_is_never_written(repo: Path) -> None:
    before = tree_state(repo)
    script = (
        "cat pkg/a.py; echo new > new.txt; echo more >> README.md; echo via-link > link; "
        "chmod 000 README.md; rm -rf pkg; mkdir made; ls"
    )
    out = run("--workspace", str(repo), "--", "bash", "-c", script)
    assert out["exit_code"] == 0, out
    assert out["stdout"] == "def f():\n    return 1\nREADME.md\nlink\nmade\nnew.txt\n"
    assert tree_state(repo) == before


@needs_bwrap
def test_links_stay_links_and_what_cannot_be_copied_is_left_out(repo: Path) -> None:
    (repo / "outside").symlink_to("/etc/hostname")
    os.mkfifo(repo / "fifo")
    before = roots()
    result = crucible("sandbox", "run", "-w", str(repo), "--", "bash", "-c", "readlink link; ls")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stdout"] == "pkg/a.py\nREADME.md\nlink\npkg\n"
    assert "not copied: fifo (special file)" in result.stderr
    assert "not copied: outside (symlink to '/etc/hostname', outside the directory)" in result.stderr
    assert roots() <= before


@needs_bwrap
def test_tool_calls_run_on_a_copy(repo: Path) -> None:
    before = tree_state(repo)
    read = tool(repo, "read_file", {"path": "link"})
    assert read.ok and read.output == "def f():\n    return 1\n"
    replaced = tool(repo, "replace", {"path": "pkg/a.py", "old": "return 1", "new": "return 2"})
    assert replaced.ok, replaced.error
    missing = tool(repo, "read_file", {"path": "nope.py"})
    assert not missing.ok and "no such file" in (missing.error or "")
    assert tree_state(repo) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["read_file", '{"path": '], "ARGS_JSON is not JSON"),
        (["read_file", '["a.py"]'], "ARGS_JSON must be a JSON object"),
        (["no_such_tool", "{}"], "unknown tool 'no_such_tool'"),
        (["read_file", '{"path": 3}'], "bad arguments for read_file"),
    ],
)
def test_tool_usage_errors_exit_2(repo: Path, args: list[str], message: str) -> None:
    result = crucible("sandbox", "tool", "--workspace", str(repo), *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_a_missing_directory_exits_2(tmp_path: Path) -> None:
    result = crucible("sandbox", "run", "--workspace", str(tmp_path / "nope"), "--", "true")
    assert result.returncode == 2
    assert "no such directory" in result.stderr
    result = crucible("sandbox", "tool", "--workspace", str(tmp_path / "nope"), "read_file", '{"path": "a"}')
    assert result.returncode == 2


def test_a_directory_over_the_snapshot_limit_exits_2(repo: Path) -> None:
    (repo / "big.bin").write_bytes(b"x" * 4096)
    result = crucible(
        "sandbox", "run", "-w", str(repo), "--", "true", env={"CRUCIBLE_MAX_SNAPSHOT_BYTES": "2048"}
    )
    assert result.returncode == 2
    assert "holds more than 2048 bytes" in result.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every directory")
def test_an_unreadable_directory_exits_2(repo: Path) -> None:
    (repo / "pkg").chmod(0)
    try:
        result = crucible("sandbox", "run", "-w", str(repo), "--", "true")
    finally:
        (repo / "pkg").chmod(0o755)
    assert result.returncode == 2
    assert "cannot read" in result.stderr


def test_without_bubblewrap_it_exits_1(tmp_path: Path) -> None:
    before = roots()
    result = crucible("sandbox", "run", "--", "true", env={"PATH": str(tmp_path)})
    assert result.returncode == 1
    assert "the sandbox cannot start" in result.stderr and "bubblewrap" in result.stderr
    assert roots() <= before


def start_sleeping_run(**popen) -> tuple[subprocess.Popen, str, Path]:
    """`crucible sandbox run -- sleep MARKER` started, once its sleep runs: the process, the marker,
    and the workspace root it made."""
    marker = f"{30 + uuid.uuid4().int % 1000 / 1000:.3f}"  # a sleep argument no other process has
    before = roots()
    command = [sys.executable, "-c", "from crucible.cli.main import app; app()", "sandbox", "run", "--"]
    proc = subprocess.Popen([*command, "sleep", marker], **popen)
    deadline = time.monotonic() + 30
    while not sleepers(marker):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError(f"the run did not start its command: {proc.communicate()}")
        time.sleep(0.1)
    (made,) = roots() - before
    return proc, marker, made


@needs_bwrap
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_it_removes_the_sandbox(stop_signal: signal.Signals) -> None:
    proc, marker, made = start_sleeping_run(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.send_signal(stop_signal)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted" in stderr
    assert not sleepers(marker)
    assert not made.exists()
    assert str(made) not in Path("/proc/mounts").read_text()


def sleepers(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == f"sleep\0{marker}\0".encode():
                found.append(int(pid))
        except OSError:
            continue
    return found


async def test_execute_keeps_stderr_apart_when_asked() -> None:
    from services.sandbox.isolation.process import Capture, execute

    argv = ["bash", "-c", "echo out; echo err >&2; head -c 5000 /dev/zero | tr '\\0' e >&2; exit 4"]
    stderr = Capture(256)
    result = await execute(argv, timeout_s=30, output_cap=256, stderr=stderr)
    assert (result.output, result.exit_code) == ("out\n", 4)
    assert stderr.text().startswith("err\neee") and "bytes of output omitted" in stderr.text()
    assert result.truncated
    merged = await execute(argv, timeout_s=30, output_cap=1 << 20)
    assert merged.output.startswith("out\nerr\n") and not merged.truncated


@needs_bwrap
def test_what_a_run_killed_outright_left_is_taken_back_by_the_next_run() -> None:
    proc, marker, made = start_sleeping_run(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        (replica,) = [p.name for p in made.iterdir() if p.is_dir()]  # beside it, its lock file
        cgroups = f"**/crucible-sandbox-{replica}"
        assert list(Path("/sys/fs/cgroup").glob(cgroups)) or not cgroups_available()
        proc.kill()  # SIGKILL: no clean-up of its own
        proc.wait(timeout=30)
    finally:
        proc.kill()
    deadline = time.monotonic() + 10
    while sleepers(marker):  # bubblewrap dies with its parent, and the sandbox with it
        assert time.monotonic() < deadline, "the sandboxed command outlived the killed run"
        time.sleep(0.1)
    assert made.exists(), "nothing was left to take back"
    run("--", "true")
    assert not made.exists()
    assert str(made) not in Path("/proc/mounts").read_text()
    assert not list(Path("/sys/fs/cgroup").glob(cgroups))
