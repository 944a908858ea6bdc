from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crucible.db.models import Checkpoint, Evaluation, Run, Step, Trajectory
from services.api.pagination import (
    MAX_ID_CHARS,
    NUMBER_CURSOR,
    NUMBER_CURSOR_CHARS,
    TIME_ID_CURSOR,
    TIME_ID_CURSOR_CHARS,
    InvalidCursor,
    cursor_pattern,
    decode_cursor,
    encode_cursor,
)

BY_TIME = [Run.created_at, Run.run_id]


def test_each_listing_has_the_pattern_its_route_states() -> None:
    evals = [Evaluation.created_at, Evaluation.eval_id]
    trajectories = [Trajectory.created_at, Trajectory.trajectory_id]
    for keys in (BY_TIME, evals, trajectories):
        assert cursor_pattern(keys) == TIME_ID_CURSOR
    assert cursor_pattern([Step.step]) == cursor_pattern([Checkpoint.version]) == NUMBER_CURSOR


@pytest.mark.parametrize("run_id", ["run-1", "", "ü" * 3, "\U0001f600" * MAX_ID_CHARS, "a.b/c d"])
def test_cursor_round_trips_typed_values_within_its_pattern(run_id: str) -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    cursor = encode_cursor([when, run_id])
    assert re.fullmatch(TIME_ID_CURSOR, cursor) and len(cursor) <= TIME_ID_CURSOR_CHARS
    assert decode_cursor(cursor, BY_TIME) == [when, run_id]
    before_1970 = datetime(1969, 7, 20, 20, 17, tzinfo=UTC)
    assert decode_cursor(encode_cursor([before_1970, run_id]), BY_TIME) == [before_1970, run_id]
    for step in (0, 7, 2**31 - 1):
        assert decode_cursor(encode_cursor([step]), [Step.step]) == [step]
        assert re.fullmatch(NUMBER_CURSOR, encode_cursor([step]))


@given(st.from_regex(TIME_ID_CURSOR, fullmatch=True))
def test_every_string_of_the_time_pattern_is_a_position(cursor: str) -> None:
    when, run_id = decode_cursor(cursor, BY_TIME)
    assert when.tzinfo is not None and isinstance(run_id, str) and "\x00" not in run_id


@given(st.from_regex(NUMBER_CURSOR, fullmatch=True))
def test_every_string_of_the_number_pattern_is_a_position(cursor: str) -> None:
    assert len(cursor) <= NUMBER_CURSOR_CHARS
    (step,) = decode_cursor(cursor, [Step.step])
    assert -(2**31) <= step < 2**31


def test_positions_beyond_a_column_are_its_ends() -> None:
    assert decode_cursor("-99999999999999999.", BY_TIME)[0] == datetime.min.replace(tzinfo=UTC)
    assert decode_cursor("99999999999999999.", BY_TIME)[0].year == 5138
    assert decode_cursor("9" * 19, [Step.step]) == [2**31 - 1]
    assert decode_cursor("-" + "9" * 19, [Step.step]) == [-(2**31)]
    assert decode_cursor("0.AA", BY_TIME)[1] == ""  # a NUL, which PostgreSQL text cannot hold
    assert decode_cursor("0._w", BY_TIME)[1] == "\ufffd"  # not UTF-8


@pytest.mark.parametrize("cursor", ["", "not a cursor", "e30", "1.2.3", "12.abcde", "x.YQ", "1e3.YQ"])
def test_strings_off_the_pattern_are_refused(cursor: str) -> None:
    with pytest.raises(InvalidCursor, match="invalid cursor"):
        decode_cursor(cursor, BY_TIME)


def test_a_cursor_of_another_listing_is_refused() -> None:
    with pytest.raises(InvalidCursor):
        decode_cursor(encode_cursor([datetime(2026, 1, 1, tzinfo=UTC), "r"]), [Step.step])
    with pytest.raises(InvalidCursor):
        decode_cursor(encode_cursor([7]), BY_TIME)
