"""LocalStack: embedded servers where no URL is given, real services as child processes, supervision,
kill and restart, and a clean stop that leaves no process and (unless kept) no state behind."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
import uuid
from pathlib import Path

import httpx
import pytest

from crucible.localstack import LocalStack, MigrationError, ServiceError, run_migrations
from crucible.settings import CommonSettings

pytestmark = pytest.mark.integration


def s3_kwargs(s3: dict[str, str]) -> dict[str, str]:
    return {
        "s3_endpoint": s3["s3_endpoint"],
        "s3_access_key": s3["s3_access_key"],
        "s3_secret_key": s3["s3_secret_key"],
        "s3_bucket": f"stack-{uuid.uuid4().hex[:12]}",
    }


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def test_starts_embedded_servers_and_removes_its_temp_state() -> None:
    stack = LocalStack(services=())
    with stack:
        assert set(stack.servers) == {"nats", "redis", "seaweedfs"}
        assert all(server.alive() for server in stack.servers.values())
        settings = CommonSettings(
            **{k.removeprefix("CRUCIBLE_").lower(): v for k, v in stack.settings_env.items()}
        )
        assert settings.nats_url == stack.servers["nats"].url
        assert settings.s3_endpoint == stack.servers["seaweedfs"].endpoint
        assert settings.redis_url == stack.servers["redis"].url
        assert settings.database_url == f"sqlite+aiosqlite:///{stack.state_dir / 'crucible.db'}"
        state_dir, pids = stack.state_dir, [s.pid for s in stack.servers.values()]
    assert all(gone(pid) for pid in pids)
    assert state_dir is not None and not state_dir.exists()


def test_each_service_runs_on_its_own_identities_and_comes_up_with_them(tmp_path: Path) -> None:
    """With embedded servers, a service gets its own NKey seed and S3 key (not the operator's, which
    `settings_env` carries), and becomes ready on them."""
    with LocalStack(services=("checkpoints",), state_dir=tmp_path / "stack") as stack:
        env = stack.service("checkpoints").env
        own = CommonSettings(
            **{k.removeprefix("CRUCIBLE_").lower(): v for k, v in env.items() if k.startswith("CRUCIBLE_")}
        )
        assert own.nats_nkey_file == stack.identities / "checkpoints" / "seed.nk"
        assert own.s3_access_key == "crucible-checkpoints" != stack.settings_env["CRUCIBLE_S3_ACCESS_KEY"]
        assert stack.settings_env["CRUCIBLE_NATS_NKEY_FILE"] == str(stack.identities / "admin" / "seed.nk")
        assert stack.service("checkpoints").is_ready()


async def test_async_context_manager_reuses_given_servers(
    tmp_path: Path, nats_url: str, redis_url: str, s3: dict[str, str], postgres_url: str
) -> None:
    async with LocalStack(
        services=(),
        state_dir=tmp_path,
        nats_url=nats_url,
        redis_url=redis_url,
        database_url=postgres_url.replace("+asyncpg", ""),
        **s3_kwargs(s3),
    ) as stack:
        assert stack.servers == {}
        assert stack.settings_env["CRUCIBLE_NATS_URL"] == nats_url
        assert stack.settings_env["CRUCIBLE_DATABASE_URL"] == postgres_url
        assert [origin for _, _, origin in stack.backends()] == ["external"] * 4
    assert tmp_path.exists(), "a state dir the caller chose is the caller's to remove"


def test_service_lifecycle_kill_restart_and_supervision(s3: dict[str, str]) -> None:
    with LocalStack(services=("checkpoints",), stop_grace_s=15, **s3_kwargs(s3)) as stack:
        service = stack.services["checkpoints"]
        base = f"http://127.0.0.1:{service.http_port}"
        assert httpx.get(f"{base}/readyz").status_code == 200
        assert httpx.get(f"{base}/healthz").json()["service"] == "checkpoints"
        assert httpx.get(f"{base}/metrics").status_code == 200
        first_pid = service.pid

        assert stack.kill("checkpoints", signal.SIGKILL) == -signal.SIGKILL
        assert gone(first_pid)
        assert stack.poll() == [], "a kill asked for is not reported as a crash"

        stack.restart("checkpoints")
        assert service.pid != first_pid and service.starts == 2
        assert httpx.get(f"{base}/readyz").status_code == 200

        os.kill(service.pid, signal.SIGTERM)  # an exit the stack did not ask for
        service.process.wait(timeout=30)
        assert stack.poll() == [("checkpoints", 0)], "SIGTERM drains and exits 0; the stack reports it"
        assert stack.poll() == [], "reported once"
        pids = [service.pid, *(s.pid for s in stack.servers.values())]
    assert all(gone(pid) for pid in pids)


def test_a_service_that_fails_to_start_stops_the_whole_stack(s3: dict[str, str]) -> None:
    stack = LocalStack(
        services=("checkpoints",), service_env={"checkpoints": {"CRUCIBLE_FULL_EVERY": "-1"}}, **s3_kwargs(s3)
    )
    with pytest.raises(
        ServiceError, match=r"checkpoints exited with code 2 before it was ready(.|\n)*FULL_EVERY"
    ):
        stack.start()
    assert all(not server.alive() for server in stack.servers.values())
    assert stack.state_dir is not None and not stack.state_dir.exists()


@pytest.mark.slow
def test_migrates_the_database_before_the_api_starts(tmp_path: Path, s3: dict[str, str]) -> None:
    with LocalStack(services=("api",), state_dir=tmp_path, **s3_kwargs(s3)) as stack:
        with sqlite3.connect(tmp_path / "crucible.db") as db:
            assert db.execute("select version_num from alembic_version").fetchone()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                assert httpx.get(f"{stack.api_url}/openapi.json").status_code == 200
                break
            except httpx.ConnectError:
                time.sleep(0.2)
        else:
            pytest.fail(f"REST API not answering at {stack.api_url}")
    assert (tmp_path / "logs" / "api.log").is_file()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"services": ("catalog", "nope")}, "unknown service"),
        ({"service_env": {"nope": {}}}, "unknown service"),
        ({"database_url": "mysql://root:hunter2@127.0.0.1/db"}, "unsupported database URL scheme 'mysql'"),
        ({"api_port": 70000}, "api_port must be"),
    ],
)
def test_rejects_bad_configuration(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LocalStack(**kwargs)


def test_failed_migrations_are_reported_with_their_output() -> None:
    with pytest.raises(MigrationError, match=r"migrations failed \(exit 1\); last lines of output:\n"):
        run_migrations(database_url="postgresql+asyncpg://postgres@127.0.0.1:1/nothing-listens-here")
