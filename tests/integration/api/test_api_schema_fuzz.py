"""Schemathesis against the live api (`python -m services.api` on real NATS, S3 and Redis, with a run
and graded trajectories in its history): every input the OpenAPI document allows is served or refused
with a 4xx, every response conforms to the document, and what it refuses is what it documents."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from api_process import key_headers, start_api, wait_ready

from crucible.bus import Bus
from crucible.contracts import subjects
from crucible.contracts.messages import GradedTrajectory
from crucible.localstack.processes import free_ports
from services.api.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES = int(os.environ.get("CRUCIBLE_FUZZ_EXAMPLES", "25"))
"""Generated cases per operation and phase; set it higher for a longer hunt."""
CONFIG = Path(__file__).with_name("schemathesis.toml")
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
WRITE_RATE = 50
"""The api's write rate per key (and its burst), which the fuzzer keeps to (`--rate-limit`)."""


async def _seed(
    base: str, headers: dict[str, str], bus: Bus, make_graded: Callable[..., GradedTrajectory]
) -> str:
    """A run with two graded trajectories, ingested, so listings and details have something to serve."""
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=10) as client:
        created = await client.post("/v1/runs", json={"name": "fuzz"})
        assert created.status_code == 201, created.text
        run_id = created.json()["run_id"]
        for n in range(2):
            graded = make_graded(run_id, f"{run_id}-t{n}", reward=float(n))
            await bus.publish(subjects.graded(run_id), graded)
        for _ in range(200):
            page = (await client.get(f"/v1/runs/{run_id}/trajectories")).json()
            if len(page["items"]) == 2:
                return run_id
            await asyncio.sleep(0.05)
    pytest.fail("the graded trajectories were not ingested")


async def test_schemathesis_finds_no_failure(
    database_url: str,
    common_settings: Callable[..., Settings],
    make_graded: Callable[..., GradedTrajectory],
    tmp_path: Path,
) -> None:
    (port,) = free_ports(count=1)
    suffix = uuid.uuid4().hex[:8]
    durables = {"graded_durable": f"api-graded-{suffix}", "events_durable": f"api-events-{suffix}"}
    settings = common_settings(
        Settings, database_url=database_url, api_port=port,
        write_rate_per_s=WRITE_RATE, write_burst=WRITE_RATE, **durables,
    )  # fmt: skip
    log = tmp_path / "api.log"
    base = f"http://127.0.0.1:{port}"
    proc = start_api(settings, log)
    bus = await Bus.connect(settings, name="api-fuzz-test")
    try:
        wait_ready(base, proc, log)
        headers = key_headers(database_url)
        await _seed(base, headers, bus, make_graded)
        fuzz = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "--no-color",
            "run", f"{base}/openapi.json", "--checks", "all",
            "--header", f"Authorization: {headers['Authorization']}",
            "--max-examples", str(EXAMPLES), "--seed", "20261203", "--rate-limit", f"{WRITE_RATE}/s",
            "--workers", "1",  # hypothesis parses lambdas with ast, which races across threads on Python 3.11
            "--generation-database", "none", "--request-timeout", "30",
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path,  # its crash cache stays there
            env={**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)},
        )  # fmt: skip
        output, _ = await asyncio.wait_for(fuzz.communicate(), timeout=900)
        text = output.decode(errors="replace")
        assert fuzz.returncode == 0, text[-30_000:]
        assert "No issues found" in text or "passed" in text, text[-5_000:]
        assert proc.poll() is None, log.read_text()[-10_000:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        await bus.js.delete_consumer(subjects.GRADED, durables["graded_durable"])
        await bus.js.delete_consumer(subjects.EVENTS, durables["events_durable"])
        await bus.close()
