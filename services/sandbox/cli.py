"""`crucible sandbox run|tool`: one command or one tool call in a fresh sandbox, for debugging a policy.

The sandbox is the service's own (bubblewrap, the default limits of `services.sandbox.settings`, a
`SessionManager` without bus or Redis) under a fresh workspace root in /tmp, removed afterwards. The
workspace is a copy of a directory: it is packed into a tar.gz in memory and handed to the manager as
the task snapshot, so nothing run inside can change the directory itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import posixpath
import shutil
import signal
import stat
import sys
import tarfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console

if TYPE_CHECKING:
    from services.sandbox.session import Session
    from services.sandbox.settings import Settings

T = TypeVar("T")
ROOT_PARENT = "/tmp"
"""Where the fresh workspace roots go: a folder the unprivileged sandbox uid can cross."""
ROOT_PREFIX = "crucible-sandbox-cli-"
EXIT_USAGE = 2
EXIT_NO_SANDBOX = 1
EXIT_INTERRUPTED = 130
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Each cancels the run and removes the sandbox (SIGINT too when a shell started us with it ignored)."""

sandbox_app = typer.Typer(
    help="Run one command or one tool call in a fresh sandbox over a copy of a directory (debugging).",
    no_args_is_help=True,
)

WorkspaceOption = Annotated[
    Path | None,
    typer.Option(
        "--workspace",
        "-w",
        help="Directory copied into the sandbox's /workspace (never written to); default: empty.",
    ),
]
MemoryOption = Annotated[
    int | None,
    typer.Option("--memory", min=64, help="Memory limit in MiB; default: the sandbox service's."),
]


class PackError(ValueError):
    """The directory cannot be copied into a sandbox (unreadable, too large)."""


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start here (bubblewrap missing or not working, no room for the workspace)."""


def _fail(code: int, message: str) -> typer.Exit:
    Console(stderr=True).print(
        f"crucible sandbox: {message}", style="red", markup=False, highlight=False, soft_wrap=True
    )
    return typer.Exit(code)


def _link_stays_inside(name: str, target: str) -> bool:
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    return not posixpath.isabs(target) and joined != ".." and not joined.startswith("../")


def pack_directory(directory: Path, *, max_bytes: int, max_members: int) -> tuple[bytes, list[str]]:
    """`directory` as a tar.gz (members relative to it) and what was left out, and why.

    Symlinks are stored as links, never followed; links leading out of the directory and special
    files (fifos, sockets, devices) are left out. PackError if a part cannot be read, or the whole
    is over `max_bytes` (file contents) or `max_members` entries.
    """
    entries: list[tuple[str, Path]] = []
    skipped: list[str] = []
    total = 0
    folders = [(directory, "")]
    while folders:
        folder, prefix = folders.pop()
        try:
            with os.scandir(folder) as listing:
                children = sorted(listing, key=lambda e: e.name)
        except OSError as exc:
            raise PackError(f"cannot read {folder}: {exc.strerror or exc}") from exc
        for child in children:
            name = prefix + child.name
            try:
                mode = child.stat(follow_symlinks=False).st_mode
                if stat.S_ISLNK(mode):
                    target = os.readlink(child.path)
                    if not _link_stays_inside(name, target):
                        skipped.append(f"{name} (symlink to {target!r}, outside the directory)")
                        continue
                elif stat.S_ISDIR(mode):
                    folders.append((Path(child.path), name + "/"))
                elif stat.S_ISREG(mode):
                    total += child.stat(follow_symlinks=False).st_size
                else:
                    skipped.append(f"{name} (special file)")
                    continue
            except OSError as exc:
                raise PackError(f"cannot read {child.path}: {exc.strerror or exc}") from exc
            entries.append((name, Path(child.path)))
            if len(entries) > max_members:
                raise PackError(
                    f"{directory} has more than {max_members} entries (CRUCIBLE_MAX_SNAPSHOT_MEMBERS)"
                )
            if total > max_bytes:
                raise PackError(
                    f"{directory} holds more than {max_bytes} bytes (CRUCIBLE_MAX_SNAPSHOT_BYTES)"
                )
    return _tar(sorted(entries)), skipped


def _tar(entries: list[tuple[str, Path]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for name, path in entries:
            try:
                info = tar.gettarinfo(str(path), arcname=name)  # a link stays a link
                if info.isreg():
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
            except OSError as exc:
                raise PackError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return buffer.getvalue()


def _settings(root: Path, memory_mib: int | None) -> Settings:
    """The service's defaults (and CRUCIBLE_* variables), over `root`, under a replica name of its own."""
    from pydantic import ValidationError

    from services.sandbox.settings import Settings

    overrides: dict[str, Any] = {"memory_bytes": memory_mib * 1024**2} if memory_mib else {}
    try:
        return Settings(workspace_root=root, replica=f"cli-{uuid.uuid4().hex[:8]}", **overrides)
    except ValidationError as exc:
        raise _fail(EXIT_USAGE, f"bad sandbox settings: {exc}") from None


def _check_directory(workspace: Path | None) -> None:
    if workspace is not None and not workspace.is_dir():
        raise _fail(EXIT_USAGE, f"{workspace}: no such directory")


def _archive(workspace: Path | None, settings: Settings) -> bytes:
    """The workspace directory packed (exit 2 when it is missing, unreadable or too large)."""
    if workspace is None:
        return _tar([])
    try:
        archive, skipped = pack_directory(
            workspace, max_bytes=settings.max_snapshot_bytes, max_members=settings.max_snapshot_members
        )
    except PackError as exc:
        raise _fail(EXIT_USAGE, str(exc)) from None
    for note in skipped:
        Console(stderr=True).print(f"not copied: {note}", markup=False, highlight=False, soft_wrap=True)
    return archive


async def _in_session(archive: bytes, settings: Settings, work: Callable[[Session], Awaitable[T]]) -> T:
    """`work(session)` in a fresh session over `archive`; every process, mount and cgroup of the
    sandbox is gone when this returns or raises, also when a STOP_SIGNALS cancels it."""
    from crucible.bus import RequestError
    from crucible.contracts.messages import ObjectRef
    from services.sandbox.manager import SessionManager

    digest = hashlib.sha256(archive).hexdigest()

    async def fetch(ref: ObjectRef) -> bytes:
        return archive

    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None

    def stop() -> None:
        if not task.cancelling():  # a second signal does not interrupt the clean-up
            task.cancel()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)
    manager = SessionManager(settings=settings, fetch=fetch)
    try:
        try:
            await manager.start()
            session = await manager.create(
                run_id="cli",
                task_id="cli",
                snapshot=ObjectRef(uri=f"cli://{digest}", sha256=digest, size=len(archive)),
                ttl_s=settings.max_ttl_s,
            )
        except (OSError, RuntimeError, RequestError) as exc:
            raise SandboxUnavailable(str(exc)) from exc
        return await session.exclusive(lambda: work(session))
    finally:
        await manager.close()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def _run_in_sandbox(workspace: Path | None, memory_mib: int | None, work: Callable[..., Awaitable[T]]) -> T:
    """Make the fresh workspace root, run `work(session, settings)` in a session, remove the root."""
    from crucible.telemetry import configure_logging
    from services.sandbox.roots import claim_workspace_root, sweep_abandoned_roots

    sweep_abandoned_roots(Path(ROOT_PARENT), ROOT_PREFIX)  # what runs killed outright left
    root = claim_workspace_root(Path(ROOT_PARENT), ROOT_PREFIX)
    try:
        settings = _settings(root, memory_mib)
        configure_logging(service="sandbox-cli", replica=settings.replica, level="WARNING")
        archive = _archive(workspace, settings)
        return asyncio.run(_in_session(archive, settings, lambda session: work(session, settings)))
    except SandboxUnavailable as exc:
        raise _fail(EXIT_NO_SANDBOX, f"the sandbox cannot start: {exc}") from None
    except (KeyboardInterrupt, asyncio.CancelledError):
        raise _fail(EXIT_INTERRUPTED, "interrupted; the sandbox was removed") from None
    finally:
        shutil.rmtree(root, ignore_errors=True)


@sandbox_app.command("run", context_settings={"allow_interspersed_args": False})
def run(
    command: Annotated[
        list[str], typer.Argument(metavar="CMD [ARGS]...", help="The command and its arguments (after --).")
    ],
    workspace: WorkspaceOption = None,
    timeout: Annotated[
        float | None,
        typer.Option(min=0.001, help="Seconds before it is killed; default and cap: the service's."),
    ] = None,
    memory: MemoryOption = None,
) -> None:
    """Run one command in a fresh sandbox and print what happened as one JSON object."""
    _check_directory(workspace)
    from services.sandbox.isolation.process import Capture

    async def work(session: Session, settings: Settings) -> dict[str, Any]:
        timeout_s = min(timeout or settings.run_timeout_s, settings.max_run_timeout_s)
        stderr = Capture(settings.output_cap_bytes)
        result = await session.sandboxed(command, timeout_s=timeout_s, stderr=stderr)
        return {
            "exit_code": result.exit_code,
            "stdout": result.output,
            "stderr": stderr.text(),
            "timed_out": result.timed_out,
            "truncated": result.truncated,
            "duration_s": result.duration_s,
            "limit": result.limit,
        }

    print(json.dumps(_run_in_sandbox(workspace, memory, work), indent=2, ensure_ascii=False))


@sandbox_app.command("tool")
def tool(
    name: Annotated[
        str, typer.Argument(help="The tool (or one of its aliases): read_file, replace, grep...")
    ],
    args_json: Annotated[str, typer.Argument(metavar="ARGS_JSON", help='Its arguments: {"path": "a.py"}.')],
    workspace: Annotated[
        Path,
        typer.Option("--workspace", "-w", help="Directory copied into the sandbox (never written to)."),
    ],
    memory: MemoryOption = None,
) -> None:
    """Run one tool call in a fresh sandbox and print its ToolResult as JSON."""
    try:
        arguments = json.loads(args_json)
    except json.JSONDecodeError as exc:
        raise _fail(EXIT_USAGE, f"ARGS_JSON is not JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise _fail(EXIT_USAGE, "ARGS_JSON must be a JSON object")
    _check_directory(workspace)

    import msgspec

    from services.sandbox.tools import TOOLS, call_tool, lookup

    entry = lookup(name)
    if entry is None:
        raise _fail(EXIT_USAGE, f"unknown tool {name!r}; tools: {', '.join(sorted(TOOLS))}")
    try:
        msgspec.convert(entry.normalise(arguments), entry.args)
    except msgspec.ValidationError as exc:
        raise _fail(EXIT_USAGE, f"bad arguments for {entry.name}: {exc}") from None

    async def work(session: Session, settings: Settings) -> bytes:
        return msgspec.json.encode(await call_tool(session, name, arguments))

    sys.stdout.write(msgspec.json.format(_run_in_sandbox(workspace, memory, work), indent=2).decode() + "\n")


def register(app: typer.Typer) -> None:
    app.add_typer(sandbox_app, name="sandbox")
