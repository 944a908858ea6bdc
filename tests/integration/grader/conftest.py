"""The grader with a real sandbox and catalog, in-process, on a NATS server of this module's own.

ROLLOUTS is a work queue, and a work queue allows one consumer per subject: a private NATS server keeps
these tests' grader consumer away from every other test's streams.
"""

from __future__ import annotations

import pytest
import swebench_repos

from crucible.clients.sandbox import SandboxClient
from crucible.db import make_engine, make_sessionmaker
from crucible.db.migrate import upgrade_async
from crucible.localstack.servers import start_nats
from crucible.runtime import running
from services.catalog.app import setup as catalog_setup
from services.catalog.importing import import_swebench
from services.catalog.settings import Settings as CatalogSettings
from services.grader.app import setup as grader_setup
from services.grader.settings import Settings as GraderSettings


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    server = start_nats(state_dir=tmp_path_factory.mktemp("grader-nats"))
    yield server.url
    server.stop()


@pytest.fixture
def start_service():
    """`async with start_service(name, settings, setup) as rt:` runs a service for the block."""
    return running


@pytest.fixture
async def catalog(common_settings, sqlite_url):
    """The real catalog with one generated, verified task (difficulty 1)."""
    await upgrade_async(sqlite_url)
    settings = common_settings(CatalogSettings, tasks_per_difficulty=1, difficulties=[1], verify_workers=1)
    async with running("catalog", settings, catalog_setup) as rt:
        yield rt


@pytest.fixture
def grader_settings(common_settings, request):
    return common_settings(GraderSettings, **getattr(request, "param", {}))


@pytest.fixture
async def grader(grader_settings, sandbox, catalog):
    async with running("grader", grader_settings, grader_setup) as rt:
        yield rt


@pytest.fixture
async def imported(tmp_path, bus, store, catalog, sandbox):
    """SWE-bench-format tasks (pytest only, no probes) imported from local git repositories into the catalog's
    "imported" set, with broken instances among them: (import report, good instances, mirrors)."""
    mirrors, good = swebench_repos.build(tmp_path)
    text = swebench_repos.jsonl(good + swebench_repos.broken_instances(good), malformed=True)
    engine = make_engine(catalog.settings.database_url)
    try:
        report = await import_swebench(
            text=text, repos=mirrors, taskset="imported", split=None, scratch=tmp_path / "scratch",
            store=store, sessionmaker=make_sessionmaker(engine), sandboxes=SandboxClient(bus), timeout_s=10,
        )  # fmt: skip
    finally:
        await engine.dispose()
    return report, good, mirrors
