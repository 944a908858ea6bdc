"""Run one process with a hard timeout and an output cap, and say what happened as a `ToolResult`.

The process starts in its own process group; on timeout or cancellation the whole group is killed.
Output (stdout and stderr together, unless the caller asks for stderr apart) is read as it comes;
when it exceeds the cap, the head and the tail are kept and the middle is dropped, so both the
command's start and its final error survive.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence

from crucible.contracts.sandbox import ToolResult

READ_CHUNK = 64 * 1024
DRAIN_GRACE_S = 2.0
KILL_WAIT_S = 5.0


class Capture:
    """Keeps the first half and the last half of `cap` bytes of a stream (or all `cap` from the head)."""

    def __init__(self, cap: int, *, keep_tail: bool = True) -> None:
        self.head_cap = cap // 2 if keep_tail else cap
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        if len(self.tail) > 2 * self.tail_cap:
            del self.tail[: len(self.tail) - self.tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.head_cap + self.tail_cap

    def text(self) -> str:
        tail = self.tail[-self.tail_cap :] if self.tail_cap else b""
        if not self.truncated:
            return (self.head + tail).decode(errors="replace")
        omitted = self.total - len(self.head) - len(tail)
        marker = f"\n[... {omitted} bytes of output omitted ...]\n"
        return self.head.decode(errors="replace") + marker + bytes(tail).decode(errors="replace")

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(READ_CHUNK):
            self.feed(chunk)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(child) for child in f.read().split()]
    except OSError:
        pass
    return found


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


async def _kill_tree(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the process group and the process's children in their own sessions (bubblewrap's pid 1
    inside), then wait until those are gone: a pid namespace's init exits only after the kernel has
    killed everything else in it, so when this returns no process the command started is left."""
    children = _children(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    await proc.wait()
    deadline = time.monotonic() + KILL_WAIT_S
    while not all(_gone(child) for child in children) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


async def _feed_stdin(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


async def execute(
    argv: Sequence[str],
    *,
    timeout_s: float,
    output_cap: int,
    stdin: bytes | None = None,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    keep_tail: bool = True,
    pass_fds: Sequence[int] = (),
    stderr: Capture | None = None,
) -> ToolResult:
    """Run `argv` and wait for it. With `stderr`, the command's stderr goes there instead of into the
    result's output (and `truncated` says whether either was cut)."""
    started = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT if stderr is None else asyncio.subprocess.PIPE,
            start_new_session=True,
            cwd=cwd,
            env=env,
            pass_fds=pass_fds,
        )
    except OSError as exc:
        return ToolResult(
            ok=False, error=f"cannot start {argv[0]}: {exc}", duration_s=time.monotonic() - started
        )
    capture = Capture(output_cap, keep_tail=keep_tail)
    assert proc.stdout is not None
    readers = [capture.drain(proc.stdout)]
    if stderr is not None:
        assert proc.stderr is not None
        readers.append(stderr.drain(proc.stderr))
    reader = asyncio.gather(*readers)
    timed_out = False
    try:
        async with asyncio.timeout(timeout_s):
            if stdin is not None:
                await _feed_stdin(proc, stdin)
            await proc.wait()
    except TimeoutError:
        timed_out = True
    finally:
        if proc.returncode is None:
            await _kill_tree(proc)
        try:
            await asyncio.wait_for(reader, DRAIN_GRACE_S)
        except TimeoutError:
            pass
    code = proc.returncode
    error = f"timed out after {timeout_s:g}s" if timed_out else (None if code == 0 else f"exit code {code}")
    return ToolResult(
        ok=code == 0 and not timed_out,
        output=capture.text(),
        error=error,
        truncated=capture.truncated or (stderr is not None and stderr.truncated),
        exit_code=None if timed_out else code,
        timed_out=timed_out,
        duration_s=round(time.monotonic() - started, 4),
    )


class Job:
    """A command left running in the background: its output is kept (head and tail) as it comes, and
    it is killed when `lifetime_s` passes or `kill` is called."""

    def __init__(self, proc: asyncio.subprocess.Process, capture: Capture, lifetime_s: float) -> None:
        self.proc = proc
        self.capture = capture
        self.started = time.monotonic()
        self.killed_at_lifetime = False
        assert proc.stdout is not None
        self._reader = asyncio.ensure_future(capture.drain(proc.stdout))
        self._watchdog = asyncio.ensure_future(self._expire(lifetime_s))

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        *,
        output_cap: int,
        lifetime_s: float,
        env: Mapping[str, str],
        pass_fds: Sequence[int] = (),
    ) -> Job:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env=env,
            pass_fds=pass_fds,
        )
        return cls(proc, Capture(output_cap), lifetime_s)

    async def _expire(self, lifetime_s: float) -> None:
        try:
            await asyncio.wait_for(self.proc.wait(), lifetime_s)
        except TimeoutError:
            self.killed_at_lifetime = True
            await _kill_tree(self.proc)

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    def result(self) -> ToolResult:
        code = self.proc.returncode
        if code is None:
            state = "running"
        elif self.killed_at_lifetime:
            state = "killed: ran past its lifetime"
        else:
            state = f"exited with code {code}"
        return ToolResult(
            ok=code in (None, 0),
            output=f"[{state} after {time.monotonic() - self.started:.1f}s]\n{self.capture.text()}",
            exit_code=code,
            truncated=self.capture.truncated,
            error=None if code in (None, 0) else state,
        )

    async def kill(self) -> None:
        if self.proc.returncode is None:
            await _kill_tree(self.proc)
        await self.proc.wait()
        self._watchdog.cancel()
        try:
            await asyncio.wait_for(self._reader, DRAIN_GRACE_S)
        except TimeoutError:
            self._reader.cancel()
