"""Every request/reply endpoint on the bus, declared once: its subject, what it takes, what it answers,
and the queue group whose replicas share it. Both sides name the endpoint (`Bus.serve(endpoint, ...)`,
`Bus.request(endpoint, message)`), so neither can disagree with the other on a type or a queue, and a
type checker knows each request's reply type.

A sandbox session's calls go to the replica that holds it (`sandbox.<replica>.<verb>`): each verb is a
`SessionEndpoint`, a template whose `on(replica)` is the endpoint of one replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from crucible.contracts import sandbox, subjects
from crucible.contracts.messages import (
    CheckpointReply,
    CheckpointRequest,
    CommitReply,
    CommitRequest,
    DescribeReply,
    DescribeRequest,
    ListRequest,
    Message,
    SampleReply,
    SampleRequest,
    TaskReply,
    TaskRequest,
)

Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)


@dataclass(frozen=True)
class Endpoint(Generic[Req, Rep]):
    subject: str
    request: type[Req]
    reply: type[Rep]
    queue: str = ""
    """The queue group of the replicas that serve it (one of them answers each request); empty where a
    single replica serves the subject."""


@dataclass(frozen=True)
class SessionEndpoint(Generic[Req, Rep]):
    """A call on a sandbox session, served by the replica that holds the session."""

    verb: str
    request: type[Req]
    reply: type[Rep]

    def on(self, replica: str) -> Endpoint[Req, Rep]:
        return Endpoint(subjects.sandbox_call(replica, self.verb), self.request, self.reply)


CATALOG_SAMPLE = Endpoint(subjects.CATALOG_SAMPLE, SampleRequest, SampleReply, subjects.CATALOG_QUEUE)
CATALOG_GET = Endpoint(subjects.CATALOG_GET, TaskRequest, TaskReply, subjects.CATALOG_QUEUE)
CATALOG_SECRET = Endpoint(subjects.CATALOG_SECRET, TaskRequest, TaskReply, subjects.CATALOG_QUEUE)
CATALOG_LIST = Endpoint(subjects.CATALOG_LIST, ListRequest, SampleReply, subjects.CATALOG_QUEUE)
CATALOG_DESCRIBE = Endpoint(subjects.CATALOG_DESCRIBE, DescribeRequest, DescribeReply, subjects.CATALOG_QUEUE)

CHECKPOINTS_COMMIT = Endpoint(
    subjects.CHECKPOINTS_COMMIT, CommitRequest, CommitReply, subjects.CHECKPOINTS_QUEUE
)
CHECKPOINTS_GET = Endpoint(
    subjects.CHECKPOINTS_GET, CheckpointRequest, CheckpointReply, subjects.CHECKPOINTS_QUEUE
)

SANDBOX_CREATE = Endpoint(
    subjects.SANDBOX_CREATE, sandbox.CreateRequest, sandbox.CreateReply, subjects.SANDBOX_QUEUE
)
SANDBOX_LIMITS = Endpoint(
    subjects.SANDBOX_LIMITS, sandbox.LimitsRequest, sandbox.LimitsReply, subjects.SANDBOX_QUEUE
)
SANDBOX_TOOL = SessionEndpoint(sandbox.VERB_TOOL, sandbox.ToolRequest, sandbox.ToolReply)
SANDBOX_DIFF = SessionEndpoint(sandbox.VERB_DIFF, sandbox.DiffRequest, sandbox.DiffReply)
SANDBOX_APPLY = SessionEndpoint(sandbox.VERB_APPLY, sandbox.ApplyRequest, sandbox.ToolReply)
SANDBOX_RUN = SessionEndpoint(sandbox.VERB_RUN, sandbox.RunRequest, sandbox.ToolReply)
SANDBOX_OVERLAY = SessionEndpoint(sandbox.VERB_OVERLAY, sandbox.OverlayRequest, sandbox.ToolReply)
SANDBOX_DESTROY = SessionEndpoint(sandbox.VERB_DESTROY, sandbox.DestroyRequest, sandbox.DestroyReply)
SANDBOX_FORK = SessionEndpoint(sandbox.VERB_FORK, sandbox.ForkRequest, sandbox.ForkReply)
SANDBOX_ALIVE = SessionEndpoint(sandbox.VERB_ALIVE, sandbox.AliveRequest, sandbox.AliveReply)
