"""A service process: a bad config or an unreachable dependency exits with a clear message; SIGTERM
drains and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.integration


def service_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRUCIBLE_")}
    env.update(overrides)
    return env


def test_bad_config_exits_2_naming_the_setting():
    done = subprocess.run(
        [sys.executable, "-m", "services.checkpoints"],
        env=service_env(CRUCIBLE_HTTP_PORT="not-a-port", CRUCIBLE_CLAIM_CHECK_BYTES="12"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "invalid configuration" in done.stderr
    assert "CRUCIBLE_HTTP_PORT" in done.stderr and "CRUCIBLE_CLAIM_CHECK_BYTES" in done.stderr


def test_unreachable_bus_exits_1_with_the_reason(common_settings):
    settings = common_settings()
    done = subprocess.run(
        [sys.executable, "-m", "services.checkpoints"],
        env=service_env(
            CRUCIBLE_NATS_URL="nats://127.0.0.1:1",
            CRUCIBLE_S3_ENDPOINT=settings.s3_endpoint,
            CRUCIBLE_S3_ACCESS_KEY=settings.s3_access_key,
            CRUCIBLE_S3_SECRET_KEY=settings.s3_secret_key,
            CRUCIBLE_S3_BUCKET=settings.s3_bucket,
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "cannot connect to NATS at nats://127.0.0.1:1" in done.stderr


def test_sigterm_drains_and_exits_0(common_settings, unused_tcp_port):
    settings = common_settings()
    env = service_env(
        CRUCIBLE_NATS_URL=settings.nats_url,
        CRUCIBLE_REDIS_URL=settings.redis_url,
        CRUCIBLE_S3_ENDPOINT=settings.s3_endpoint,
        CRUCIBLE_S3_ACCESS_KEY=settings.s3_access_key,
        CRUCIBLE_S3_SECRET_KEY=settings.s3_secret_key,
        CRUCIBLE_S3_BUCKET=settings.s3_bucket,
        CRUCIBLE_HTTP_PORT=str(unused_tcp_port),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.checkpoints"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{unused_tcp_port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        metrics = httpx.get(f"http://127.0.0.1:{unused_tcp_port}/metrics", timeout=5)
        assert metrics.status_code == 200 and "python_info" in metrics.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_readiness_follows_the_services_dependencies(common_settings, tmp_path):
    """/readyz answers for Redis and the object store as well as the bus: a Redis that goes away makes
    the service not ready (503, saying which) while it stays alive."""
    from crucible.localstack.servers import start_redis
    from crucible.runtime import running

    async def nothing(rt) -> None:
        return None

    redis = start_redis(state_dir=tmp_path)
    try:
        async with running("probe", common_settings(redis_url=redis.url), nothing) as rt:
            base = f"http://127.0.0.1:{rt.http_port}"
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                ready = await client.get("/readyz")
                assert ready.status_code == 200 and ready.json() == {
                    "ready": True,
                    "bus": True,
                    "redis": True,
                    "s3": True,
                }
                redis.stop()
                for _ in range(100):  # observed: the probe notices
                    ready = await client.get("/readyz")
                    if ready.status_code == 503:
                        break
                assert (
                    ready.status_code == 503 and ready.json()["redis"] is False and ready.json()["s3"] is True
                )
                assert (await client.get("/healthz")).status_code == 200
    finally:
        redis.stop()
