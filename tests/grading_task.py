"""A task from the real catalog, and a trajectory that proposes a diff for it, for grader tests."""

from __future__ import annotations

import uuid

from crucible.bus import Bus
from crucible.contracts import endpoints, packing
from crucible.contracts.messages import (
    SampleRequest,
    TaskReply,
    TaskRequest,
    ToolCall,
    Trajectory,
)


def tool_call(index: int, *, ok: bool) -> ToolCall:
    return ToolCall(
        index=index, name="read_file", arguments="{}", ok=ok, output="", duration_s=0.1,
        token_start=0, token_end=1, policy_version=0,
    )  # fmt: skip


def trajectory(*, run_id: str, task: TaskReply, diff: str, tool_calls: list[ToolCall] = ()) -> Trajectory:
    return Trajectory(
        run_id=run_id,
        trajectory_id=uuid.uuid4().hex,
        group_id="g0",
        task_id=task.task.task_id,
        taskset=task.task.taskset,
        tokens=packing.pack("u32", [1, 2, 3]),
        logprobs=packing.pack("f32", [0.0, -0.5, -0.1]),
        versions=packing.pack("u32", [0, 0, 0]),
        loss_mask=packing.pack("u8", [0, 1, 1]),
        constraints=packing.pack("u8", [0, 0, 0]),
        tool_calls=list(tool_calls),
        final_diff=diff,
    )


async def a_task(bus: Bus, run_id: str) -> TaskReply:
    """A pybugs task with its secret, as the grader gets it."""
    sample = SampleRequest(run_id=run_id, taskset="pybugs", count=1)
    sampled = await bus.request(endpoints.CATALOG_SAMPLE, sample)
    request = TaskRequest(task_id=sampled.tasks[0].task_id)
    return await bus.request(endpoints.CATALOG_SECRET, request)
