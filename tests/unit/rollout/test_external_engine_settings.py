"""A replica's external-engine settings: a misconfiguration is refused when the replica starts, saying
what is missing, never at its first episode."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from crucible.contracts.runconfig import RunConfig
from services.rollout.external import ExternalEngine
from services.rollout.settings import Settings


def test_an_engine_url_needs_a_weights_dir_and_http() -> None:
    with pytest.raises(ValidationError, match="engine_weights_dir"):
        Settings(engine_url="http://127.0.0.1:30000")
    with pytest.raises(ValidationError, match="http"):
        Settings(engine_url="127.0.0.1:30000", engine_weights_dir="/srv/weights")
    settings = Settings(
        engine_url="http://127.0.0.1:30000", engine_kind="vllm", engine_weights_dir="/srv/weights"
    )
    assert settings.engine_kind == "vllm"
    with pytest.raises(ValidationError, match="engine_kind"):
        Settings(engine_url="http://127.0.0.1:30000", engine_kind="tgi", engine_weights_dir="/srv/weights")


def test_a_preset_has_no_external_engine(tmp_path) -> None:
    with pytest.raises(ValueError, match="byte-level"):
        ExternalEngine(
            config=RunConfig(), url="http://127.0.0.1:9", kind="sglang", weights_dir=tmp_path, max_context=512
        )
