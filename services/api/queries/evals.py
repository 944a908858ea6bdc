"""Reads about evaluations: scores computed from their graded episodes when read.

pass@1 is the greedy episode's resolved rate over tasks; pass@k the share of tasks that at least one of
the k sampled episodes resolved (the unbiased estimator with n = k); the resolved rate is over every
episode. Each comes with a 95% Wilson score interval. An evaluation is finished once every episode that
was published has been graded.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.db.models import Evaluation, Trajectory
from services.api.pagination import paginate
from services.api.queries.common import NotFound, require_run
from services.api.schemas import EvalOut, EvalTaskOut, Page, Rate

Z95 = 1.959963984540054


def wilson(successes: int, n: int, *, z: float = Z95) -> Rate:
    if n == 0:
        return Rate(value=None, ci_low=None, ci_high=None, n=0)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return Rate(value=p, ci_low=max(0.0, centre - half), ci_high=min(1.0, centre + half), n=n)


async def get_eval(*, session: AsyncSession, eval_id: str) -> EvalOut:
    row = await session.get(Evaluation, eval_id)
    if row is None:
        raise NotFound(f"evaluation {eval_id!r} not found")
    return await _scored(session, row)


async def list_evals(
    *, session: AsyncSession, run_id: str, limit: int, cursor: str | None = None
) -> Page[EvalOut]:
    """A run's evaluations, oldest first."""
    await require_run(session, run_id)
    stmt = select(Evaluation).where(Evaluation.run_id == run_id)
    rows, next_cursor = await paginate(
        session=session,
        stmt=stmt,
        keys=[Evaluation.created_at, Evaluation.eval_id],
        cursor=cursor,
        limit=limit,
    )
    return Page[EvalOut](items=[await _scored(session, r[0]) for r in rows], next_cursor=next_cursor)


async def _scored(session: AsyncSession, row: Evaluation) -> EvalOut:
    episodes = (
        await session.execute(
            select(Trajectory.task_id, Trajectory.eval_sample, Trajectory.resolved, Trajectory.quality).where(
                Trajectory.eval_id == row.eval_id
            )
        )
    ).all()
    greedy: dict[str, bool] = {}
    sampled: dict[str, list[bool]] = defaultdict(list)
    quality: dict[str, list[float]] = defaultdict(list)
    for task_id, sample, resolved, measures in episodes:
        if sample == 0:
            greedy[task_id] = bool(resolved)
        else:
            sampled[task_id].append(bool(resolved))
        if resolved:
            for name, value in (measures or {}).items():
                quality[name].append(float(value))
    tasks = sorted(set(greedy) | set(sampled))
    every = [r for _, _, r, _ in episodes]
    graded = len(episodes)
    status: Any = row.status
    if row.status == "done":
        status = "finished" if graded >= (row.expected or 0) - row.failed_episodes else "running"
    return EvalOut(
        eval_id=row.eval_id,
        run_id=row.run_id,
        version=row.version,
        taskset=row.taskset,
        split=row.split,
        samples=row.samples,
        max_tasks=row.max_tasks,
        source=row.source,
        status=status,
        error=row.error,
        tasks=row.tasks,
        expected=row.expected,
        graded=graded,
        failed_episodes=row.failed_episodes,
        pass_at_1=wilson(sum(greedy.values()), len(greedy)),
        pass_at_k=wilson(sum(any(s) for s in sampled.values()), len(sampled)),
        resolved_rate=wilson(sum(bool(r) for r in every), len(every)),
        quality={name: sum(values) / len(values) for name, values in sorted(quality.items())},
        per_task=[
            EvalTaskOut(
                task_id=task_id,
                greedy_resolved=greedy.get(task_id),
                samples_resolved=sum(sampled.get(task_id, [])),
                samples_graded=len(sampled.get(task_id, [])),
            )
            for task_id in tasks
        ],
        created_at=row.created_at,
        updated_at=row.updated_at,
    )
