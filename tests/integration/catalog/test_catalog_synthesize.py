"""Task synthesis on real projects' source distributions (toolz, more-itertools, fetched by `make
sdists`): mutations their own tests catch become verified tasks, served from the catalog's index."""

from __future__ import annotations

import ast
import os

import pytest
from sdists import unpack

from crucible.bus import Bus
from crucible.clients.sandbox import SandboxClient
from crucible.db import make_engine, make_sessionmaker
from crucible.db.migrate import upgrade_async
from crucible.db.models import Task
from crucible.objectstore import ObjectStore
from services.catalog.mutations import mutations
from services.catalog.synthesize import synthesize_tasks

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_mutations_change_one_span_and_keep_the_rest(tmp_path):
    root = unpack("toolz", tmp_path)
    text = (root / "toolz" / "itertoolz.py").read_text()
    found = mutations("toolz/itertoolz.py", text)
    assert {m.kind for m in found} >= {"comparison", "boolean", "off_by_one", "swapped_args", "wrong_return"}
    for m in [m for m in found if m.parses()]:
        # One contiguous span differs, no longer than the code it replaces, and the file still parses.
        head = len(os.path.commonprefix([text, m.source]))  # noqa: RUF071  (texts, compared by character)
        tail = len(os.path.commonprefix([text[head:][::-1], m.source[head:][::-1]]))  # noqa: RUF071
        assert m.source != text and len(text) - head - tail <= len(m.before), m.label
        ast.parse(m.source)


@pytest.mark.parametrize(("project", "asked"), [("toolz", 3), ("more_itertools", 2)])
async def test_synthesis_yields_verified_tasks(project, asked, tmp_path, common_settings, sandbox):
    root = unpack(project, tmp_path)
    settings = common_settings()
    await upgrade_async(settings.database_url)
    store = ObjectStore.from_settings(settings)
    await store.ensure_bucket()
    engine = make_engine(settings.database_url)
    bus = await Bus.connect(settings, store=store, name="test-synthesize")
    try:
        sessionmaker = make_sessionmaker(engine)
        report = await synthesize_tasks(
            repo=root, taskset=project.replace("_", "-"), max_tasks=asked, seed=0, store=store,
            sessionmaker=sessionmaker, sandboxes=SandboxClient(bus), timeout_s=60,
        )  # fmt: skip
        assert report.verified == asked, report.as_json()
        async with sessionmaker() as session:
            from sqlalchemy import select

            rows = (
                await session.scalars(select(Task).where(Task.taskset == project.replace("_", "-")))
            ).all()
        assert len(rows) == asked
        for row in rows:
            assert (
                row.source == "synthesized"
                and row.fail_to_pass
                and row.reference_patch.startswith("diff --git")
            )
            assert "tests" not in row.reference_patch.split("\n", 1)[0]  # the fix is in library code
            removed = [
                line[1:].strip()
                for line in row.reference_patch.splitlines()
                if line.startswith("-") and not line.startswith("---")
            ]
            assert not any(len(r) >= 6 and r in row.statement for r in removed), row.statement
        print(report.as_json())
    finally:
        await bus.close()
        await engine.dispose()
