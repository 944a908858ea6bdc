"""Worker groups through both launchers (local gloo processes, a Ray placement group): the same training
step, ranks that keep their state between calls, and a rank that dies breaking the group with its name."""

from __future__ import annotations

import os

import policy_cases as policy
import pytest
import torch
import torch.distributed as dist

from crucible.parallel.launch import WorkerGroupError, run_local, run_ray, start_workers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 waits here until it is stopped
    return dist.get_rank()


def test_run_local_raises_the_failing_ranks_traceback() -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 failed(.|\n)*ValueError: rank one refuses"):
        run_local(fail_on_rank_one, world_size=2, timeout_s=60, backend="gloo")


def test_ray_worker_group_trains_like_one_rank(ray_cluster: None) -> None:
    """Three of the trainer's steps with 2-way expert parallelism and FSDP in a local Ray cluster (one CPU
    bundle per rank) against one local rank."""
    steps = 3
    per_rank = run_ray(policy.losses, world_size=2, args=((1, 2, 2), steps), use_gpu=False)
    reference = run_local(policy.losses, world_size=1, args=((1, 1, 1), steps))[0]
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == pytest.approx(reference, rel=policy.fp32_tolerance(policy.run_config((1, 2, 2))))
    assert len(set(reference)) == steps  # each step starts where the last left off


class Tally:
    """A rank that keeps a running sum across calls, summed over the group in each call."""

    def __init__(self, start: int) -> None:
        self.total = start + dist.get_rank()

    def add(self, n: int) -> int:
        self.total += n
        summed = torch.tensor([self.total])
        dist.all_reduce(summed)
        return int(summed)

    def exit_if(self, rank: int) -> None:
        if dist.get_rank() == rank:
            os._exit(3)
        dist.barrier()  # the others wait here for the rank that is gone


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_ranks_keep_their_state_and_a_rank_that_dies_breaks_the_group(
    launcher: str, request: pytest.FixtureRequest
) -> None:
    if launcher == "ray":
        request.getfixturevalue("ray_cluster")
    group = start_workers(Tally, args=(10,), world_size=2, launcher=launcher, timeout_s=120)
    try:
        assert group.call(Tally.add, 1) == [23, 23]  # (10 + 0 + 1) + (10 + 1 + 1)
        assert group.call_each(Tally.add, [((1,), {}), ((2,), {})]) == [26, 26]
        with pytest.raises(WorkerGroupError, match="rank 1 failed"):
            group.call(Tally.exit_if, 1)
        with pytest.raises(WorkerGroupError, match="stopped"):
            group.call(Tally.add, 1)
    finally:
        group.close()
