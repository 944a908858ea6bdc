from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from crucible.db import make_engine
from crucible.db.migrate import (
    SchemaError,
    check_schema,
    current_revision,
    downgrade_async,
    head_revision,
    upgrade_async,
)
from crucible.db.models import Base

pytestmark = pytest.mark.integration
TABLES = {
    "runs",
    "steps",
    "step_trajectories",
    "trajectories",
    "gradings",
    "checkpoints",
    "tasks",
    "evaluations",
    "api_keys",
}


async def _tables_and_diff(url: str) -> tuple[set[str], list, str | None]:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            tables = set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
            diff = await conn.run_sync(
                lambda c: compare_metadata(
                    MigrationContext.configure(c, opts={"compare_type": True}), Base.metadata
                )
            )
        return tables - {"alembic_version"}, diff, await current_revision(engine)
    finally:
        await engine.dispose()


async def test_upgrade_builds_the_schema_the_models_describe(database_url: str) -> None:
    await upgrade_async(database_url)
    tables, diff, revision = await _tables_and_diff(database_url)
    assert tables == TABLES
    assert diff == [], f"models and migrations disagree: {diff}"
    assert revision == head_revision()


async def test_downgrade_to_base_and_upgrade_again(database_url: str) -> None:
    await upgrade_async(database_url)
    await downgrade_async(database_url, "base")
    tables, _, revision = await _tables_and_diff(database_url)
    assert tables == set() and revision is None
    await upgrade_async(database_url)
    tables, _, revision = await _tables_and_diff(database_url)
    assert tables == TABLES and revision == head_revision()


async def test_check_schema_tells_how_to_migrate(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}"
    engine = make_engine(url)
    try:
        with pytest.raises(SchemaError, match=r"revision none.*crucible\.db upgrade"):
            await check_schema(engine)
        await upgrade_async(url)
        await check_schema(engine)
    finally:
        await engine.dispose()


def test_cli_upgrades_and_reports_the_revision(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli' / 'crucible.db'}"
    env = {**os.environ, "CRUCIBLE_DATABASE_URL": url}
    cmd = [sys.executable, "-m", "crucible.db"]
    subprocess.run([*cmd, "upgrade"], env=env, check=True, capture_output=True, timeout=60)
    out = subprocess.run([*cmd, "current"], env=env, check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"current: {head_revision()}  head: {head_revision()}"


def test_unsupported_database_url_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported database URL scheme 'mysql'"):
        make_engine("mysql://localhost/crucible")
