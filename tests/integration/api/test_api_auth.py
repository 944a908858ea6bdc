"""Who may call the REST API: API keys by scope, revocation, the write rate limit, the dashboard's login."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from api_process import key_headers
from httpx import ASGITransport, AsyncClient
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.db.models import ApiKey
from services.api.app import create_app
from services.api.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture
async def anonymous(sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncIterator[AsyncClient]:
    """The api in process, with no key unless a request brings one."""
    app = create_app(settings=Settings(), sessionmaker=sessionmaker)
    async with AsyncClient(transport=ASGITransport(app=app), base_url="http://api") as client:
        yield client


async def test_no_key_or_a_bad_one_is_401_and_health_stays_open(anonymous: AsyncClient) -> None:
    for headers in (
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": f"Bearer crk_{'0' * 12}_{'a' * 43}"},
    ):
        for method, path in (
            ("GET", "/v1/runs"),
            ("POST", "/v1/runs"),
            ("GET", "/v1/keys"),
            ("GET", "/v1/evals/e"),
        ):
            response = await anonymous.request(method, path, headers=headers, json={"name": "x"})
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
            assert "API key" in response.json()["detail"]
    assert (await anonymous.get("/healthz")).status_code == 200
    assert (await anonymous.get("/readyz")).status_code == 200
    assert (await anonymous.get("/openapi.json")).status_code == 200


async def test_each_scope_does_what_it_allows_and_no_more(anonymous: AsyncClient, database_url: str) -> None:
    read, write = key_headers(database_url, "read"), key_headers(database_url, "write")
    assert (await anonymous.get("/v1/runs", headers=read)).status_code == 200
    refused = await anonymous.post("/v1/runs", headers=read, json={"name": "r"})
    assert refused.status_code == 403 and "needs a write key" in refused.json()["detail"]
    created = await anonymous.post("/v1/runs", headers=write, json={"name": "w"})
    assert created.status_code == 201, created.text
    run_id = created.json()["run_id"]
    assert (await anonymous.post(f"/v1/runs/{run_id}/cancel", headers=read)).status_code == 403
    assert (await anonymous.post("/v1/evals", headers=read, json={"run_id": run_id})).status_code == 403
    listing = await anonymous.get("/v1/keys", headers=write)
    assert listing.status_code == 403 and "needs a admin key" in listing.json()["detail"]


async def test_an_admin_makes_lists_and_revokes_keys(
    anonymous: AsyncClient, database_url: str, sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    admin = key_headers(database_url, "admin")
    made = await anonymous.post("/v1/keys", headers=admin, json={"scope": "read", "name": "a reader"})
    assert made.status_code == 201, made.text
    token, key_id = made.json()["token"], made.json()["key_id"]
    assert token.startswith(f"crk_{key_id}_")
    reader = {"Authorization": f"Bearer {token}"}
    assert (await anonymous.get("/v1/runs", headers=reader)).status_code == 200
    listed = (await anonymous.get("/v1/keys", headers=admin)).json()
    assert {k["key_id"]: k["scope"] for k in listed}[key_id] == "read"
    assert all("token" not in k and "secret_sha256" not in k for k in listed)
    async with sessionmaker() as session:  # the database keeps a digest, never the secret
        stored = (await session.scalars(select(ApiKey.secret_sha256))).all()
    assert token.split("_", 2)[2] not in stored and all(len(s) == 64 for s in stored)

    revoked = await anonymous.post(f"/v1/keys/{key_id}/revoke", headers=admin)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert (await anonymous.get("/v1/runs", headers=reader)).status_code == 401
    assert (await anonymous.post(f"/v1/keys/{key_id}/revoke", headers=admin)).status_code == 200  # idempotent
    assert (await anonymous.post("/v1/keys/nope/revoke", headers=admin)).status_code == 404
    own_id = admin["Authorization"].split("_")[1]
    itself = await anonymous.post(f"/v1/keys/{own_id}/revoke", headers=admin)
    assert itself.status_code == 409 and "cannot revoke itself" in itself.json()["detail"]
    bad_scope = await anonymous.post("/v1/keys", headers=admin, json={"scope": "root", "name": "x"})
    assert bad_scope.status_code == 422


async def test_writes_past_the_burst_are_429_per_key_and_reads_are_not_limited(
    sessionmaker: async_sessionmaker[AsyncSession], database_url: str
) -> None:
    app = create_app(settings=Settings(write_burst=3, write_rate_per_s=0.01), sessionmaker=sessionmaker)
    async with AsyncClient(transport=ASGITransport(app=app), base_url="http://api") as anonymous:
        await _writes_are_limited(anonymous, database_url)


async def _writes_are_limited(anonymous: AsyncClient, database_url: str) -> None:
    first, second = key_headers(database_url, "write"), key_headers(database_url, "write")
    for _ in range(3):
        assert (await anonymous.post("/v1/runs", headers=first, json={"name": "n"})).status_code == 201
    limited = await anonymous.post("/v1/runs", headers=first, json={"name": "n"})
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    assert "write rate" in limited.json()["detail"]
    assert (await anonymous.post("/v1/runs", headers=second, json={"name": "n"})).status_code == 201
    for _ in range(10):
        assert (await anonymous.get("/v1/runs", headers=first)).status_code == 200


async def test_the_dashboard_logs_in_with_a_cookie_good_for_reads_only(
    anonymous: AsyncClient, database_url: str
) -> None:
    token = key_headers(database_url, "admin")["Authorization"].removeprefix("Bearer ")
    away = await anonymous.get("/runs/run-1?tab=x")
    assert (
        away.status_code == 303
        and away.headers["location"] == "http://api/login?next=%2Fruns%2Frun-1%3Ftab%3Dx"
    )
    form = await anonymous.get("/login")
    assert form.status_code == 200 and 'name="key"' in form.text
    wrong = await anonymous.get("/login", params={"key": "crk_nope"})
    assert (
        wrong.status_code == 401
        and "unknown or revoked" in wrong.text
        and "crucible_key" not in wrong.headers.get("set-cookie", "")
    )
    elsewhere = await anonymous.get("/login", params={"key": token, "next": "//evil.example/x"})
    assert elsewhere.status_code == 303 and elsewhere.headers["location"] == "/"
    cookie = elsewhere.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert anonymous.cookies.get("crucible_key") == token
    assert (await anonymous.get("/")).status_code == 200
    assert (await anonymous.get("/v1/runs")).status_code == 200  # the page's charts read with it
    refused = await anonymous.post("/v1/runs", json={"name": "from a page"})
    assert refused.status_code == 401  # a cookie never writes
    out = await anonymous.get("/logout")
    assert out.status_code == 303 and anonymous.cookies.get("crucible_key") is None
    assert (await anonymous.get("/")).status_code == 303


async def test_openapi_documents_the_scheme_and_every_guarded_route(anonymous: AsyncClient) -> None:
    spec = (await anonymous.get("/openapi.json")).json()
    schemes = spec["components"]["securitySchemes"]
    assert schemes["apiKey"] == {**schemes["apiKey"], "type": "http", "scheme": "bearer"}
    guarded = {path: operations for path, operations in spec["paths"].items() if path.startswith("/v1/")}
    assert "/v1/keys" in guarded and "/healthz" in spec["paths"]
    for path, operations in guarded.items():
        for method, operation in operations.items():
            names = {name for requirement in operation.get("security", []) for name in requirement}
            assert "apiKey" in names, (method, path)
            assert {"401", "403"} <= set(operation["responses"]), (method, path)
            if method == "post":
                assert "429" in operation["responses"], path
