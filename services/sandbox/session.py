"""One sandbox session: a workspace unpacked from a task snapshot, and the sandboxed commands run in it.

The snapshot is committed to a git repository kept outside the workspace (the agent never sees it),
so the diff of the agent's work can be exported at any time. Every git and tar command runs inside
the sandbox: a link planted in the workspace cannot make them read or write a host file.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from crucible.bus import RequestError
from crucible.contracts.sandbox import ToolResult
from services.sandbox.archive import BadArchive, check_archive
from services.sandbox.bwrap import WORKSPACE, Bind, Sandbox
from services.sandbox.process import execute
from services.sandbox.settings import Settings

T = TypeVar("T")
GIT_DIR = "/crucible/baseline.git"
GIT_ENV = {"GIT_DIR": GIT_DIR, "GIT_WORK_TREE": WORKSPACE}
INTERNAL_TIMEOUT_S = 120.0
UNTAR = ["tar", "-xzf", "-", "--no-same-owner", "-C", WORKSPACE]
_COMMIT = "git -c user.name=crucible -c user.email=crucible@localhost commit -q --no-verify --allow-empty"
_IGNORED = "'__pycache__/' '*.pyc' '.pytest_cache/'"
BASELINE = (
    f"set -e; git init -q; printf '%s\\n' {_IGNORED} > \"$GIT_DIR/info/exclude\"; "
    f"git add -A -f; {_COMMIT} -m snapshot"
)
DIFF = (
    "git add -A >/tmp/git.log 2>&1 || { cat /tmp/git.log; exit 97; }; "
    "git diff --cached --binary HEAD 2>/tmp/git.log || { cat /tmp/git.log; exit 98; }"
)


class Session:
    def __init__(
        self,
        *,
        session_id: str,
        run_id: str,
        task_id: str,
        root: Path,
        ttl_s: float,
        settings: Settings,
        sandbox: Sandbox,
    ) -> None:
        self.id = session_id
        self.run_id = run_id
        self.task_id = task_id
        self.root = root
        self.workspace = root / "workspace"
        self.git_dir = root / "baseline.git"
        self.ttl_s = ttl_s
        self.settings = settings
        self.sandbox = sandbox
        self.closed = False
        self.deadline = time.monotonic() + ttl_s
        self._lock = asyncio.Lock()
        self._current: asyncio.Task | None = None

    @classmethod
    async def create(cls, *, archive: bytes, **kwargs: Any) -> Session:
        """Unpack `archive` into a new workspace (kwargs as for `Session`) and commit it as the baseline.

        Raises BadArchive if the archive is refused or does not unpack; nothing is left behind.
        """
        session = cls(**kwargs)
        try:
            session.workspace.mkdir(parents=True)
            session.git_dir.mkdir()
            await session.unpack(archive)
            result = await session.sandboxed(["bash", "-c", BASELINE], git=True)
            if not result.ok:
                raise RuntimeError(f"cannot commit the snapshot: {result.error}: {result.output}")
        except BaseException:
            await session.destroy()
            raise
        return session

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def touch(self) -> None:
        self.deadline = time.monotonic() + self.ttl_s

    async def sandboxed(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float = INTERNAL_TIMEOUT_S,
        output_cap: int | None = None,
        stdin: bytes | None = None,
        git: bool = False,
    ) -> ToolResult:
        """Run `argv` inside the sandbox over this workspace; with git=True the baseline repo is mounted."""
        binds = [Bind(source=self.git_dir, dest=GIT_DIR, writable=True)] if git else []
        command = self.sandbox.argv(argv, workspace=self.workspace, binds=binds, env=GIT_ENV if git else {})
        cap = output_cap or self.settings.output_cap_bytes
        return await execute(command, timeout_s=timeout_s, output_cap=cap, stdin=stdin)

    async def unpack(self, archive: bytes) -> ToolResult:
        """Lay a tar.gz over the workspace root; BadArchive if it is refused or does not unpack."""
        s = self.settings
        await asyncio.to_thread(
            check_archive, archive, max_bytes=s.max_snapshot_bytes, max_members=s.max_snapshot_members
        )
        result = await self.sandboxed(UNTAR, stdin=archive)
        if not result.ok:
            raise BadArchive(f"cannot unpack: {result.error}: {result.output.strip()}")
        return result

    async def diff(self) -> str:
        cap = self.settings.max_diff_bytes
        result = await self.sandboxed(["bash", "-c", DIFF], git=True, output_cap=cap + 1)
        if result.truncated:
            raise RequestError("diff_too_large", f"the workspace diff is over {cap} bytes")
        if not result.ok:
            raise RuntimeError(f"git diff failed: {result.error}: {result.output}")
        return result.output

    async def apply_patch(self, patch: str) -> ToolResult:
        if not patch.strip():
            return ToolResult(ok=True, output="empty patch: nothing to apply")
        argv = ["git", "apply", "--whitespace=nowarn", "--verbose", "-"]
        return await self.sandboxed(argv, git=True, stdin=patch.encode())

    async def exclusive(self, work: Callable[[], Awaitable[T]]) -> T:
        """Run one call on this session: calls are serialised, and destroy() cancels the running one."""
        async with self._lock:
            if self.closed:
                raise RequestError("session_closed", f"session {self.id} was destroyed")
            self.touch()
            self._current = asyncio.ensure_future(work())
            try:
                return await self._current
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self.closed and task is not None and not task.cancelling():
                    raise RequestError(
                        "session_closed", f"session {self.id} was destroyed mid-call"
                    ) from None
                raise
            finally:
                self._current = None
                self.touch()

    async def destroy(self) -> None:
        """Stop the running call (its processes are killed) and delete the workspace."""
        self.closed = True
        current = self._current
        if current is not None and not current.done():
            current.cancel()
            await asyncio.gather(current, return_exceptions=True)
        await asyncio.to_thread(shutil.rmtree, self.root, ignore_errors=True)
