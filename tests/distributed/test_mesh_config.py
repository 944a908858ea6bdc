"""Mesh shapes are validated before any process group is touched."""

from __future__ import annotations

import pytest

from crucible.parallel.mesh import ParallelConfig, build_mesh


def test_expert_groups_borrow_from_data_parallel_ranks() -> None:
    inside = ParallelConfig(replicate=2, shard=4, expert=2)
    assert (inside.world_size, inside.expert_replicate, inside.expert_shard) == (8, 2, 2)
    across = ParallelConfig(replicate=4, shard=2, expert=4)
    assert (across.expert_replicate, across.expert_shard) == (2, 1)
    whole = ParallelConfig(replicate=2, shard=2, expert=4)
    assert (whole.expert_replicate, whole.expert_shard) == (1, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicate": 0}, "replicate must be a positive int"),
        ({"shard": 2.0}, "shard must be a positive int"),
        ({"replicate": 2, "shard": 2, "expert": 3}, "expert=3 must divide the world size"),
    ],
)
def test_invalid_shapes_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        ParallelConfig(2, 2, 2)  # type: ignore[misc]


def test_experts_must_split_evenly() -> None:
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by expert=4"):
        ParallelConfig(shard=4, expert=4).check_experts(6)


def test_build_mesh_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="initialized process group"):
        build_mesh(ParallelConfig())
