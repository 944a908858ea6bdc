"""Typed, versioned messages: one msgspec struct per message on the bus.

Each struct carries a tag (`<name>.v<version>`) in its msgpack encoding, so a consumer that receives a
message of the wrong type or version gets a clear decode error instead of a half-parsed object. Big
arrays travel as packed little-endian bytes (see `packing`), never as lists of Python numbers. Run
history events are in `events`, the run configuration (a pydantic model, validated on decode) in `runconfig`.
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec

from crucible.contracts.runconfig import RunConfig


class Message(msgspec.Struct, kw_only=True, tag_field="type", forbid_unknown_fields=False):
    """Base of every bus message."""


class ObjectRef(msgspec.Struct, kw_only=True, frozen=True):
    """A claim check: where a payload lives in the object store and how to verify it."""

    uri: str  # s3://bucket/key
    sha256: str
    size: int


class RunCreated(Message, tag="run.created.v1"):
    run_id: str
    name: str
    config: RunConfig
    created_at: float


class RunFinished(Message, tag="run.finished.v1"):
    """The durable end of a run, on the RUNS stream: rollouts stop admitting work for it."""

    run_id: str
    status: str  # finished | failed | cancelled (by an operator, through the api)
    step: int
    version: int
    finished_at: float
    error: str = ""


SPLITS = ("train", "validation", "test")
"""Every task belongs to one split, fixed when its task set is made; runs train on `train` only."""


class TaskSpec(msgspec.Struct, kw_only=True):
    """What a rollout may see of a task."""

    task_id: str
    taskset: str
    difficulty: int
    statement: str
    snapshot: ObjectRef  # tar.gz of the buggy repository
    split: str = "train"


class TaskSecret(msgspec.Struct, kw_only=True):
    """What only the grader may see: hidden tests and the reference patch."""

    task_id: str
    hidden_tests: ObjectRef  # tar.gz of test files, laid over the repository root
    test_command: list[str]
    reference_patch: str
    fail_to_pass: list[str] = msgspec.field(default_factory=list)
    """Test node ids that fail on the snapshot and pass with the reference patch (SWE-bench's
    FAIL_TO_PASS)."""
    pass_to_pass: list[str] = msgspec.field(default_factory=list)
    """Test node ids that pass before and after; a fix must not break them (PASS_TO_PASS)."""
    probes: dict[str, Expected] = msgspec.field(default_factory=dict)
    """Generated tasks: what each hidden probe test must give, by node id (see `crucible.probes`)."""


class SampleRequest(Message, tag="catalog.sample.v1"):
    run_id: str
    taskset: str
    count: int = 1
    difficulties: list[int] | None = None
    seed: int | None = None
    split: str = "train"
    sampling: Literal["uniform", "learnable"] = "uniform"
    """`learnable`: by the run's recent pass rate on each task (RunConfig `tasks.sampling`)."""


class ListRequest(Message, tag="catalog.list.v1"):
    """Every task of one split, in task id order (an evaluation's task list), at most `limit`."""

    taskset: str
    split: str = "test"
    limit: int = 1000


class DescribeRequest(Message, tag="catalog.describe.v1"):
    """What one task set holds: the difficulties of each split (what a run config may ask for)."""

    taskset: str


class DescribeReply(Message, tag="catalog.describe_reply.v1"):
    difficulties: dict[str, list[int]]
    """Split (train, validation, test) to the difficulties it has tasks of, ascending; {} for an unknown
    set."""


class SampleReply(Message, tag="catalog.sample_reply.v1"):
    tasks: list[TaskSpec]


class TaskRequest(Message, tag="catalog.get.v1"):
    """A task by id: on `catalog.get` its spec, on `catalog.secret` its secret too."""

    task_id: str


class TaskReply(Message, tag="catalog.get_reply.v1"):
    task: TaskSpec
    secret: TaskSecret | None = None


class ToolCall(msgspec.Struct, kw_only=True):
    index: int
    name: str
    arguments: str
    ok: bool
    output: str  # as the agent saw it (capped)
    duration_s: float
    token_start: int  # span of the call's tokens in the trajectory
    token_end: int
    policy_version: int


class TokenUsage(msgspec.Struct, kw_only=True, frozen=True):
    """Where an episode's tokens went, summed over its contexts: they add up to its length."""

    system: int = 0
    """The prompt's shared part: system prompt and tool definitions, the same for every task."""
    task: int = 0
    """The rest of each context's prompt: the task statement (and, after a summary, the summary)."""
    observations: int = 0
    """Tool results and the template's tokens between turns, summary requests included."""
    actions: int = 0
    """The policy's tool calls and summaries, with the end tokens that close them."""


TOKEN_PARTS: tuple[str, ...] = TokenUsage.__struct_fields__


class Trajectory(Message, tag="trajectory.v1"):
    """One episode of one rollout. Per-token arrays are packed little-endian, all of length T."""

    run_id: str
    trajectory_id: str
    group_id: str
    task_id: str
    taskset: str
    tokens: bytes  # u32
    logprobs: bytes  # f32 behaviour logprobs (0 where loss_mask is 0)
    versions: bytes  # u32 policy version that produced each token (env tokens: version at the time)
    loss_mask: bytes  # u8: 1 where the policy sampled the token
    constraints: bytes  # u8: index of the decoding constraint in force (see rollout.grammar)
    routes: bytes = b""  # u8 expert ids [T, layers, top_k] for router replay; empty for dense models
    routes_shape: list[int] = msgspec.field(default_factory=list)
    token_text: list[str] = msgspec.field(default_factory=list)
    """Each token's text, from a pretrained model's own tokenizer (which the api does not load); empty
    for the byte tokenizer of Crucible's presets, which anyone decodes."""
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    token_usage: TokenUsage | None = None
    """Tokens spent on system and tools, task, observations and actions (None: recorded before it was)."""
    context_starts: list[int] = msgspec.field(default_factory=list)
    """Where each context of the episode begins in the per-token arrays, when it has more than one (a run
    with agent.context_policy = "summarize"): each context is a sequence of its own, attending only to
    itself from position 0; empty means one context."""
    final_diff: str = ""
    finish_reason: str = "done"
    eval_id: str = ""
    """Set on an evaluation's episodes: graded like any other, never trained on."""
    eval_sample: int = 0
    """Within an evaluation: 0 for the greedy episode, 1..k for the sampled ones."""
    rollout_replica: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0


class Probed(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """What a probe test's call gave in the sandbox (see `crucible.probes`): exactly one field is set."""

    value: str | None = None
    """repr of the value it returned, a Python literal."""
    raised: str | None = None
    """The exception's class name (qualified by its module unless a builtin)."""
    unusable: str = ""
    """Why what it returned could not be recorded (not a plain literal)."""


class Expected(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """What a probe test must give to pass, kept out of the sandbox: a value's repr or a builtin error's
    name."""

    value: str | None = None
    error: str | None = None


class TestResult(msgspec.Struct, kw_only=True):
    nodeid: str
    outcome: str  # passed | failed | error | skipped
    duration_s: float = 0.0
    message: str = ""  # the assertion or error lines of a test that did not pass
    probe: Probed | None = None  # a probe test's recorded outcome, judged outside the sandbox


class Reward(msgspec.Struct, kw_only=True):
    total: float
    tests_passed: int
    tests_total: int
    components: dict[str, float] = msgspec.field(default_factory=dict)
    """The terms that add up to `total` (see services.grader.reward)."""
    tests: list[TestResult] = msgspec.field(default_factory=list)
    note: str = ""
    resolved: bool = False
    """Every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes."""
    fail_to_pass: list[int] = msgspec.field(default_factory=lambda: [0, 0])
    """[passed, total] of the task's FAIL_TO_PASS tests."""
    pass_to_pass: list[int] = msgspec.field(default_factory=lambda: [0, 0])
    quality: dict[str, float] = msgspec.field(default_factory=dict)
    """Measures of a resolved change of an evaluation or of a run with reward.quality (lint introduced,
    diff size, repetition, ...; see grader.quality)."""


class GradedTrajectory(Message, tag="graded.v1"):
    trajectory: Trajectory
    reward: Reward
    graded_at: float
    grader_replica: str = ""


class EvalRequest(Message, tag="eval.request.v1"):
    """Evaluate one weight version of a run on every task of a split: a greedy episode and `samples`
    sampled ones per task, through the rollout, sandbox and grader services like training episodes."""

    eval_id: str
    run_id: str
    version: int
    taskset: str
    split: str = "test"
    samples: int = 4
    max_tasks: int = 50
    requested_at: float = 0.0
    source: str = "api"  # api | schedule

    @classmethod
    def for_run(
        cls,
        *,
        eval_id: str,
        run_id: str,
        version: int,
        config: RunConfig,
        source: str,
        taskset: str | None = None,
        split: str | None = None,
        samples: int | None = None,
        max_tasks: int | None = None,
    ) -> EvalRequest:
        """The request the run's `eval` section describes, with any field given (not None) overridden."""
        return cls(
            eval_id=eval_id,
            run_id=run_id,
            version=version,
            source=source,
            requested_at=time.time(),
            taskset=taskset if taskset is not None else config.eval.taskset or config.tasks.taskset,
            split=split if split is not None else config.eval.split,
            samples=samples if samples is not None else config.eval.samples,
            max_tasks=max_tasks if max_tasks is not None else config.eval.max_tasks,
        )


def scheduled_eval_id(run_id: str, version: int) -> str:
    """The id of the evaluation a run's schedule asks for at `version` (one per version, however often
    asked)."""
    return f"{run_id}-v{version}"


class TensorEntry(msgspec.Struct, kw_only=True):
    name: str
    shape: list[int]
    dtype: str
    shard: int  # index into WeightsManifest.shards
    sha256: str = ""
    """sha256 of the tensor's raw bytes as published: what a loader must end up with, whether it read the
    tensor whole or rebuilt it from a delta (empty in manifests written before deltas existed)."""


class WeightsManifest(Message, tag="weights.manifest.v1"):
    """One weight version. A `full` version's shards are safetensors files; a `delta` version's shards
    (`crucible.model.weight_delta`) each hold, zstd-compressed, the XOR of its tensors' raw bits with those
    of the same tensors in the full version `base_version`, so a loader needs both."""

    run_id: str
    version: int
    step: int
    created_at: float
    tensors: list[TensorEntry]
    shards: list[ObjectRef]
    kind: Literal["full", "delta"] = "full"
    base_version: int | None = None  # the full version a delta applies to; None for a full version
    raw_bytes: int = 0  # the bytes of the tensors it reproduces (the shards hold sum(shard.size))


class CommitRequest(Message, tag="checkpoints.commit.v1"):
    """The trainer has uploaded shards; the checkpoint service verifies and announces them."""

    manifest: WeightsManifest


class CommitReply(Message, tag="checkpoints.commit_reply.v1"):
    manifest: ObjectRef


class WeightsAnnounced(Message, tag="weights.announced.v1"):
    run_id: str
    version: int
    step: int
    manifest: ObjectRef


class CheckpointRequest(Message, tag="checkpoints.get.v1"):
    run_id: str
    version: int | None = None  # None: the latest


class CheckpointReply(Message, tag="checkpoints.get_reply.v1"):
    manifest: WeightsManifest


class DeadLetter(Message, tag="deadletter.v1"):
    stream: str
    subject: str
    consumer: str
    reason: str
    deliveries: int
    payload: bytes
    headers: dict[str, str] = msgspec.field(default_factory=dict)
