from __future__ import annotations

from datetime import UTC, datetime

import pytest

from crucible.db.models import Run, Step
from services.api.pagination import InvalidCursor, decode_cursor, encode_cursor


def test_cursor_round_trips_typed_values() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    cursor = encode_cursor([when, "run-1"])
    assert "=" not in cursor
    assert decode_cursor(cursor, [Run.created_at, Run.run_id]) == [when, "run-1"]
    assert decode_cursor(encode_cursor([7]), [Step.step]) == [7]


@pytest.mark.parametrize(
    "cursor",
    [
        "not base64 !",
        "e30",
        encode_cursor(["x", "y", "z"]),
        encode_cursor(["yesterday", "r"]),
        encode_cursor([1, 2]),
    ],
)
def test_foreign_cursors_are_refused(cursor: str) -> None:
    with pytest.raises(InvalidCursor, match="invalid cursor"):
        decode_cursor(cursor, [Run.created_at, Run.run_id])


def test_a_cursor_from_another_listing_is_refused() -> None:
    with pytest.raises(InvalidCursor):
        decode_cursor(encode_cursor(["2026-01-01T00:00:00+00:00", "r"]), [Step.step])
    with pytest.raises(InvalidCursor):
        decode_cursor(encode_cursor([True]), [Step.step])
