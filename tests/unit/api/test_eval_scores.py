"""The evaluation's interval, checked against published values of the Wilson score interval."""

from __future__ import annotations

import pytest

from services.api.queries.evals import wilson


def test_wilson_interval_matches_reference_values():
    # The textbook case: 8 of 10 gives [0.4902, 0.9433]; 0 of 5 gives [0, 0.4345].
    r = wilson(8, 10)
    assert r.value == 0.8 and r.n == 10
    assert r.ci_low == pytest.approx(0.4902, abs=1e-4) and r.ci_high == pytest.approx(0.9433, abs=1e-4)
    zero = wilson(0, 5)
    assert zero.value == 0.0 and zero.ci_low == 0.0 and zero.ci_high == pytest.approx(0.4345, abs=1e-4)
    assert wilson(0, 0).value is None and wilson(0, 0).ci_low is None
