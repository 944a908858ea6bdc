"""Handing a finished episode on: its trajectory on the run's ROLLOUTS subject, held through outages."""

from __future__ import annotations

import asyncio

from crucible.bus import Bus
from crucible.contracts import subjects
from crucible.contracts.keys import trajectory_claim_prefix
from crucible.contracts.messages import Trajectory
from crucible.outage import ride_out


async def publish_trajectory(bus: Bus, trajectory: Trajectory, *, stop: asyncio.Event) -> bool:
    """Publish `trajectory` under its id (by claim check when large). While NATS or S3 is away it is
    tried again with backoff, and a retry the server already took is dropped as a duplicate; returns
    False only if `stop` is set first (the replica is stopping and the trajectory is lost with it)."""
    return await ride_out(
        lambda: bus.publish(
            subjects.rollouts(trajectory.run_id),
            trajectory,
            msg_id=trajectory.trajectory_id,
            claim_prefix=trajectory_claim_prefix(trajectory.run_id, trajectory.trajectory_id),
        ),
        stop=stop,
        what=f"publish {subjects.ROLLOUTS}",
    )
