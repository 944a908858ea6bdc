"""Trainer service: takes runs from the RUNS stream and trains each to completion, up to `max_runs` at
once, each in a task of its own; further runs wait in the order they were created (their messages held
and kept alive), so one run that cannot progress never blocks the others."""

from __future__ import annotations

import asyncio

import torch

from crucible.bus import Delivery
from crucible.contracts import subjects
from crucible.contracts.messages import RunCreated
from crucible.outage import ride_out
from crucible.runtime import Runtime
from services.trainer.job import RunJob
from services.trainer.metrics import RUNS
from services.trainer.settings import Settings


async def setup(rt: Runtime[Settings]) -> None:
    settings = rt.settings
    torch.set_num_threads(settings.torch_threads)

    slots = asyncio.Semaphore(settings.max_runs)
    active: set[str] = set()

    async def on_run(created: RunCreated, delivery: Delivery) -> None:
        if created.run_id in active:  # redelivered while this replica trains it: the job settles the run
            rt.log.warning(
                "run redelivered while training it", run_id=created.run_id, attempt=delivery.attempt
            )
            delivery.hold()
            return
        delivery.hold()  # acked by the job when the run is finished
        delivery.keep_alive(every_s=settings.heartbeat_s)
        slot = asyncio.ensure_future(slots.acquire())
        stopping = asyncio.ensure_future(rt.stopping.wait())
        await asyncio.wait({slot, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not slot.done() or slot.cancelled():  # stopping while the run waited: another trainer takes it
            slot.cancel()
            await delivery.nak()
            return
        active.add(created.run_id)
        rt.spawn(train(created, delivery), name=f"run-{created.run_id}")

    async def train(created: RunCreated, delivery: Delivery) -> None:
        rt.log.info("training run", run_id=created.run_id, attempt=delivery.attempt)
        RUNS.inc()
        try:  # an outage starts the run's job again after a backoff, without handing the run back
            done = await ride_out(
                lambda: RunJob(rt=rt, created=created).run(delivery), stop=rt.stopping, what="train run"
            )
            if not done:  # stopping while a dependency was away: another trainer (or this one) resumes it
                delivery.stop_keep_alive()
                await delivery.msg.nak()
        except Exception as exc:  # not an outage (a bug, a refusal): the run is handed back with a backoff
            rt.log.error("training run failed; handing it back", run_id=created.run_id, error=repr(exc))
            delivery.stop_keep_alive()
            try:
                await delivery.msg.nak(delay=min(30.0, 0.5 * 2 ** (delivery.attempt - 1)))
            except Exception as nak_exc:  # the bus is away too: the run comes back after ack_wait
                rt.log.warning("could not hand the run back", run_id=created.run_id, error=repr(nak_exc))
        finally:
            RUNS.dec()
            active.discard(created.run_id)
            slots.release()

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
