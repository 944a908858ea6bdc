"""The `crucible` command: fast help, clear errors, `db upgrade`, and `crucible up` stopping everything
it started on Ctrl-C, SIGTERM or a closed terminal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from cli_runner import crucible

pytestmark = pytest.mark.integration


def processes_under(directory: Path) -> list[int]:
    """Live processes whose working directory is inside `directory`."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if Path(os.readlink(proc / "cwd")).is_relative_to(directory):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def test_help_lists_the_commands_without_heavy_imports() -> None:
    result = crucible("--help")
    assert result.returncode == 0, result.stderr
    assert "up" in result.stdout and "db" in result.stdout
    heavy = "('torch', 'ray', 'sqlalchemy', 'crucible.localstack')"
    probe = f"import sys, crucible.cli.main; print(sorted(m for m in {heavy} if m in sys.modules))"
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]", "heavy modules imported at CLI import time"


def test_up_rejects_an_unknown_service() -> None:
    result = crucible("up", "--service", "nope")
    assert result.returncode == 2
    assert "unknown service(s) nope" in result.stdout + result.stderr


def test_up_rejects_an_unsupported_database_without_echoing_the_password() -> None:
    result = crucible("up", "--database-url", "mysql://root:hunter2@127.0.0.1/x")
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert "unsupported database URL scheme 'mysql'" in output and "hunter2" not in output


def test_db_upgrade_migrates_sqlite(tmp_path: Path) -> None:
    db = tmp_path / "cli.db"
    result = crucible("db", "upgrade", "--url", f"sqlite+aiosqlite:///{db}", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    with sqlite3.connect(db) as conn:
        assert conn.execute("select version_num from alembic_version").fetchone()


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_up_runs_until_signalled_then_stops_everything(
    tmp_path: Path, s3: dict[str, str], stop_signal: signal.Signals
) -> None:
    state = tmp_path / "state"
    up = _start_up(state, s3)
    try:
        assert _read_until(up, "API: ", []).startswith("API: ")
        children = processes_under(state)
        assert len(children) >= 3, "NATS, Redis and the checkpoints service run under the state dir"
        up.send_signal(stop_signal)
        output, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, output
    assert "stopped" in output
    assert processes_under(state) == []
    assert (state / "logs" / "checkpoints.log").is_file(), "a state dir the user chose is kept"


def _start_up(state: Path, s3: dict[str, str]) -> subprocess.Popen:
    """`crucible up` with the checkpoints service alone, on the test's S3 and its own bucket."""
    env = {
        **os.environ, "COLUMNS": "200", "NO_COLOR": "1", "CRUCIBLE_S3_ACCESS_KEY": s3["s3_access_key"],
        "CRUCIBLE_S3_SECRET_KEY": s3["s3_secret_key"], "CRUCIBLE_S3_BUCKET": f"cli-{uuid.uuid4().hex[:12]}",
    }  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-c", "from crucible.cli.main import app; app()", "up", "--service", "checkpoints",
         "--api-port", "0", "--state-dir", str(state), "--s3-endpoint", s3["s3_endpoint"]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip


def _read_until(process: subprocess.Popen, prefix: str, lines: list[str], *, timeout_s: float = 120) -> str:
    """Lines of `process`'s output up to the first that contains `prefix` (which it returns)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        assert line or process.poll() is None, "the command exited:\n" + "".join(lines)
        lines.append(line)
        if prefix in line:
            return line
    pytest.fail(f"no {prefix!r} in the output:\n" + "".join(lines))


def _gone(directory: Path, *, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while processes_under(directory) and time.monotonic() < deadline:
        time.sleep(0.2)
    return processes_under(directory) == []


@pytest.mark.slow
def test_up_restarts_a_service_that_dies_and_its_children_die_with_it(
    tmp_path: Path, s3: dict[str, str]
) -> None:
    state = tmp_path / "state"
    up = _start_up(state, s3)
    lines: list[str] = []
    try:
        _read_until(up, "API: ", lines)
        (first,) = processes_under(state / "services" / "checkpoints")
        os.kill(first, signal.SIGKILL)
        exited = _read_until(up, "checkpoints exited", lines)
        assert "code -9" in exited and exited.rstrip().endswith("restarting it in 1 s")
        _read_until(up, "checkpoints restarted", lines)
        (second,) = processes_under(state / "services" / "checkpoints")
        assert second != first
        up.kill()  # the supervisor itself dies outright: everything it started goes with it
        up.wait(timeout=30)
        assert _gone(state), f"left running: {processes_under(state)}"
    finally:
        if up.poll() is None:
            up.kill()


@pytest.mark.slow
def test_demo_stopped_by_sigterm_stops_the_stack() -> None:
    # the demo's state dir is a temp dir: here one of the test's, which the sandbox uid can reach
    tmp_path = Path(tempfile.mkdtemp(prefix="crucible-test-demo-", dir="/tmp"))
    tmp_path.chmod(0o755)
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TMPDIR": str(tmp_path)}
    demo = subprocess.Popen(
        [sys.executable, "-c", "from crucible.cli.main import app; app()", "demo"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    try:
        _read_until(demo, "created; API at", lines, timeout_s=300)
        assert processes_under(tmp_path), "the stack runs under the temp dir"
        demo.send_signal(signal.SIGTERM)
        output, _ = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            demo.kill()
        left = _gone(tmp_path)
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert demo.returncode == 130, "".join(lines) + output
    assert "interrupted" in output
    assert left, "the stack's processes outlived the demo"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "schedule.group_size=0"], "schedule.group_size"),
        (["--set", "group_size=2"], "`group_size` is now `schedule.group_size`"),
        (["--set", "nonsense"], "not of the form section.field=value"),
        (["--config", "/nonexistent/run.toml"], "/nonexistent/run.toml"),
    ],
)
def test_demo_refuses_a_bad_run_config_before_starting_anything(args: list[str], message: str) -> None:
    result = crucible("demo", *args)
    assert result.returncode == 2 and "bad run config" in result.stderr and message in result.stderr


def test_keys_are_made_listed_and_revoked_in_the_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'crucible.db'}"
    assert crucible("db", "upgrade", "--url", url).returncode == 0
    printed = crucible("keys", "create", "--scope", "read", "--name", "viewer", "--url", url)
    assert printed.returncode == 0 and printed.stdout.startswith("crk_"), printed.stderr
    written = crucible("keys", "create", "--scope", "admin", "--file", str(tmp_path / "key"), "--url", url)
    assert written.returncode == 0 and (tmp_path / "key").stat().st_mode & 0o777 == 0o600
    listed = json.loads(crucible("keys", "list", "--json", "--url", url).stdout)
    assert [(k["name"], k["scope"], k["revoked_at"]) for k in listed] == [
        ("viewer", "read", None),
        ("cli", "admin", None),
    ]
    assert printed.stdout.strip() not in json.dumps(listed)
    viewer = listed[0]["key_id"]
    assert crucible("keys", "revoke", viewer, "--url", url).returncode == 0
    assert json.loads(crucible("keys", "list", "--json", "--url", url).stdout)[0]["revoked_at"] is not None
    unknown = crucible("keys", "revoke", "nope", "--url", url)
    assert unknown.returncode == 1 and "no key nope" in unknown.stderr
    bad = crucible("keys", "create", "--scope", "root", "--url", url)
    assert bad.returncode == 2 and "one of read, write, admin" in bad.stderr


def test_identities_are_kept_and_the_operator_sets_up_the_streams(tmp_path: Path) -> None:
    from crucible.identities import SERVER_CONFIG, read_s3_key, s3_key_file, seed_file
    from crucible.localstack.servers import start_nats

    folder = tmp_path / "identities"
    first = crucible("identities", str(folder))
    assert first.returncode == 0, first.stderr
    key = read_s3_key(s3_key_file(folder, "grader"))
    again = crucible("identities", str(folder))
    assert (
        again.stdout == first.stdout and read_s3_key(s3_key_file(folder, "grader")) == key
    )  # nothing made anew
    for secret in (seed_file(folder, "grader"), s3_key_file(folder, "grader")):
        assert secret.stat().st_mode & 0o777 == 0o600 and secret.read_text().split()[-1] not in first.stdout
    assert (folder / SERVER_CONFIG).is_file() and (folder / "server" / "minio" / "sandbox.json").is_file()
    assert s3_key_file(folder, "grader").read_text().split()[1] not in (folder / SERVER_CONFIG).read_text()

    server = start_nats(state_dir=tmp_path, identities=folder)
    try:
        anonymous = crucible("bus", "setup", env={"CRUCIBLE_NATS_URL": server.url})
        assert anonymous.returncode == 2 and "refused no identity" in anonymous.stderr, anonymous.stderr
        operator = {
            "CRUCIBLE_NATS_URL": server.url,
            "CRUCIBLE_NATS_NKEY_FILE": str(seed_file(folder, "admin")),
        }
        done = crucible("bus", "setup", env=operator)
        assert done.returncode == 0 and "streams ready" in done.stdout, done.stderr
    finally:
        server.stop()
