"""A real sandbox replica (SessionManager, no bus) over a workspace root the sandbox uid can reach,
and sessions made from small tar.gz repos."""

from __future__ import annotations

import hashlib
import shutil
import uuid

import pytest
from sandbox_archives import REPO, make_tar

from crucible.contracts.messages import ObjectRef
from services.sandbox.manager import SessionManager
from services.sandbox.session import Session
from services.sandbox.settings import Settings


@pytest.fixture
def settings(sandbox_root):
    return Settings(workspace_root=sandbox_root, replica=f"unit-{uuid.uuid4().hex[:6]}", read_max_lines=50)


@pytest.fixture
def archives():
    """Archives the manager can fetch, by sha256; `archive_ref` adds one."""
    return {}


@pytest.fixture
def archive_ref(archives):
    def add(data: bytes) -> ObjectRef:
        digest = hashlib.sha256(data).hexdigest()
        archives[digest] = data
        return ObjectRef(uri=f"s3://test/{digest}", sha256=digest, size=len(data))

    return add


@pytest.fixture
async def manager(settings, archives):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")

    async def fetch(ref: ObjectRef) -> bytes:
        return archives[ref.sha256]

    manager = SessionManager(settings=settings, fetch=fetch)
    await manager.start()
    yield manager
    await manager.close()


@pytest.fixture
def sandbox(manager):
    return manager.sandbox


@pytest.fixture
def new_session(manager, archive_ref):
    """Factory: `await new_session(files)` creates a session; the manager destroys all at the end."""

    async def create(files: dict[str, str | bytes] = REPO, *, links: dict[str, str] | None = None) -> Session:
        ref = archive_ref(make_tar(files, links=links))
        return await manager.create(run_id="run", task_id="task", snapshot=ref, ttl_s=60.0)

    return create


@pytest.fixture
async def session(new_session):
    return await new_session()
