"""Waiting for a run of a live stack to end, over the REST API, with the stack's services watched."""

from __future__ import annotations

import time

import httpx

from crucible.contracts.events import TERMINAL_STATUSES
from crucible.localstack import LocalStack


def wait_until_ended(stack: LocalStack, client: httpx.Client, run_id: str, *, timeout: float) -> dict:
    """The run once it has ended (finished, failed or cancelled); fails the test if a service exits or
    time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert not stack.poll(), f"services exited: {stack.poll()}"
        run = client.get(f"/v1/runs/{run_id}").json()
        if run["status"] in TERMINAL_STATUSES:
            return run
        time.sleep(1)
    raise AssertionError(f"run {run_id} did not end within {timeout:.0f}s")
