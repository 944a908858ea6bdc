"""The run's books of graded messages, and the one rule they keep: acked means trained and saved.

A graded trajectory's message is held (kept alive, unacknowledged) from its arrival until the state
that trained it is saved, so a trainer that dies at any point loses nothing: what it had not acked
comes back and is trained again, and what the saved state had trained (`trained`) is acked on sight.
A message moves through the books in one direction:

    held (in its group) -> in the step -> unsaved -> acked once saved
                        \\-> acked untrained (a dropped group, a skipped step, a run that ended)

and every message the job holds is in exactly one place, so handing everything back (`let_go`) is one
loop over the books.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from crucible.bus import Delivery
from crucible.contracts.messages import GradedTrajectory


@dataclass
class Group:
    """The graded members of one group that came so far, each with its held message."""

    members: dict[str, tuple[GradedTrajectory, Delivery]] = field(default_factory=dict)
    first_seen: float = field(default_factory=time.monotonic)

    @property
    def graded(self) -> list[GradedTrajectory]:
        return [g for g, _ in self.members.values()]


class Ledger:
    def __init__(self, trained: Iterable[str] = ()) -> None:
        self.trained: set[str] = set(trained)  # in a saved state, or trained since the last save
        self.groups: dict[str, Group] = {}  # held, waiting for a step
        self.in_step: list[Delivery] = []  # the step being taken
        self.unsaved: list[Delivery] = []  # trained since the last saved state

    def hold(self, graded: GradedTrajectory, delivery: Delivery, *, keep_alive_s: float) -> bool:
        """Take a graded trajectory into its group (False: it was trained before, and is acked now)."""
        trajectory = graded.trajectory
        if trajectory.trajectory_id in self.trained:
            return False
        delivery.hold()
        delivery.keep_alive(every_s=keep_alive_s)
        group = self.groups.setdefault(trajectory.group_id, Group())
        replaced = group.members.get(trajectory.trajectory_id)
        if replaced is not None:  # a redelivery replaces the old handle
            replaced[1].stop_keep_alive()
        group.members[trajectory.trajectory_id] = (graded, delivery)
        return True

    def ready(self, *, group_size: int, groups_per_step: int, timeout_s: float) -> list[str]:
        """The oldest groups a step may take: complete, or of at least two members and waiting longer
        than `timeout_s` (their other members were lost in flight)."""
        now = time.monotonic()
        return [
            gid
            for gid, g in sorted(self.groups.items(), key=lambda item: item[1].first_seen)
            if len(g.members) >= group_size or (len(g.members) >= 2 and now - g.first_seen > timeout_s)
        ][:groups_per_step]

    def complete(self, group_size: int) -> list[str]:
        return [gid for gid, g in self.groups.items() if len(g.members) >= group_size]

    def begin_step(self, group_ids: list[str]) -> list[Group]:
        """The groups a step takes: their messages are the step's from now on."""
        groups = [self.groups.pop(gid) for gid in group_ids]
        self.in_step = [d for group in groups for _, d in group.members.values()]
        return groups

    def step_trained(self, trajectory_ids: Iterable[str]) -> None:
        """The step was taken: its messages wait for the next saved state."""
        self.trained.update(trajectory_ids)
        self.unsaved += self.in_step
        self.in_step = []

    async def step_untrained(self) -> None:
        """The step trained nothing (all stale, or skipped): its messages are acked untrained."""
        await _ack(self.in_step)
        self.in_step = []

    async def saved(self) -> None:
        """A state holding everything trained so far is saved: its messages are acked."""
        await _ack(self.unsaved)
        self.unsaved = []

    async def drop(self, group_id: str) -> int:
        """Ack a held group untrained (it carries no signal); returns how many it had."""
        group = self.groups.pop(group_id)
        await _ack(d for _, d in group.members.values())
        return len(group.members)

    async def release(self) -> None:
        """The run ended: the held groups are acked untrained (graded and recorded, never trained)."""
        for gid in list(self.groups):
            await self.drop(gid)

    def held(self) -> list[Delivery]:
        """Every message not yet acked, taken out of the books (to be handed back)."""
        held = [d for group in self.groups.values() for _, d in group.members.values()]
        held += self.in_step + self.unsaved
        self.groups.clear()
        self.in_step, self.unsaved = [], []
        return held


async def _ack(deliveries: Iterable[Delivery]) -> None:
    for delivery in deliveries:
        await delivery.ack()
