"""Wiring of the grader: `concurrency` pull loops sharing one durable consumer of the ROLLOUTS queue."""

from __future__ import annotations

from crucible.bus import Delivery
from crucible.contracts import subjects
from crucible.contracts.messages import Trajectory
from crucible.runtime import Runtime
from services.grader.grading import RunConfigs
from services.grader.settings import Settings
from services.grader.worker import handle_trajectory


async def setup(rt: Runtime[Settings]) -> None:
    settings = rt.settings
    configs = RunConfigs(rt.bus)

    async def on_trajectory(trajectory: Trajectory, delivery: Delivery) -> None:
        await handle_trajectory(
            trajectory=trajectory,
            delivery=delivery,
            bus=rt.bus,
            redis=rt.redis,
            configs=configs,
            settings=settings,
        )

    for index in range(settings.concurrency):
        consume = rt.bus.consume(
            stream=subjects.ROLLOUTS,
            durable=subjects.GRADER_DURABLE,
            filter_subject=subjects.STREAMS[subjects.ROLLOUTS].all_subjects,
            handler=on_trajectory,
            message_type=Trajectory,
            stop=rt.stopping,
            ack_wait=settings.ack_wait_s,
            max_deliver=settings.max_deliver,
        )
        rt.spawn(consume, name=f"grader-consumer-{index}")
    rt.log.info("grading", concurrency=settings.concurrency, test_timeout_s=settings.test_timeout_s)
