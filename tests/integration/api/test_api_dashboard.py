"""The dashboard's pages render from the run history (the browser test is in tests/e2e/test_e2e_eval.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from httpx import AsyncClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.contracts.messages import GradedTrajectory
from services.api.records import record_graded

pytestmark = pytest.mark.integration


async def test_pages_render_and_static_files_are_served(
    sessionmaker: async_sessionmaker[AsyncSession], client: AsyncClient, run_id: str,
    make_graded: Callable[..., GradedTrajectory],
) -> None:  # fmt: skip
    async with sessionmaker() as session:
        await record_graded(session=session, graded=make_graded(run_id, "t-1", reward=1.0))
    runs = await client.get("/")
    assert runs.status_code == 200 and f'href="/runs/{run_id}"' in runs.text
    page = await client.get(f"/runs/{run_id}")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="chart-reward"' in page.text and 'href="/trajectories/t-1"' in page.text
    assert "/static/vendor/uPlot.iife.min.js" in page.text
    assert '<table id="tasks">' in page.text and "<td>pybugs/1</td><td>1</td>" in page.text  # its record
    transcript = await client.get("/trajectories/t-1")
    assert (
        transcript.status_code == 200
        and 'class="segment agent"' in transcript.text
        and "def add" in transcript.text
    )
    assert (await client.get("/static/vendor/uPlot.iife.min.js")).status_code == 200
    assert (await client.get("/static/dashboard.js")).status_code == 200
    assert (await client.get("/runs/run-nope")).status_code == 404
    assert (await client.get("/trajectories/nope")).status_code == 404
    # Nothing the pages show is raw HTML from the run: a name is escaped.
    await client.post("/v1/runs", json={"name": "<script>alert(1)</script>"})
    assert "<script>alert(1)</script>" not in (await client.get("/")).text
