"""One sandbox session: a workspace over a task snapshot, the commands run in it, its background jobs
and its edit history.

Calls on one session are serialised (`exclusive`); destroying it cancels the running call, kills its
background jobs and every process left in its cgroup, and deletes the workspace. Every git and tar
command runs inside the sandbox: a link planted in the workspace cannot make them touch a host file.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from crucible.bus import RequestError
from crucible.contracts.sandbox import ToolResult
from services.sandbox.isolation import network
from services.sandbox.isolation.archive import BadArchive, check_archive
from services.sandbox.isolation.beneath import Root
from services.sandbox.isolation.bwrap import Bind, Sandbox
from services.sandbox.isolation.cgroups import Cgroup, Counters
from services.sandbox.isolation.process import Capture, Job
from services.sandbox.settings import Settings
from services.sandbox.workspace import GIT_PREPARE, UNTAR, Workspace, git_env

T = TypeVar("T")
INTERNAL_TIMEOUT_S = 120.0
DIFF = (
    f"{GIT_PREPARE}; git add -A >/tmp/git.log 2>&1 || {{ cat /tmp/git.log; exit 97; }}; "
    "git diff --cached --binary HEAD 2>/tmp/git.log || { cat /tmp/git.log; exit 98; }"
)
_SIGNALS = {24: "cpu", 25: "file_size"}  # SIGXCPU, SIGXFSZ: the CPU-time and file-size rlimits
EDIT_HISTORY = 10
_OUT_OF_MEMORY = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")


class Session:
    def __init__(
        self,
        *,
        session_id: str,
        run_id: str,
        task_id: str,
        workspace: Workspace,
        cgroup: Cgroup | None,
        ttl_s: float,
        settings: Settings,
        sandbox: Sandbox,
    ) -> None:
        self.id = session_id
        self.run_id = run_id
        self.task_id = task_id
        self.workspace = workspace
        self.files = Root(workspace.path)
        self.cgroup = cgroup
        self.ttl_s = ttl_s
        self.settings = settings
        self.sandbox = sandbox
        self.closed = False
        self.deadline = time.monotonic() + ttl_s
        self.generation = 0
        """Bumped by everything that may change the workspace (search indexes key on it)."""
        self.search_index: object | None = None
        """codebase_search's index of this workspace, rebuilt when `generation` moves."""
        self.jobs: dict[str, Job] = {}
        self.netns: int | None = None
        """The session's own loopback network, made by its first background job (see `network`)."""
        self.edits: dict[str, list[bytes | None]] = {}
        """Per path, what the file held before each edit tool call (None: it did not exist)."""
        self._lock = asyncio.Lock()
        self._current: asyncio.Future | None = None

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    @property
    def cgroup_procs(self) -> Sequence[str]:
        """The files a command's launcher writes its pid into to join the session's cgroups."""
        return self.cgroup.procs_files if self.cgroup else ()

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
        binds: Sequence[Bind] = (),
        env: Mapping[str, str] = {},
        stderr: Capture | None = None,
    ) -> ToolResult:
        """Run `argv` inside the sandbox over this workspace and say which limit stopped it, if one did
        (stderr goes into the output, or to `stderr` when given)."""
        before = self.cgroup.counters() if self.cgroup else None
        result = await self.sandbox.run(
            argv,
            workspace=self.workspace.path,
            binds=[*(self.workspace.git_binds() if git else []), *binds],
            env={**(git_env() if git else {}), **env},
            timeout_s=timeout_s,
            output_cap=output_cap or self.settings.output_cap_bytes,
            stdin=stdin,
            cgroup_procs=self.cgroup_procs,
            netns=self.netns,
            stderr=stderr,
        )
        self.generation += 1
        result.limit = self._limit_hit(result, before, stderr.text() if stderr else "")
        if result.limit and not result.timed_out:
            stopped = f"stopped by the sandbox's {result.limit} limit"
            result.error = f"{result.error}; {stopped}" if result.error else stopped
        return result

    def _limit_hit(self, result: ToolResult, before: Counters | None, stderr: str) -> str | None:
        if result.timed_out:
            return "timeout"
        code = result.exit_code
        signal = -code if code is not None and code < 0 else code - 128 if code and code > 128 else None
        after = self.cgroup.counters() if self.cgroup else None
        if after and before and after.oom_kills > before.oom_kills:
            return "memory"
        if signal in _SIGNALS:
            return _SIGNALS[signal]
        if code and after and before and after.pids_refused > before.pids_refused:
            return "processes"
        free = self.workspace.free_bytes()
        if code and free is not None and free < 64 * 1024:
            return "disk"
        if code and any(sign in result.output[-2048:] + stderr[-2048:] for sign in _OUT_OF_MEMORY):
            return "memory"  # one process at its address-space rlimit: it failed to allocate
        return None

    async def start_job(self, command: str) -> str:
        """Start `command` in the background in its own sandbox over this workspace; its id. Where the
        host allows it, the session's later commands share its network (a server it starts answers)."""
        s = self.settings
        for job_id in [j for j, job in self.jobs.items() if not job.running]:
            if len(self.jobs) >= s.max_background_jobs:
                del self.jobs[job_id]
        if len(self.jobs) >= s.max_background_jobs:
            raise RequestError("busy", f"this session already runs {s.max_background_jobs} background jobs")
        if self.netns is None and self.sandbox.shared_network:
            self.netns = network.loopback_namespace()
        job = await self.sandbox.start(
            ["bash", "-lc", command],
            workspace=self.workspace.path,
            output_cap=s.output_cap_bytes,
            lifetime_s=s.max_run_timeout_s,
            cgroup_procs=self.cgroup_procs,
            netns=self.netns,
        )
        job_id = uuid.uuid4().hex[:8]
        self.jobs[job_id] = job
        self.generation += 1
        return job_id

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

    def remember(self, path: str, before: bytes | None) -> None:
        history = self.edits.setdefault(path, [])
        history.append(before)
        del history[:-EDIT_HISTORY]
        self.generation += 1

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
        """Stop the running call and every process of the session, and delete the workspace."""
        self.closed = True
        current = self._current
        if current is not None and not current.done():
            current.cancel()
            await asyncio.gather(current, return_exceptions=True)
        await asyncio.gather(*(job.kill() for job in self.jobs.values()), return_exceptions=True)
        if self.netns is not None:
            # Commands run inside `exclusive` calls and jobs, both ended above: no launcher is left to
            # open this descriptor by number (nsenter) after it is closed and its number reused.
            os.close(self.netns)
            self.netns = None
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
        await asyncio.to_thread(self.workspace.destroy)
