from __future__ import annotations

import pytest
from pydantic import ValidationError

from crucible.contracts.runconfig import RunConfig
from services.api.schemas import RunCreate


def test_the_request_body_takes_the_run_config_itself() -> None:
    body = RunCreate.model_validate({"name": "n", "config": {"schedule": {"max_steps": 3}}})
    assert body.config == RunConfig.model_validate({"schedule": {"max_steps": 3}})
    assert RunCreate.model_validate({"name": "n"}).config == RunConfig()


def test_blank_names_are_refused() -> None:
    with pytest.raises(ValidationError, match="at least 1 character"):
        RunCreate.model_validate({"name": "   "})
