"""Writes that operators ask for over REST."""

from __future__ import annotations

import time
import uuid
from typing import TypeVar

import nats.errors
import structlog
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from crucible.bus import Bus, BusError
from crucible.contracts import endpoints, subjects
from crucible.contracts.endpoints import Endpoint
from crucible.contracts.events import TERMINAL_STATUSES
from crucible.contracts.messages import DescribeRequest, EvalRequest, Message, RunCreated
from crucible.contracts.runconfig import RunConfig
from crucible.contracts.sandbox import LimitsRequest
from crucible.db.models import Checkpoint, Evaluation, Run, Step, utcnow
from crucible.runs import end_run
from services.api.queries import NotFound
from services.api.records.events import add_evaluation
from services.api.schemas import EvalCreate, RunOut

log = structlog.get_logger("crucible.api")
Q = TypeVar("Q", bound=Message)
R = TypeVar("R", bound=Message)


class Unavailable(RuntimeError):
    """A dependency (the bus) is down; the request may be retried."""


class Conflict(RuntimeError):
    """The request contradicts the resource's state (cancelling a run that has ended)."""


class Unservable(ValueError):
    """A run config the catalog or the sandbox cannot serve: a 422 naming the field, like any validation
    error."""

    def __init__(self, loc: tuple[str, ...], msg: str) -> None:
        super().__init__(msg)
        self.loc, self.msg = loc, msg


class ConfigCheck:
    """Asks the services whether they can serve a run config: the catalog for train tasks of a
    difficulty in `tasks.difficulties` (the rollouts sample among all the listed ones) and, when the
    run evaluates, tasks of the evaluation's split; a sandbox replica for forks of `group_size` copies.

    A service that does not answer (a stack still starting, one without it, a bus that is down) checks
    nothing, and is not asked again for `quiet_s`, so that run creation does not wait on it each time:
    the rollouts then fail a run they cannot serve, with the service's own reason."""

    def __init__(self, *, timeout_s: float = 5.0, quiet_s: float = 30.0) -> None:
        self.timeout_s, self.quiet_s = timeout_s, quiet_s
        self.silent_until = {"catalog": 0.0, "sandbox": 0.0}

    async def __call__(self, bus: Bus, config: RunConfig) -> None:
        needs: list[tuple[tuple[str, ...], str, str, list[int] | None]] = [
            (("tasks",), config.tasks.taskset, "train", config.tasks.difficulties)
        ]
        if config.eval.every_versions or config.eval.at_end:
            needs.append((("eval",), config.eval.taskset or config.tasks.taskset, config.eval.split, None))
        for section, taskset, split, difficulties in needs:
            describe = DescribeRequest(taskset=taskset)
            reply = await self._ask(bus, "catalog", endpoints.CATALOG_DESCRIBE, describe)
            if reply is not None:
                _check_reply(section, taskset, split, difficulties, reply.difficulties)
        limits = await self._ask(bus, "sandbox", endpoints.SANDBOX_LIMITS, LimitsRequest())
        if limits is not None and config.schedule.group_size > limits.max_fork:
            raise Unservable(
                ("body", "config", "schedule", "group_size"),
                f"a sandbox replica forks at most {limits.max_fork} copies of a workspace, "
                "one per episode of a group",
            )

    async def _ask(self, bus: Bus, service: str, endpoint: Endpoint[Q, R], request: Q) -> R | None:
        if time.monotonic() < self.silent_until[service]:
            return None
        try:
            return await bus.request(endpoint, request, timeout=self.timeout_s)
        except (BusError, nats.errors.Error) as exc:  # no answer, or an error reply
            self.silent_until[service] = time.monotonic() + self.quiet_s
            log.warning("a service did not answer; run configs go unchecked by it for a while",
                        service=service, error=str(exc))  # fmt: skip
            return None


def _check_reply(
    section: tuple[str, ...],
    taskset: str,
    split: str,
    difficulties: list[int] | None,
    held: dict[str, list[int]],
) -> None:
    if not held:
        raise Unservable(("body", "config", *section, "taskset"), f"the catalog has no task set {taskset!r}")
    if not held.get(split):
        raise Unservable(
            ("body", "config", *section, "split" if section == ("eval",) else "taskset"),
            f"task set {taskset!r} has no {split} tasks (it has {', '.join(sorted(held))})",
        )
    if difficulties and not set(difficulties) & set(held[split]):
        raise Unservable(
            ("body", "config", *section, "difficulties"),
            f"task set {taskset!r} has no {split} tasks of difficulty "
            f"{', '.join(map(str, sorted(difficulties)))}; it has {', '.join(map(str, held[split]))}",
        )


def new_run_id() -> str:
    """Run ids appear in subject names, so they hold only letters, digits, '-' and '_'."""
    return f"run-{uuid.uuid4().hex[:16]}"


async def create_run(
    *, session: AsyncSession, bus: Bus | None, name: str, config: RunConfig, check: ConfigCheck | None = None
) -> RunOut:
    """Record the run, then announce it on `runs.<run_id>.created` (de-duplicated by run id).

    A config the catalog or the sandbox cannot serve is refused first (`Unservable`). The row is committed
    before the announcement, so every event about the run finds it. If the announcement fails the run is
    marked failed with the reason, and the caller gets `Unavailable`.
    """
    if bus is not None and check is not None:
        await check(bus, config)
    now = utcnow()
    run = Run(
        run_id=new_run_id(),
        name=name,
        status="created",
        config=config.model_dump(mode="json"),
        created_at=now,
        updated_at=now,
    )
    session.add(run)
    await session.commit()
    if bus is None:
        log.warning("no bus; run recorded but not announced", run_id=run.run_id)
        return RunOut.model_validate(run)
    announcement = RunCreated(run_id=run.run_id, name=name, config=config, created_at=now.timestamp())
    try:
        await bus.publish(subjects.run_created(run.run_id), announcement, msg_id=run.run_id)
    except Exception as exc:  # nats raises many unrelated types when the server is away
        run.status, run.error, run.finished_at = "failed", f"could not announce the run: {exc!r}", utcnow()
        await session.commit()
        raise Unavailable(
            f"run {run.run_id} recorded but not announced, the bus is unavailable: {exc!r}"
        ) from exc
    log.info("run created", run_id=run.run_id, name=name)
    return RunOut.model_validate(run)


async def cancel_run(*, session: AsyncSession, bus: Bus | None, run_id: str) -> RunOut:
    """Publish the run's durable end as `cancelled` (the rollouts and its trainer stop on it), then
    record it. The end is de-duplicated with the trainer's own: whichever is first is the run's end."""
    run = await session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id!r} not found")
    if run.status in TERMINAL_STATUSES:
        raise Conflict(f"run {run_id} has already ended ({run.status})")
    if bus is None:
        raise Unavailable("no bus: a run cannot be cancelled")
    step = await session.scalar(select(func.max(Step.step)).where(Step.run_id == run_id))
    version = await session.scalar(select(func.max(Checkpoint.version)).where(Checkpoint.run_id == run_id))
    try:
        ended = await end_run(
            bus,
            run_id=run_id,
            status="cancelled",
            step=step or 0,
            version=-1 if version is None else version,
            error="cancelled by an operator",
            source="api",
        )
    except Exception as exc:  # nats raises many unrelated types when the server is away
        raise Unavailable(f"run {run_id} not cancelled, the bus is unavailable: {exc!r}") from exc
    if ended.status != "cancelled":  # the trainer (or the rollouts) ended it first
        raise Conflict(f"run {run_id} has already ended ({ended.status})")
    run.status, run.error, run.finished_at = "cancelled", ended.error, utcnow()
    await session.commit()
    log.info("run cancelled", run_id=run_id)
    return RunOut.model_validate(run)


def new_eval_id(run_id: str) -> str:
    return f"{run_id}-e{uuid.uuid4().hex[:8]}"


async def create_eval(*, session: AsyncSession, bus: Bus | None, body: EvalCreate) -> str:
    """Record an evaluation of a published version, then ask the rollouts for it on EVALS. Returns its id.

    NotFound for a run that does not exist or a version it has not published."""
    run = await session.get(Run, body.run_id)
    if run is None:
        raise NotFound(f"run {body.run_id!r} not found")
    published = select(func.max(Checkpoint.version)).where(Checkpoint.run_id == body.run_id)
    if body.version is not None:
        published = published.where(Checkpoint.version == body.version)
    version = await session.scalar(published)
    if version is None:
        which = f"version {body.version}" if body.version is not None else "any version"
        raise NotFound(f"run {body.run_id!r} has not published {which}")
    if bus is None:
        raise Unavailable("no bus: an evaluation cannot be requested")
    request = EvalRequest.for_run(
        eval_id=new_eval_id(body.run_id),
        run_id=body.run_id,
        version=version,
        config=RunConfig.model_validate(run.config),
        source="api",
        taskset=body.taskset,
        split=body.split,
        samples=body.samples,
        max_tasks=body.max_tasks,
    )
    await add_evaluation(session, request, when_ts=request.requested_at)
    await session.commit()
    try:
        await bus.publish(subjects.eval_requested(body.run_id), request, msg_id=request.eval_id)
    except Exception as exc:  # nats raises many unrelated types when the server is away
        row = await session.get(Evaluation, request.eval_id)
        if row is not None:
            row.status, row.error = "failed", f"could not request the evaluation: {exc!r}"
            await session.commit()
        raise Unavailable(f"evaluation recorded but not requested, the bus is unavailable: {exc!r}") from exc
    log.info("evaluation requested", eval_id=request.eval_id, run_id=body.run_id, version=version)
    return request.eval_id
