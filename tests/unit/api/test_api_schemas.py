from __future__ import annotations

import msgspec
import pytest
from pydantic import ValidationError

from crucible.contracts.messages import RunConfig
from services.api.schemas import RunConfigBody, RunCreate


def test_rest_run_config_mirrors_the_contract() -> None:
    """Same fields and defaults, so every valid body converts to a RunConfig and back unchanged."""
    body = RunConfigBody()
    assert body.model_dump() == msgspec.to_builtins(RunConfig())
    assert RunConfig(**body.model_dump()) == RunConfig()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"group_size": 0}, "greater than or equal to 1"),
        ({"precision": "fp4"}, "'bf16' or 'mxfp8'"),
        ({"model_preset": "huge"}, "unknown model preset 'huge'; known: tiny"),
        ({"learning_rate": -1}, "greater than 0"),
        ({"difficulties": []}, "at least 1 item"),
        ({"taskset": "a b"}, "should match pattern"),
        ({"bogus": 1}, "Extra inputs are not permitted"),
    ],
)
def test_bad_configs_are_refused_with_a_clear_message(config: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RunCreate.model_validate({"name": "n", "config": config})


def test_blank_names_are_refused() -> None:
    with pytest.raises(ValidationError, match="at least 1 character"):
        RunCreate.model_validate({"name": "   "})
