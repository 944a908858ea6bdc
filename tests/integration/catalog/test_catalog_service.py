"""The catalog service over real NATS, S3 and SQLite: publishes its task set at start, then serves it."""

from __future__ import annotations

import pytest
from api_process import key_headers
from httpx import ASGITransport, AsyncClient

from crucible.bus import RemoteError
from crucible.contracts import endpoints
from crucible.contracts.messages import (
    DescribeRequest,
    ListRequest,
    SampleRequest,
    TaskRequest,
)
from crucible.db import make_engine, make_sessionmaker
from services.api.app import create_app
from services.api.settings import Settings as ApiSettings
from services.catalog.generator import HIDDEN_TESTS
from services.catalog.snapshots import untar

pytestmark = pytest.mark.integration


async def test_sample_and_get_over_the_bus(bus, store):
    request = SampleRequest(run_id="r1", taskset="pybugs", count=5, seed=3)
    reply = await bus.request(endpoints.CATALOG_SAMPLE, request, timeout=10)
    again = await bus.request(endpoints.CATALOG_SAMPLE, request, timeout=10)
    assert len(reply.tasks) == 5 and [t.task_id for t in reply.tasks] == [t.task_id for t in again.tasks]
    assert {t.task_id for t in reply.tasks} == {"pybugs-d1-0000", "pybugs-d2-0000"}

    level2 = SampleRequest(run_id="r1", taskset="pybugs", difficulties=[2])
    spec = (await bus.request(endpoints.CATALOG_SAMPLE, level2, timeout=10)).tasks[0]
    assert spec.task_id == "pybugs-d2-0000" and spec.difficulty == 2 and spec.statement
    files = untar(await store.get_bytes(spec.snapshot))
    assert "README.md" in files and HIDDEN_TESTS not in files

    public = await bus.request(endpoints.CATALOG_GET, TaskRequest(task_id=spec.task_id), timeout=10)
    assert public.secret is None and public.task == spec
    full = await bus.request(endpoints.CATALOG_SECRET, TaskRequest(task_id=spec.task_id), timeout=10)
    assert full.secret is not None and HIDDEN_TESTS in full.secret.test_command
    assert full.secret.fail_to_pass and all(t.startswith(HIDDEN_TESTS) for t in full.secret.fail_to_pass)
    assert full.secret.pass_to_pass and spec.split == "train"
    assert list(untar(await store.get_bytes(full.secret.hidden_tests))) == [HIDDEN_TESTS]
    assert full.secret.reference_patch.startswith("diff --git a/")


async def test_bad_requests_get_clear_errors(bus):
    cases = [
        (SampleRequest(run_id="r", taskset="nope"), "unknown_taskset"),
        (SampleRequest(run_id="r", taskset="pybugs", difficulties=[3]), "empty_selection"),
        (SampleRequest(run_id="r", taskset="pybugs", count=0), "bad_request"),
        (SampleRequest(run_id="r", taskset="pybugs", count=10**6), "bad_request"),
        (TaskRequest(task_id="pybugs-d9-9999"), "not_found"),
        (SampleRequest(run_id="r", taskset="pybugs", split="test"), "empty_selection"),
        (ListRequest(taskset="pybugs", split="test"), "empty_selection"),
        (ListRequest(taskset="pybugs", split="train", limit=0), "bad_request"),
    ]
    for request, code in cases:
        endpoint = {
            SampleRequest: endpoints.CATALOG_SAMPLE,
            ListRequest: endpoints.CATALOG_LIST,
            TaskRequest: endpoints.CATALOG_GET,
        }[type(request)]
        with pytest.raises(RemoteError) as error:
            await bus.request(endpoint, request, timeout=10)
        assert error.value.code == code, request


async def test_a_split_is_listed_in_task_id_order(bus):
    listed = await bus.request(endpoints.CATALOG_LIST, ListRequest(taskset="pybugs", split="train"))
    assert [t.task_id for t in listed.tasks] == ["pybugs-d1-0000", "pybugs-d2-0000"]
    one = await bus.request(endpoints.CATALOG_LIST, ListRequest(taskset="pybugs", split="train", limit=1))
    assert [t.task_id for t in one.tasks] == ["pybugs-d1-0000"]


async def test_describe_names_each_split_s_difficulties(bus):
    reply = await bus.request(endpoints.CATALOG_DESCRIBE, DescribeRequest(taskset="pybugs"))
    assert reply.difficulties == {"train": [1, 2]}
    unknown = await bus.request(endpoints.CATALOG_DESCRIBE, DescribeRequest(taskset="nope"))
    assert unknown.difficulties == {}


async def test_the_api_refuses_a_run_the_catalog_cannot_serve(bus, catalog_settings):
    """POST /v1/runs asks the catalog what it holds: a 422 names the field and what there is instead."""
    engine = make_engine(catalog_settings.database_url)
    app = create_app(settings=ApiSettings(), sessionmaker=make_sessionmaker(engine), bus=bus)
    try:
        headers = key_headers(catalog_settings.database_url, scope="write")
        async with AsyncClient(
            transport=ASGITransport(app=app), base_url="http://api", headers=headers
        ) as client:
            cases = [
                (
                    {"tasks": {"difficulties": [4, 3]}},
                    ["tasks", "difficulties"],
                    "no train tasks of difficulty 3, 4; it has 1, 2",
                ),
                ({"tasks": {"taskset": "nope"}}, ["tasks", "taskset"], "the catalog has no task set 'nope'"),
                (
                    {"eval": {"at_end": True}},
                    ["eval", "split"],
                    "task set 'pybugs' has no test tasks (it has train)",
                ),
            ]
            for config, field, message in cases:
                response = await client.post("/v1/runs", json={"name": "unservable", "config": config})
                assert response.status_code == 422, response.text
                (error,) = response.json()["detail"]
                assert error["loc"] == ["body", "config", *field] and message in error["msg"], error
            assert (await client.get("/v1/runs")).json()["items"] == []  # nothing recorded, nothing announced
            served = await client.post(
                "/v1/runs", json={"name": "servable", "config": {"tasks": {"difficulties": [2, 3]}}}
            )
            assert served.status_code == 201, served.text
    finally:
        await engine.dispose()
