"""A run's weight versions leaving the trainer: published to the checkpoints service (a full snapshot
every `full_every` versions and first after a restart, else an exact delta), retried while that service
is away, and followed by the evaluation the run's `eval` section schedules at that version."""

from __future__ import annotations

import asyncio

import structlog
import torch

from crucible.bus import Bus
from crucible.clients.checkpoints import WeightsPublisher
from crucible.contracts import subjects
from crucible.contracts.events import EvalReport, Event, EventPayload
from crucible.contracts.messages import EvalRequest, scheduled_eval_id
from crucible.contracts.runconfig import RunConfig
from crucible.objectstore import ObjectStore
from services.trainer.metrics import VERSION

PUBLISH_ATTEMPTS = 5
ADAPTER_FULL_EVERY = 1 << 62
"""A run that trains adapters (model.lora) publishes one full snapshot, then deltas against it: the base
weights never change, so every delta holds the adapters' bits and zstd frames of zeros, a few percent
of the weights however many versions follow."""


class RunPublisher:
    def __init__(
        self, *, bus: Bus, store: ObjectStore, run_id: str, config: RunConfig, full_every: int, source: str
    ) -> None:
        self.bus, self.run_id, self.config, self.source = bus, run_id, config, source
        self.publisher = WeightsPublisher(bus=bus, store=store, run_id=run_id, full_every=full_every)
        self.log = structlog.get_logger("crucible.trainer").bind(run_id=run_id)

    async def publish(self, *, version: int, step: int, weights: dict[str, torch.Tensor]) -> None:
        """Publish `weights` as `version`, then ask for the evaluation due at it (if any)."""
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                manifest = await self.publisher.publish(version=version, step=step, state_dict=weights)
                break
            except Exception as exc:
                if attempt == PUBLISH_ATTEMPTS:
                    raise
                self.log.warning("publishing weights failed; retrying", error=repr(exc))
                await asyncio.sleep(2**attempt)
        else:  # not reached: the last attempt breaks out or raises
            raise AssertionError(f"PUBLISH_ATTEMPTS is {PUBLISH_ATTEMPTS}")
        VERSION.labels(self.run_id).set(version)
        size = sum(s.size for s in manifest.shards)
        self.log.info("published weights", version=version, step=step, kind=manifest.kind, bytes=size)
        every = self.config.eval.every_versions
        if every and version and version % every == 0:
            await self.request_eval(version)

    async def request_eval(self, version: int) -> None:
        """Ask for the evaluation of `version` the run's `eval` section schedules (once: its id is the
        message id, so asking again after a crash is dropped as a duplicate)."""
        eval_id = scheduled_eval_id(self.run_id, version)
        request = EvalRequest.for_run(
            eval_id=eval_id, run_id=self.run_id, version=version, config=self.config, source="schedule"
        )
        await self.bus.publish(subjects.eval_requested(self.run_id), request, msg_id=eval_id)
        await self.event(EvalReport(request=request, status="requested"))
        self.log.info("evaluation requested", version=version, eval_id=eval_id)

    async def event(self, data: EventPayload) -> None:
        """One of the run's events (step reports, warm start, status), de-duplicated by its id."""
        event = Event.now(self.run_id, data, source=self.source)
        await self.bus.publish(event.subject, event, msg_id=event.msg_id)
