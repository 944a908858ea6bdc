from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from api_process import key_headers
from httpx import ASGITransport, AsyncClient
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from crucible.agent import tokenizer
from crucible.contracts.messages import GradedTrajectory, Reward, TestResult, TokenUsage, ToolCall, Trajectory
from crucible.contracts.packing import pack
from crucible.db import make_engine, make_sessionmaker
from crucible.db.migrate import upgrade_async
from crucible.db.scratch import scratch_database
from services.api.app import create_app
from services.api.settings import Settings


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("api-db") / "migrated.db"
    loop = asyncio.new_event_loop()  # outside the tests' loops; asyncio.run would reset pytest-asyncio's
    try:
        loop.run_until_complete(upgrade_async(f"sqlite+aiosqlite:///{path}"))
    finally:
        loop.close()
    return path


@pytest.fixture(scope="session")
def postgres_template() -> Iterator[str]:
    """A migrated scratch PostgreSQL database that each test copies (CREATE DATABASE ... TEMPLATE)."""
    loop = asyncio.new_event_loop()
    scratch = scratch_database(prefix="crucible_template")
    try:
        try:
            url = loop.run_until_complete(scratch.__aenter__())
        except OSError as exc:
            pytest.skip(f"PostgreSQL is unreachable: {exc}")
        try:
            loop.run_until_complete(upgrade_async(url))
            yield make_url(url).database or ""
        finally:
            loop.run_until_complete(scratch.__aexit__(None, None, None))
    finally:
        loop.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def migrated_template(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(backend, template): set up here, outside the test's event loop."""
    fixture = {"sqlite": "sqlite_template", "postgresql": "postgres_template"}[request.param]
    return request.param, str(request.getfixturevalue(fixture))


@pytest.fixture
async def database_url(migrated_template: tuple[str, str], tmp_path: Path) -> AsyncIterator[str]:
    """A migrated, empty database per test: a copy of a migrated SQLite file or PostgreSQL database."""
    backend, template = migrated_template
    if backend == "sqlite":
        path = tmp_path / "crucible.db"
        shutil.copyfile(template, path)
        yield f"sqlite+aiosqlite:///{path}"
        return
    async with scratch_database(template=template) as url:
        yield url


@pytest.fixture
async def sessionmaker(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = make_engine(database_url)
    yield make_sessionmaker(engine)
    await engine.dispose()


@pytest.fixture
async def client(
    sessionmaker: async_sessionmaker[AsyncSession], database_url: str
) -> AsyncIterator[AsyncClient]:
    """The api in process, called with an admin key."""
    app = create_app(settings=Settings(), sessionmaker=sessionmaker)
    transport = ASGITransport(app=app)
    headers = key_headers(database_url)
    async with AsyncClient(transport=transport, base_url="http://api", headers=headers) as client:
        yield client


def _graded(
    run_id: str,
    trajectory_id: str,
    *,
    reward: float = 1.0,
    task_id: str = "pybugs/1",
    versions: tuple[int, int] = (0, 0),
    finish_reason: str = "done",
    graded_at: float = 1_700_000_000.0,
    grader_replica: str = "grader-a",
) -> GradedTrajectory:
    """An episode: prompt, agent action under versions[0], observation, answer under versions[1]."""
    prompt = [tokenizer.BOS, *tokenizer.encode("Fix add()")]
    action = [tokenizer.ACT, tokenizer.tool_token("grep"), *tokenizer.encode("def add")]
    observation = [tokenizer.OBS, *tokenizer.encode("calc.py:1")]
    answer = [tokenizer.ACT, tokenizer.tool_token("submit"), tokenizer.END]
    parts = [
        (prompt, 0, versions[0]),
        (action, 1, versions[0]),
        (observation, 0, versions[1]),
        (answer, 1, versions[1]),
    ]
    tokens = [t for toks, _, _ in parts for t in toks]
    start = len(prompt)
    call = ToolCall(
        index=0,
        name="grep",
        arguments="def add",
        ok=True,
        output="calc.py:1",
        duration_s=0.01,
        token_start=start,
        token_end=start + len(action),
        policy_version=versions[0],
    )
    traj = Trajectory(
        run_id=run_id,
        trajectory_id=trajectory_id,
        group_id="g-1",
        task_id=task_id,
        taskset="pybugs",
        tokens=pack("u32", tokens),
        logprobs=pack("f32", [-0.5] * len(tokens)),
        versions=pack("u32", [v for toks, _, v in parts for _ in toks]),
        loss_mask=pack("u8", [m for toks, m, _ in parts for _ in toks]),
        constraints=pack("u8", [0] * len(tokens)),
        tool_calls=[call],
        token_usage=TokenUsage(
            system=1, task=len(prompt) - 1, observations=len(observation), actions=len(action) + len(answer)
        ),
        final_diff="--- a/calc.py\n+++ b/calc.py\n",
        finish_reason=finish_reason,
    )
    result = Reward(
        total=reward,
        tests_passed=1 if reward > 0 else 0,
        tests_total=1,
        components={"tests": reward},
        tests=[TestResult(nodeid="test_calc.py::test_add", outcome="passed" if reward > 0 else "failed")],
    )
    return GradedTrajectory(
        trajectory=traj, reward=result, graded_at=graded_at, grader_replica=grader_replica
    )


@pytest.fixture
def make_graded() -> Callable[..., GradedTrajectory]:
    return _graded


@pytest.fixture
async def run_id(client: AsyncClient) -> str:
    response = await client.post("/v1/runs", json={"name": "history"})
    assert response.status_code == 201, response.text
    return response.json()["run_id"]
