"""A run on the RUNS stream: its config, read by every service that works on it, and its end.

`run_config` reads the config the run was created with (its `RunCreated`, published once by the api).
`end_run` is the one way the three services that may end a run do it (the trainer when the run is
done or cannot go on, the rollouts when they cannot run it, the api when an operator cancels it).

The end is a `RunFinished` on the RUNS stream under one message id per run, so the first end published
is the run's end and any later one is dropped as a duplicate; the rollouts stop admitting work on it
and the trainer stops training. The service whose end stands also says so on the run's events, where
the api records the status and its reason.
"""

from __future__ import annotations

import time

from crucible.bus import Bus
from crucible.contracts import subjects
from crucible.contracts.events import Event, RunStatus, RunStatusName
from crucible.contracts.messages import RunCreated, RunFinished
from crucible.contracts.runconfig import RunConfig


async def run_config(bus: Bus, run_id: str) -> RunConfig | None:
    """The config the run was created with, or None if there is no such run."""
    created = await bus.latest(subjects.RUNS, subjects.run_created(run_id), RunCreated)
    return None if created is None else created.config


async def run_end(bus: Bus, run_id: str) -> RunFinished | None:
    """The run's end, or None while it runs."""
    return await bus.latest(subjects.RUNS, subjects.run_finished(run_id), RunFinished)


async def end_run(
    bus: Bus, *, run_id: str, status: RunStatusName, step: int, version: int, error: str = "", source: str
) -> RunFinished:
    """End the run as `status` unless it has ended already; returns the end that stands."""
    end = RunFinished(
        run_id=run_id, status=status, step=step, version=version, finished_at=time.time(), error=error
    )
    await bus.publish(subjects.run_finished(run_id), end, msg_id=f"{run_id}/finished")
    stands = await run_end(bus, run_id) or end
    if stands.status == status:
        event = Event.now(run_id, RunStatus(status=status, error=error or None), source=source)
        await bus.publish(event.subject, event, msg_id=event.msg_id)
    return stands
