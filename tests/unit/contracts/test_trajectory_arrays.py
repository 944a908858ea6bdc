"""The typed view of a trajectory's packed arrays: zero-copy, lengths checked once, one rule per derived
value."""

from __future__ import annotations

import numpy as np
import pytest

from crucible.contracts import ContractError
from crucible.contracts.messages import Trajectory
from crucible.contracts.packing import pack
from crucible.contracts.trajectories import arrays, check_trajectory


def trajectory(
    tokens: list[int], mask: list[int], versions: list[int], *, routes: list[int] | None = None,
    routes_shape: list[int] | None = None,
) -> Trajectory:  # fmt: skip
    return Trajectory(
        run_id="r", trajectory_id="t1", group_id="g", task_id="k", taskset="s",
        tokens=pack("u32", tokens), logprobs=pack("f32", [-0.5 * m for m in mask]),
        versions=pack("u32", versions), loss_mask=pack("u8", mask), constraints=pack("u8", [0] * len(tokens)),
        routes=pack("u8", routes or []), routes_shape=routes_shape or [],
    )  # fmt: skip


def test_the_arrays_are_typed_views_of_the_message_s_own_bytes() -> None:
    t = trajectory([7, 70000, 9], [0, 1, 1], [3, 3, 4], routes=[0, 1, 1, 2, 2, 3], routes_shape=[3, 1, 2])
    a = arrays(t)
    assert a.tokens.tolist() == [7, 70000, 9] and a.tokens.dtype == np.dtype("<u4")
    assert a.logprobs.tolist() == [0.0, -0.5, -0.5] and a.logprobs.dtype == np.dtype("<f4")
    assert a.versions.tolist() == [3, 3, 4] and a.constraints.tolist() == [0, 0, 0]
    assert a.routes is not None and a.routes.shape == (3, 1, 2) and a.routes[2].tolist() == [[2, 3]]
    for column, data in [(a.tokens, t.tokens), (a.logprobs, t.logprobs), (a.versions, t.versions),
                         (a.loss_mask, t.loss_mask), (a.routes, t.routes)]:  # fmt: skip
        assert np.shares_memory(column, np.frombuffer(data, dtype="u1"))
        assert not column.flags.writeable


def test_derived_values_count_only_the_sampled_tokens() -> None:
    a = arrays(trajectory([1, 2, 3, 4, 5], [0, 1, 2, 0, 1], [0, 1, 2, 3, 5]))
    assert a.num_tokens == 5 and a.num_sampled == 3
    assert a.sampled.tolist() == [False, True, True, False, True]
    assert a.sampled_versions.tolist() == [1, 2, 5] and a.version_span == (1, 5)


def test_a_trajectory_without_sampled_tokens_has_no_versions() -> None:
    a = arrays(trajectory([1, 2], [0, 0], [4, 4]))
    assert a.num_sampled == 0 and a.sampled_versions.tolist() == [] and a.version_span is None


def test_absent_routes_are_none_and_an_empty_trajectory_is_empty() -> None:
    a = arrays(trajectory([], [], []))
    assert a.routes is None and a.num_tokens == 0 and a.version_span is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"versions": pack("u32", [0, 0])},
            "differ in length: 3 tokens, 3 logprobs, 2 versions, 3 loss_mask",
        ),
        ({"loss_mask": pack("u8", [1] * 4)}, "differ in length: .* 4 loss_mask"),
        ({"tokens": b"\x00" * 13}, "13 bytes is not a whole number of u32 values"),
        (
            {"routes": pack("u8", [0] * 6), "routes_shape": [2, 1, 3]},
            r"routes of shape \[2, 1, 3\] \(6 bytes\)",
        ),
        ({"routes": pack("u8", [0] * 5), "routes_shape": [3, 1, 2]}, r"\(5 bytes\) do not fit 3 tokens"),
        ({"routes": pack("u8", [0] * 6)}, r"routes of shape \[\] \(6 bytes\)"),
    ],
)
def test_arrays_that_do_not_agree_are_refused(change: dict, message: str) -> None:
    t = trajectory([1, 2, 3], [0, 1, 1], [0, 0, 0])
    for name, value in change.items():
        setattr(t, name, value)
    with pytest.raises(ContractError, match=f"trajectory t1: .*{message}"):
        arrays(t)
    with pytest.raises(ContractError, match=message):
        check_trajectory(t)
