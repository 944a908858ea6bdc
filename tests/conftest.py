"""Real servers for every test, once per session: the machine's own NATS, Redis and PostgreSQL when they
answer on their usual loopback ports, otherwise embedded ones started by crucible.localstack; SeaweedFS
is always started fresh, so every session's object store is empty. Each test gets its own bucket, stream
prefix and SQLite file through `common_settings`.

Under pytest-xdist (`make test` runs `-n 2 --dist loadgroup`) each worker is a session of its own, with
its own NATS and Redis as well: two workers' services on one NATS would answer each other's requests
(a request/reply endpoint is one queue group for every replica on the server)."""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from crucible.localstack.processes import LOOPBACK, port_open
from crucible.localstack.servers import jetstream_ready, start_nats, start_redis, start_seaweedfs
from crucible.settings import CommonSettings

S = TypeVar("S", bound=CommonSettings)
POSTGRES_ADMIN_URL = f"postgresql://postgres@{LOOPBACK}:5432/postgres"


def _shared_servers() -> bool:
    """Whether this session may use the machine's own NATS and Redis: not as one of several workers."""
    return "PYTEST_XDIST_WORKER" not in os.environ


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unique_name(prefix: str) -> str:
    """A name no other test in this session (or a concurrent session on the same server) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist's `--dist loadgroup`, a module's tests run on one worker, so that its module
    fixtures start once, and every e2e module runs on the same worker, so that the e2e stack does."""
    for item in items:
        group = "e2e" if item.get_closest_marker("e2e") else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def servers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def nats_url(servers_dir: Path) -> Iterator[str]:
    if _shared_servers() and jetstream_ready(port=4222):
        yield f"nats://{LOOPBACK}:4222"
        return
    server = start_nats(state_dir=servers_dir)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(servers_dir: Path) -> Iterator[str]:
    if _shared_servers() and port_open(host=LOOPBACK, port=6379):
        yield f"redis://{LOOPBACK}:6379/0"
        return
    server = start_redis(state_dir=servers_dir)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3(servers_dir: Path) -> Iterator[dict[str, str]]:
    """Settings fields of a fresh SeaweedFS S3 server: s3_endpoint, s3_access_key, s3_secret_key."""
    access_key, secret_key = "crucible-test", uuid.uuid4().hex
    server = start_seaweedfs(state_dir=servers_dir, access_key=access_key, secret_key=secret_key)
    try:
        yield {"s3_endpoint": server.endpoint, "s3_access_key": access_key, "s3_secret_key": secret_key}
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh database on the local PostgreSQL (user postgres), dropped at the end of the session."""
    import asyncpg

    name = unique_name("crucible_test").replace("-", "_")

    async def execute(sql: str) -> None:
        conn = await asyncpg.connect(POSTGRES_ADMIN_URL, timeout=5)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    def admin(sql: str) -> None:
        # A private loop: asyncio.run would reset the thread's current loop under pytest-asyncio.
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(execute(sql))
        finally:
            loop.close()

    try:
        admin(f'CREATE DATABASE "{name}"')
    except (OSError, asyncpg.PostgresError) as exc:
        reason = f"PostgreSQL at {LOOPBACK}:5432 (user postgres) is unreachable: {exc}"
        if _in_ci():
            pytest.fail(reason + " (CI=true: PostgreSQL is required)")
        pytest.skip(reason)
    try:
        yield f"postgresql+asyncpg://postgres@{LOOPBACK}:5432/{name}"
    finally:
        admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'crucible.db'}"


@pytest.fixture
def common_settings(
    nats_url: str, s3: dict[str, str], redis_url: str, sqlite_url: str
) -> Callable[..., CommonSettings]:
    """Factory: `common_settings(**overrides)`, or `common_settings(SettingsClass, **overrides)` for a
    service's own settings class.

    Every call in one test shares one bucket, unique to the test, so tests never see each other's
    objects on the shared S3 server. On the shared NATS server tests keep apart by their own run ids,
    subjects and durables; a test that needs the streams to itself (a work-queue consumer, a server it
    restarts) starts a NATS server of its own."""
    bucket = unique_name("crucible-test")

    def make(settings_cls: type[S] = CommonSettings, /, **overrides: Any) -> S:  # type: ignore[assignment]
        values: dict[str, Any] = {
            "nats_url": nats_url,
            "redis_url": redis_url,
            "database_url": sqlite_url,
            "s3_bucket": bucket,
            "http_port": 0,
            **s3,
        }
        values.update(overrides)
        return settings_cls(**values)

    return make


SANDBOX_ROOT_PREFIX = "crucible-test-sandbox-"


@pytest.fixture
def sandbox_root() -> Iterator[Path]:
    """A sandbox workspace root under /tmp itself: pytest's own tmp_path sits below a 0700 folder that
    the unprivileged sandbox uid cannot cross. What test runs killed outright left there goes first."""
    from services.sandbox.roots import claim_workspace_root, sweep_abandoned_roots

    sweep_abandoned_roots(Path("/tmp"), SANDBOX_ROOT_PREFIX)
    root = claim_workspace_root(Path("/tmp"), SANDBOX_ROOT_PREFIX)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def sandbox(common_settings, sandbox_root):
    """The sandbox service, in-process, on this test's settings."""
    from crucible.runtime import running
    from services.sandbox.app import setup
    from services.sandbox.settings import Settings

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    settings = common_settings(Settings, workspace_root=sandbox_root, replica=f"sb-{uuid.uuid4().hex[:8]}")
    async with running("sandbox", settings, setup) as rt:
        yield rt


@pytest.fixture
async def redis_client(redis_url: str):
    """A client of the session's Redis, closed after the test."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """One private single-node Ray cluster for a module's tests that use Ray (each start costs seconds): a
    worker group, and the trainer's, finds Ray connected and leaves it running; it stops with the module
    (an idle cluster's daemons would take a share of the cores from every later test)."""
    import ray

    from crucible.parallel.launch import start_local_ray

    start_local_ray(num_cpus=8)
    yield
    ray.shutdown()
