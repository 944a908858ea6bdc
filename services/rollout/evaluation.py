"""Evaluations on a rollout replica: one weight version of a run on every task of a held-out split.

Every task starts at once, as the replica's episode slots allow, so the episodes decode in one batch.
Each task gets one sandbox, forked into 1 + k copies: episode 0 decodes greedily (pass@1), episodes
1..k sample at the run's temperature (pass@k). They run through the same engine, sandbox and grader as
training episodes, and are published on the run's ROLLOUTS subject marked with the evaluation's id, so
the grader scores them (with quality measures) and the trainer leaves them alone. Their ids are fixed
by (evaluation, task, sample): an evaluation redelivered after a crash republishes the same ids, which
JetStream and the api drop as duplicates. Progress goes out as `eval` events.
"""

from __future__ import annotations

import asyncio

import msgspec

from crucible.agent.episode import run_episode
from crucible.bus import Delivery
from crucible.clients.checkpoints import load_weights
from crucible.clients.sandbox import SandboxClient
from crucible.contracts import endpoints
from crucible.contracts.events import EvalReport, Event
from crucible.contracts.messages import EvalRequest, ListRequest, TaskSpec
from crucible.contracts.runconfig import RunConfig
from crucible.outage import Unavailable
from crucible.runs import run_config
from crucible.runtime import Runtime
from services.rollout.engine import PolicyEngine
from services.rollout.publish import publish_trajectory
from services.rollout.settings import Settings
from services.rollout.slots import EpisodeSlots, Held

SANDBOX_TTL_S = 600.0
KEEP_ALIVE_S = 10.0


class EvaluationError(RuntimeError):
    """The evaluation cannot run (unknown run, version not published, no such tasks)."""


async def handle_eval_request(
    rt: Runtime[Settings], slots: EpisodeSlots, request: EvalRequest, delivery: Delivery
) -> None:
    async with delivery.keep_alive(every_s=KEEP_ALIVE_S):
        try:
            await run_evaluation(rt, slots, request)
        except EvaluationError as exc:
            rt.log.error("evaluation cannot run", eval_id=request.eval_id, error=str(exc))
            await _report(rt, request, status="failed", error=str(exc))


async def run_evaluation(rt: Runtime[Settings], slots: EpisodeSlots, request: EvalRequest) -> None:
    config = await run_config(rt.bus, request.run_id)
    if config is None:
        raise EvaluationError(f"no run {request.run_id!r}")
    try:
        manifest, state = await load_weights(
            bus=rt.bus, store=rt.store, run_id=request.run_id, version=request.version
        )
    except Unavailable:
        raise  # an outage: the bus holds the request until the checkpoints service and S3 answer
    except Exception as exc:
        raise EvaluationError(f"cannot load version {request.version} of {request.run_id}: {exc}") from exc
    engine = PolicyEngine(
        config=config,
        max_context=rt.settings.max_context,
        max_sequences=rt.settings.max_episodes,
        prefill_chunk=rt.settings.prefill_chunk,
    )
    try:
        await engine.load(state, manifest.version)
        await _evaluate(rt, slots, engine, config, request)
    finally:
        engine.close()


async def _evaluate(
    rt: Runtime[Settings], slots: EpisodeSlots, engine: PolicyEngine, config: RunConfig, request: EvalRequest
) -> None:
    try:
        listed = await rt.bus.request(
            endpoints.CATALOG_LIST,
            ListRequest(taskset=request.taskset, split=request.split, limit=request.max_tasks),
            timeout=30,
        )
    except Unavailable:
        raise  # an outage: the bus holds the request until the catalog answers
    except Exception as exc:
        raise EvaluationError(f"no tasks: {exc}") from exc
    tasks = listed.tasks
    per_task = 1 + request.samples
    await _report(rt, request, status="running", tasks=len(tasks), expected=len(tasks) * per_task)
    rt.log.info("evaluating", eval_id=request.eval_id, version=request.version, tasks=len(tasks))

    async def one_task(index: int, task: TaskSpec) -> int:
        async with slots.held(per_task + 1) as held:  # the task's sandbox and its forks
            return await _evaluate_task(rt, held, engine, config, request, index, task)

    failed = await asyncio.gather(*(one_task(i, task) for i, task in enumerate(tasks)))
    await _report(
        rt,
        request,
        status="done",
        tasks=len(tasks),
        expected=len(tasks) * per_task,
        failed_episodes=sum(failed),
    )
    rt.log.info("evaluation episodes done", eval_id=request.eval_id, failed_episodes=sum(failed))


async def _evaluate_task(
    rt, held: Held, engine, config: RunConfig, request: EvalRequest, index: int, task: TaskSpec
) -> int:
    """Run and publish one task's episodes; returns how many failed (and so will never be graded)."""
    per_task = 1 + request.samples
    client = SandboxClient(rt.bus)
    try:
        prepared = await client.create(
            run_id=request.run_id, task_id=task.task_id, snapshot=task.snapshot, ttl_s=SANDBOX_TTL_S
        )
        async with prepared:
            sessions = await prepared.fork(per_task, ttl_s=SANDBOX_TTL_S)
    except Exception as exc:
        rt.log.error(
            "no sandbox for an evaluated task", eval_id=request.eval_id, task=task.task_id, error=repr(exc)
        )
        return per_task
    held.release(1)  # the forks' parent is closed

    async def episode(sample: int, session) -> bool:
        trajectory_id = f"{request.eval_id}-t{index:04d}-s{sample:02d}"
        try:
            async with session:
                trajectory = await run_episode(
                    engine=engine,
                    config=config,
                    task=task,
                    session=session,
                    run_id=request.run_id,
                    group_id=f"{request.eval_id}-t{index:04d}",
                    seed=config.seed * 7919 + index * 1000 + sample,
                    replica=rt.settings.replica,
                    tool_timeout_s=rt.settings.tool_timeout_s,
                    greedy=sample == 0,
                    trajectory_id=trajectory_id,
                )
            trajectory = msgspec.structs.replace(trajectory, eval_id=request.eval_id, eval_sample=sample)
            return await publish_trajectory(rt.bus, trajectory, stop=rt.stopping)
        except Exception as exc:  # counted as failed: the evaluation completes without it
            rt.log.error(
                "evaluation episode failed",
                eval_id=request.eval_id,
                trajectory=trajectory_id,
                error=repr(exc),
            )
            return False

    results = await asyncio.gather(*(episode(i, s) for i, s in enumerate(sessions)))
    return per_task - sum(results)


async def _report(rt: Runtime[Settings], request: EvalRequest, **fields) -> None:
    event = Event.now(request.run_id, EvalReport(request=request, **fields), source=rt.settings.replica)
    await rt.bus.publish(event.subject, event, msg_id=event.msg_id)
