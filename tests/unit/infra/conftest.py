"""The deployment files, loaded once: there is no Docker engine or cluster in the test environment, so
they are checked offline against schemas, the repository and the services' settings classes."""

from __future__ import annotations

import functools
import importlib
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from crucible.localstack import SERVICES

REPO = Path(__file__).resolve().parents[3]
ENV_PREFIX = "CRUCIBLE_"
_VARIABLE = re.compile(
    r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?::?-(?P<default>[^}]*))|(?P<required>:?\?[^}]*))?\}"
)


def _interpolate(value: str) -> str:
    """What compose substitutes: ${X:-default} -> default, ${X} -> "" when unset; ${X:?error} (compose
    refuses to start without X) -> "<X>", as if the operator had set it; $$ -> $."""

    def substitute(m: re.Match[str]) -> str:
        return f"<{m['name']}>" if m["required"] else m["default"] or ""

    return _VARIABLE.sub(substitute, value).replace("$$", "$")


def _settings_from_env(service: str, env: dict[str, Any]) -> Any:
    """Build services.<service>.settings.Settings from the CRUCIBLE_* variables a deployment file passes;
    every such variable must name one of its fields (a typo would be silently ignored at run time)."""
    settings_cls = importlib.import_module(f"services.{service}.settings").Settings
    fields = {
        k[len(ENV_PREFIX) :].lower(): _interpolate(str(v)) for k, v in env.items() if k.startswith(ENV_PREFIX)
    }
    unknown = sorted(f"{ENV_PREFIX}{name.upper()}" for name in set(fields) - set(settings_cls.model_fields))
    assert not unknown, f"{service}: {unknown} are not fields of services.{service}.settings.Settings"
    if "s3_key_file" in fields:  # read when the settings load; the deployment mounts it, here a stand-in
        fields["s3_key_file"] = str(_stand_in_s3_key())
    return settings_cls(**fields)


@functools.cache
def _stand_in_s3_key() -> Path:
    path = Path(tempfile.mkdtemp()) / "s3.key"
    path.write_text("crucible-service\nservice-secret\n")
    return path


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


@pytest.fixture(scope="session")
def settings_from_env() -> Any:
    return _settings_from_env


@pytest.fixture(scope="session")
def interpolate() -> Any:
    return _interpolate


@pytest.fixture(scope="session")
def services() -> tuple[str, ...]:
    return SERVICES
