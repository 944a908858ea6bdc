from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from httpx import ASGITransport, AsyncClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.contracts.runconfig import RunConfig
from crucible.db import make_engine, make_sessionmaker
from crucible.db.models import Run
from crucible.localstack.processes import free_ports
from services.api.app import create_app
from services.api.pagination import encode_cursor
from services.api.settings import Settings

pytestmark = pytest.mark.integration


async def test_create_run_records_it_with_the_validated_config(client: AsyncClient) -> None:
    response = await client.post(
        "/v1/runs", json={"name": " demo ", "config": {"seed": 7, "model": {"precision": "mxfp8"}}}
    )
    assert response.status_code == 201, response.text
    run = response.json()
    assert run["run_id"].startswith("run-") and run["name"] == "demo" and run["status"] == "created"
    expected = RunConfig.model_validate({"seed": 7, "model": {"precision": "mxfp8"}})
    assert run["config"] == expected.model_dump(mode="json") and run["config"]["schedule"]["group_size"] == 4
    fetched = await client.get(f"/v1/runs/{run['run_id']}")
    assert fetched.status_code == 200 and fetched.json() == run


@pytest.mark.parametrize(
    ("body", "loc", "message"),
    [
        (
            {"name": "n", "config": {"bogus": 1}},
            ["body", "config", "bogus"],
            "Extra inputs are not permitted",
        ),
        (
            {"name": "n", "config": {"schedule": {"group_size": 0}}},
            ["body", "config", "schedule", "group_size"],
            "greater than or equal to 1",
        ),
        (
            {"name": "n", "config": {"model": {"source": "huge"}}},
            ["body", "config", "model", "source"],
            "unknown model source",
        ),
        (
            {"name": "n", "config": {"group_size": 2}},
            ["body", "config"],
            "`group_size` is now `schedule.group_size`",
        ),
        ({"config": {}}, ["body", "name"], "Field required"),
        ({"name": "n", "extra": True}, ["body", "extra"], "Extra inputs are not permitted"),
    ],
)
async def test_bad_run_bodies_get_422_naming_the_field(
    client: AsyncClient, body: dict, loc: list[str], message: str
) -> None:
    response = await client.post("/v1/runs", json=body)
    assert response.status_code == 422
    errors = response.json()["detail"]
    assert any(e["loc"] == loc and message in e["msg"] for e in errors), errors
    assert (await client.get("/v1/runs")).json()["items"] == []


async def test_malformed_json_is_422(client: AsyncClient) -> None:
    response = await client.post(
        "/v1/runs", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422 and response.json()["detail"][0]["type"] == "json_invalid"


@pytest.mark.parametrize("suffix", ["", "/steps", "/metrics", "/checkpoints", "/trajectories"])
async def test_unknown_run_is_404_with_a_clear_detail(client: AsyncClient, suffix: str) -> None:
    response = await client.get(f"/v1/runs/nope{suffix}")
    assert response.status_code == 404
    assert response.json() == {"detail": "run 'nope' not found"}


async def test_unknown_trajectory_is_404(client: AsyncClient) -> None:
    response = await client.get("/v1/trajectories/t-nope")
    assert response.status_code == 404 and response.json() == {"detail": "trajectory 't-nope' not found"}


async def test_runs_page_newest_first_without_gaps_or_repeats(
    client: AsyncClient, sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    created = [(await client.post("/v1/runs", json={"name": f"r{i}"})).json()["run_id"] for i in range(4)]
    same_instant = datetime(2020, 1, 1, tzinfo=UTC)
    async with sessionmaker() as session:
        session.add_all(
            Run(run_id=f"tie-{i}", name="tie", config={}, created_at=same_instant) for i in range(4)
        )
        await session.commit()
    expected = [*reversed(created), "tie-3", "tie-2", "tie-1", "tie-0"]

    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 3} | ({"cursor": cursor} if cursor else {})
        body = (await client.get("/v1/runs", params=params)).json()
        seen += [item["run_id"] for item in body["items"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == expected and pages == 3


async def test_runs_filter_by_status(
    client: AsyncClient, sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    await client.post("/v1/runs", json={"name": "a"})
    async with sessionmaker() as session:
        session.add(Run(run_id="done-1", name="b", status="finished", config={}))
        await session.commit()
    body = (await client.get("/v1/runs", params={"status": "finished"})).json()
    assert [item["run_id"] for item in body["items"]] == ["done-1"]
    assert (await client.get("/v1/runs", params={"status": "bogus"})).status_code == 422


async def test_a_cursor_off_its_pattern_is_refused_and_any_other_is_a_position(
    client: AsyncClient, run_id: str
) -> None:
    steps = f"/v1/runs/{run_id}/steps"
    off_pattern = [("/v1/runs", "garbage!"), ("/v1/runs", "12.abcde"), ("/v1/runs", "7"), (steps, "1.YQ")]
    for path, cursor in off_pattern:
        response = await client.get(path, params={"cursor": cursor})
        assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["query", "cursor"]
    # Cursors the api never handed out page from where they point: runs are listed newest first.
    after_all = encode_cursor([datetime(1000, 1, 1, tzinfo=UTC), ""])
    before_all = encode_cursor([datetime(3000, 1, 1, tzinfo=UTC), "x"])
    empty = {"items": [], "next_cursor": None}
    assert (await client.get("/v1/runs", params={"cursor": after_all})).json() == empty
    page = (await client.get("/v1/runs", params={"cursor": before_all})).json()
    assert [item["run_id"] for item in page["items"]] == [run_id]
    for cursor in ("-99999999999999999.AA", "99999999999999999._w"):  # past the timestamps, a NUL, not UTF-8
        assert (await client.get("/v1/runs", params={"cursor": cursor})).status_code == 200
    for cursor in ("9" * 19, "-" + "9" * 19):  # past a 32-bit column either way
        response = await client.get(steps, params={"cursor": cursor})
        assert response.status_code == 200 and response.json()["items"] == []
    assert (await client.get("/v1/runs", params={"limit": 0})).status_code == 422
    assert (await client.get("/v1/runs", params={"limit": 501})).status_code == 422


async def test_health_and_openapi(client: AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"ready": True, "database": True, "bus": True}
    paths = (await client.get("/openapi.json")).json()["paths"]
    assert {"/v1/runs", "/v1/runs/{run_id}/trajectories", "/v1/trajectories/{trajectory_id}"} <= set(paths)


async def test_readyz_is_503_while_the_database_is_unreachable(tmp_path: Path) -> None:
    (port,) = free_ports(count=1)  # nothing listens here
    engine = make_engine(
        f"postgresql+asyncpg://postgres@127.0.0.1:{port}/nowhere", connect_args={"timeout": 2}
    )
    app = create_app(settings=Settings(), sessionmaker=make_sessionmaker(engine))
    async with AsyncClient(transport=ASGITransport(app=app), base_url="http://api") as client:
        ready = await client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["database"] is False
        assert (await client.get("/healthz")).status_code == 200
    await engine.dispose()


async def test_a_huge_bad_request_is_refused_without_being_echoed(client: AsyncClient) -> None:
    name = "x" * 1_000_000
    refused = await client.post("/v1/runs", json={"name": name})
    assert refused.status_code == 422 and len(refused.content) < 2000
    error = refused.json()["detail"][0]
    assert error["loc"] == ["body", "name"] and "200 characters" in error["msg"]
    too_big = await client.post("/v1/runs", json={"name": "x" * 5_000_000})
    assert too_big.status_code == 413 and "request body over" in too_big.json()["detail"]
    assert (await client.get("/v1/runs")).status_code == 200  # and it goes on serving
