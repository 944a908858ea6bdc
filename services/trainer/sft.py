"""A run's supervised warm start (run config `sft`): demonstrations rendered as the run's own episodes,
then `sft.steps` optimizer steps of negative log-likelihood on the policy's tokens.

Reference solutions (crucible.agent.solutions) are played by crucible.agent.demonstrations' Teacher in a real
sandbox on each train-split task's snapshot, through the same agent loop as the rollouts (so the tokens, masks
and constraints have exactly the policy's layout); imported conversations are played against their recorded
tool results. A demonstration that cannot be played within the run's agent budget, or whose edits the sandbox
refuses, is left out and counted by reason; an imported file that cannot be read or parsed raises
DemonstrationError (the run cannot start).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from crucible.agent.demonstrations import Teacher
from crucible.agent.episode import run_episode
from crucible.agent.solutions import (
    DemonstrationError,
    RecordedSession,
    changed_paths,
    imported_episodes,
    reference_actions,
    snapshot_files,
)
from crucible.agent.toolcalls import ToolCallGrammar
from crucible.clients.sandbox import SandboxClient
from crucible.contracts import endpoints
from crucible.contracts.events import WarmStartReport
from crucible.contracts.messages import (
    ListRequest,
    ObjectRef,
    TaskRequest,
    TaskSpec,
    Trajectory,
)
from crucible.contracts.runconfig import RunConfig
from crucible.objectstore import ObjectNotFound
from crucible.runtime import Runtime
from services.trainer.group import PolicyGroup
from services.trainer.settings import Settings

SANDBOX_TTL_S = 600.0
LIST_LIMIT = 1024  # the most tasks catalog.list answers with


@dataclass
class Demonstrations:
    trajectories: list[Trajectory] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    """Why demonstrations were left out, by reason."""


async def render(
    rt: Runtime[Settings],
    *,
    run_id: str,
    config: RunConfig,
    tokenizer: Any,
    tool_calls: ToolCallGrammar | None,
    max_context: int,
) -> Demonstrations:
    out = Demonstrations()

    def teacher(actions) -> Teacher:
        return Teacher(
            actions, agent=config.agent, max_context=max_context, tokenizer=tokenizer, tool_calls=tool_calls
        )

    async def play(index: int, task: TaskSpec, actor: Teacher, session) -> None:
        trajectory = await run_episode(
            engine=actor, config=config, task=task, session=session, run_id=run_id, group_id=f"{run_id}-sft",
            seed=index, replica=rt.settings.replica, tool_timeout_s=rt.settings.tool_timeout_s,
            trajectory_id=f"{run_id}-sft-{index:05d}",
        )  # fmt: skip
        failed = [c.name for c in trajectory.tool_calls if not c.ok and c.name in ("replace", "read_file")]
        if trajectory.finish_reason != "submitted":
            out.skipped[f"ended by {trajectory.finish_reason}"] += 1
        elif failed:
            out.skipped[f"{failed[0]} failed in the sandbox"] += 1
        else:
            out.trajectories.append(trajectory)

    slots = asyncio.Semaphore(rt.settings.demo_concurrency)
    sandboxes = SandboxClient(rt.bus)

    async def reference(index: int, task: TaskSpec) -> None:
        async with slots:
            try:
                reply = await rt.bus.request(
                    endpoints.CATALOG_SECRET, TaskRequest(task_id=task.task_id), timeout=30
                )
                if reply.secret is None:
                    raise DemonstrationError("the catalog sent no reference patch")
                patch = reply.secret.reference_patch
                files = snapshot_files(await rt.store.get_bytes(task.snapshot), changed_paths(patch))
                actor = teacher(reference_actions(patch, files, byte_level=tokenizer is None))
                session = await sandboxes.create(
                    run_id=run_id, task_id=task.task_id, snapshot=task.snapshot, ttl_s=SANDBOX_TTL_S
                )
                async with session:
                    await play(index, task, actor, session)
            except DemonstrationError as exc:
                rt.log.info("demonstration left out", run_id=run_id, task=task.task_id, reason=str(exc))
                out.skipped[_reason(exc)] += 1

    sft = config.sft
    if sft.tasks:
        request = ListRequest(taskset=config.tasks.taskset, split="train", limit=LIST_LIMIT)
        listed = await rt.bus.request(endpoints.CATALOG_LIST, request, timeout=30)
        tasks = [t for t in listed.tasks if t.difficulty in config.tasks.difficulties][: sft.tasks]
        await asyncio.gather(*(reference(i, t) for i, t in enumerate(tasks)))
    if sft.imported:
        try:
            text = (await rt.store.get_bytes(rt.store.uri(sft.imported), verify=False)).decode("utf-8")
        except (ObjectNotFound, UnicodeDecodeError) as exc:
            raise DemonstrationError(f"sft.imported {sft.imported} cannot be read: {exc}") from exc
        for j, episode in enumerate(imported_episodes(text)):
            task = TaskSpec(
                task_id=f"imported-{j:05d}", taskset="imported", difficulty=0, statement=episode.statement,
                snapshot=ObjectRef(uri="", sha256="", size=0),
            )  # fmt: skip
            try:
                await play(100_000 + j, task, teacher(episode.actions), RecordedSession(episode.results))
            except DemonstrationError as exc:
                out.skipped[_reason(exc)] += 1
    out.trajectories.sort(key=lambda t: t.trajectory_id)
    return out


def _reason(exc: DemonstrationError) -> str:
    """The kind of reason (its message up to the particulars), counted across tasks."""
    return str(exc).split(":")[0]


def batches(
    trajectories: list[Trajectory], *, steps: int, batch_size: int, seed: int
) -> list[list[Trajectory]]:
    """`steps` batches drawn without replacement within each epoch, in a seeded order."""
    rng = random.Random(seed)
    order: list[Trajectory] = []
    out = []
    for _ in range(steps):
        batch = []
        while len(batch) < min(batch_size, len(trajectories)):
            if not order:
                order = list(trajectories)
                rng.shuffle(order)
            batch.append(order.pop())
        out.append(batch)
    return out


MAX_REPORTED_LOSSES = 200


async def warm_start(
    rt: Runtime[Settings],
    policy: PolicyGroup,
    *,
    run_id: str,
    config: RunConfig,
    tokenizer: Any,
    tool_calls: ToolCallGrammar | None,
    max_context: int,
) -> WarmStartReport | None:
    """Render the demonstrations and train `sft.steps` steps on them in the run's worker group; None
    when stopping cut it short (nothing is saved yet: a trainer that takes the run back starts again).
    Raises DemonstrationError when no demonstration can be played, NonFiniteStep on a non-finite step."""
    started = time.perf_counter()
    sft = config.sft
    demos = await render(
        rt, run_id=run_id, config=config, tokenizer=tokenizer, tool_calls=tool_calls, max_context=max_context
    )
    if not demos.trajectories:
        left_out = dict(demos.skipped) or "none found"
        raise DemonstrationError(f"sft: no demonstration could be played (left out: {left_out})")
    rt.log.info(
        "warm start", run_id=run_id, demonstrations=len(demos.trajectories), skipped=dict(demos.skipped)
    )
    losses, tokens = [], 0
    for batch in batches(demos.trajectories, steps=sft.steps, batch_size=sft.batch_size, seed=config.seed):
        if rt.stopping.is_set():
            return None
        metrics = await asyncio.to_thread(policy.sft, batch, learning_rate=sft.learning_rate)
        losses.append(metrics["loss"])
        tokens += int(metrics["tokens"])
        rt.log.info(
            "warm start step", run_id=run_id, step=len(losses), of=sft.steps, loss=metrics["loss"],
            seconds=round(time.perf_counter() - started, 1),
        )  # fmt: skip
    await asyncio.to_thread(policy.end_sft)
    every = -(-len(losses) // MAX_REPORTED_LOSSES)
    rt.log.info(
        "warm start trained", run_id=run_id, steps=len(losses), loss_first=losses[0], loss_last=losses[-1]
    )
    return WarmStartReport(
        demonstrations=len(demos.trajectories),
        skipped=dict(demos.skipped),
        steps=len(losses),
        tokens=tokens,
        losses=losses[::every],
        loss_every=every,
        seconds=time.perf_counter() - started,
    )
