"""A real bubblewrap sandbox over a temporary workspace root, and sessions made from small tar.gz repos."""

from __future__ import annotations

import shutil
import uuid

import pytest

from sandbox_archives import REPO, make_tar
from services.sandbox.manager import build_sandbox
from services.sandbox.session import Session
from services.sandbox.settings import Settings


@pytest.fixture
def settings(tmp_path):
    return Settings(workspace_root=tmp_path / "sandboxes", replica="unit", read_max_lines=50)


@pytest.fixture
def sandbox(settings):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    return build_sandbox(settings)


@pytest.fixture
async def new_session(settings, sandbox):
    """Factory: `await new_session(files)` creates a session; all are destroyed at the end."""
    made: list[Session] = []

    async def create(files: dict[str, str | bytes] = REPO) -> Session:
        session_id = uuid.uuid4().hex
        session = await Session.create(
            archive=make_tar(files),
            session_id=session_id,
            run_id="run",
            task_id="task",
            root=settings.workspace_root / settings.replica / session_id,
            ttl_s=60.0,
            settings=settings,
            sandbox=sandbox,
        )
        made.append(session)
        return session

    yield create
    for session in made:
        await session.destroy()


@pytest.fixture
async def session(new_session):
    return await new_session()
