"""Trainer service: takes runs from the RUNS stream, one at a time, and trains each to completion."""

from __future__ import annotations

import asyncio

import torch

from crucible.bus import Delivery
from crucible.contracts import subjects
from crucible.contracts.messages import RunCreated
from crucible.runtime import Runtime
from services.trainer.job import RunJob
from services.trainer.metrics import RUNS
from services.trainer.settings import Settings


async def setup(rt: Runtime[Settings]) -> None:
    settings = rt.settings
    torch.set_num_threads(settings.torch_threads)

    async def on_run(created: RunCreated, delivery: Delivery) -> None:
        rt.log.info("training run", run_id=created.run_id, attempt=delivery.attempt)
        delivery.hold()  # acked by the job when the run is finished
        delivery.keep_alive(every_s=settings.heartbeat_s)
        RUNS.inc()
        try:
            await RunJob(rt=rt, created=created).run(delivery)
        finally:
            RUNS.dec()

    rt.spawn(
        rt.bus.consume(
            stream=subjects.RUNS,
            durable=subjects.TRAINER_DURABLE,
            filter_subject=subjects.RUNS_CREATED_ALL,
            handler=on_run,
            message_type=RunCreated,
            stop=rt.stopping,
            ack_wait=settings.ack_wait_s,
            max_deliver=100,  # every restart of a trainer mid-run hands the run back once
        ),
        name="runs",
    )
    await asyncio.sleep(0)
