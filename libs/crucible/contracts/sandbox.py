"""Sandbox request/reply messages.

`sandbox.create` is served by a queue group (any replica with room answers); the reply names the replica
that now holds the session, and every later call goes to `sandbox.<replica>.<verb>` (see
`subjects.sandbox_call`) with one of the verbs below. Errors come back as `RemoteError` codes:
`unknown_session`, `busy`, `bad_snapshot`, `bad_request`, `diff_too_large`, `session_closed`,
`shutting_down`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from crucible.contracts.messages import Message, ObjectRef, TestResult

VERB_TOOL = "tool"
VERB_DIFF = "diff"
VERB_APPLY = "apply"
VERB_RUN = "run"
VERB_OVERLAY = "overlay"
VERB_DESTROY = "destroy"
VERB_FORK = "fork"
VERB_ALIVE = "alive"
VERBS = (VERB_TOOL, VERB_DIFF, VERB_APPLY, VERB_RUN, VERB_OVERLAY, VERB_DESTROY, VERB_FORK, VERB_ALIVE)
LIMITS = ("timeout", "memory", "processes", "cpu", "file_size", "disk")


class GuardSpec(msgspec.Struct, kw_only=True):
    """run_tests under the grading guard (`crucible.pytest_report`): what the graded change added."""

    added: dict[str, list[int]]
    """The lines the change added, by path from the repository root: events they cause are refused."""
    protected: list[str] = msgspec.field(default_factory=list)
    """The hidden tests' files: the code under test may not read or write them."""


class GuardFinding(msgspec.Struct, kw_only=True):
    """One event the guard refused, and the added line that caused it."""

    rule: str
    path: str
    line: int
    detail: str = ""


class ToolResult(msgspec.Struct, kw_only=True):
    """What one tool call did. A failed call is a result with ok=False and an error, never an exception."""

    ok: bool
    output: str = ""
    error: str | None = None
    truncated: bool = False
    exit_code: int | None = None
    timed_out: bool = False
    duration_s: float = 0.0
    limit: str | None = None  # which of LIMITS stopped the command, if one did
    tests: list[TestResult] | None = None  # run_tests: one outcome per test, from pytest itself
    guard: list[GuardFinding] | None = None  # run_tests with a guard: what it refused (None: no log)


class CreateRequest(Message, tag="sandbox.create.v1"):
    run_id: str
    task_id: str
    snapshot: ObjectRef  # tar.gz of the repository, members relative to its root
    ttl_s: float = 600.0  # idle time after which the session is destroyed; every call renews it


class CreateReply(Message, tag="sandbox.create_reply.v1"):
    session_id: str
    replica: str


class ToolRequest(Message, tag="sandbox.tool.v1"):
    session_id: str
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolReply(Message, tag="sandbox.tool_reply.v1"):
    result: ToolResult


class DiffRequest(Message, tag="sandbox.diff.v1"):
    session_id: str


class DiffReply(Message, tag="sandbox.diff_reply.v1"):
    diff: str  # unified diff (git, with binary hunks) of the workspace against the snapshot


class ApplyRequest(Message, tag="sandbox.apply.v1"):
    session_id: str
    patch: str


class RunRequest(Message, tag="sandbox.run.v1"):
    """Run a command in the session's sandbox: `argv` as given, or `command` through bash; exactly one."""

    session_id: str
    argv: list[str] | None = None
    command: str | None = None
    timeout_s: float | None = None  # None: the service default
    output_cap: int | None = None  # bytes of output kept (head and tail); None: the service default


class OverlayRequest(Message, tag="sandbox.overlay.v1"):
    """Lay a tar.gz over the workspace root (the grader's hidden tests)."""

    session_id: str
    archive: ObjectRef


class ForkRequest(Message, tag="sandbox.fork.v1"):
    """Copy a prepared session into `count` new ones (the G rollouts of a group), on the same replica."""

    session_id: str
    count: int = 1
    ttl_s: float = 600.0


class ForkReply(Message, tag="sandbox.fork_reply.v1"):
    session_ids: list[str]
    replica: str


class DestroyRequest(Message, tag="sandbox.destroy.v1"):
    session_id: str


class DestroyReply(Message, tag="sandbox.destroy_reply.v1"):
    destroyed: bool  # False when the session was already gone


class AliveRequest(Message, tag="sandbox.alive.v1"):
    """Whether the replica still holds a session: answered at once, even while a call runs on it, and
    renews nothing (a client waiting on a long call asks it to find out that the replica died)."""

    session_id: str


class AliveReply(Message, tag="sandbox.alive_reply.v1"):
    alive: bool


class LimitsRequest(Message, tag="sandbox.limits.v1"):
    """What a sandbox replica can serve (the api checks a run config against it)."""


class LimitsReply(Message, tag="sandbox.limits_reply.v1"):
    max_fork: int
    """Copies one fork may make: a run's group_size at most."""
    max_sessions: int
