"""Catalog service: publish the built-in task set at start, then answer `catalog.sample`, `catalog.list`,
`catalog.describe` and `catalog.get`."""

from __future__ import annotations

from random import Random

from crucible.bus import RequestError
from crucible.contracts import endpoints
from crucible.contracts.messages import (
    DescribeReply,
    DescribeRequest,
    ListRequest,
    SampleReply,
    SampleRequest,
    TaskReply,
    TaskRequest,
)
from crucible.db import make_engine, make_sessionmaker
from crucible.db.migrate import check_schema
from crucible.runtime import Runtime
from services.catalog.index import describe_taskset, get_task, list_tasks, sample_tasks
from services.catalog.metrics import REJECTED, TASKS
from services.catalog.publish import publish_taskset
from services.catalog.settings import Settings
from services.catalog.verify import VerifyResult


async def setup(rt: Runtime[Settings]) -> None:
    settings = rt.settings
    engine = make_engine(settings.database_url)
    rt.on_close(engine.dispose)
    await check_schema(engine)
    sessionmaker = make_sessionmaker(engine)

    def rejected(result: VerifyResult) -> None:
        REJECTED.labels(settings.taskset).inc()
        rt.log.warning("task failed verification; not served", task_id=result.task_id, reason=result.reason)

    report = await publish_taskset(
        name=settings.taskset,
        seed=settings.taskset_seed,
        per_difficulty=settings.tasks_per_difficulty,
        difficulties=tuple(settings.difficulties),
        store=rt.store,
        sessionmaker=sessionmaker,
        workers=settings.verify_workers,
        timeout=settings.verify_timeout_s,
        on_rejected=rejected,
    )
    TASKS.labels(settings.taskset).set(report.reused + report.published)
    rt.log.info(
        "task set ready",
        taskset=report.taskset,
        generated=report.generated,
        reused=report.reused,
        published=report.published,
        removed=report.removed,
        rejected=len(report.rejected),
    )

    async def sample(request: SampleRequest) -> SampleReply:
        if request.count > settings.max_sample:
            raise RequestError(
                "bad_request", f"count {request.count} is over the limit of {settings.max_sample}"
            )
        async with sessionmaker() as session:
            tasks = await sample_tasks(
                session=session,
                taskset=request.taskset,
                count=request.count,
                difficulties=request.difficulties,
                rng=Random(request.seed),
                split=request.split,
                sampling=request.sampling,
                run_id=request.run_id,
            )
        return SampleReply(tasks=tasks)

    async def list_split(request: ListRequest) -> SampleReply:
        if request.limit > settings.max_sample:
            raise RequestError(
                "bad_request", f"limit {request.limit} is over the limit of {settings.max_sample}"
            )
        async with sessionmaker() as session:
            tasks = await list_tasks(
                session=session, taskset=request.taskset, split=request.split, limit=request.limit
            )
        return SampleReply(tasks=tasks)

    async def describe(request: DescribeRequest) -> DescribeReply:
        async with sessionmaker() as session:
            return DescribeReply(
                difficulties=await describe_taskset(session=session, taskset=request.taskset)
            )

    async def get(request: TaskRequest) -> TaskReply:
        async with sessionmaker() as session:
            return await get_task(session=session, task_id=request.task_id, include_secret=False)

    async def get_secret(request: TaskRequest) -> TaskReply:
        async with sessionmaker() as session:
            return await get_task(session=session, task_id=request.task_id, include_secret=True)

    await rt.bus.serve(endpoints.CATALOG_SAMPLE, sample)
    await rt.bus.serve(endpoints.CATALOG_GET, get)
    await rt.bus.serve(endpoints.CATALOG_SECRET, get_secret)
    await rt.bus.serve(endpoints.CATALOG_LIST, list_split)
    await rt.bus.serve(endpoints.CATALOG_DESCRIBE, describe)
