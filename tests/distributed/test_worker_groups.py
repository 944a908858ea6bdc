"""The same training step through both launchers: local gloo processes and a Ray placement group."""

from __future__ import annotations

import parallel_cases as cases
import pytest
import torch.distributed as dist

from crucible.parallel.launch import run_local, run_ray

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 waits here until it is stopped
    return dist.get_rank()


def test_run_local_raises_the_failing_ranks_traceback() -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 failed(.|\n)*ValueError: rank one refuses"):
        run_local(fail_on_rank_one, world_size=2, timeout_s=60, backend="gloo")


def test_ray_worker_group_trains_like_a_single_process() -> None:
    """Three steps with 2-way expert parallelism and FSDP in a local Ray cluster (one CPU bundle per rank)."""
    steps = 3
    per_rank = run_ray(cases.train_steps, world_size=2, args=((1, 2, 2), steps), use_gpu=False)
    reference = cases.reference_losses(2, steps)
    assert per_rank[0] == per_rank[1]
    assert per_rank[0] == pytest.approx(reference, rel=1e-6)
    assert reference[-1] < reference[0]
