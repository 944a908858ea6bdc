"""The import rules of the layout: libs/crucible is a library no service is needed to import, services
never import each other, and only the services that run the model need torch."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "app.py").is_file())
NEEDS_TORCH = {"rollout", "trainer"}
TORCHLESS = Path(__file__).resolve().parents[1] / "torchless.py"


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_the_library_never_imports_a_service() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            m for m in imported_modules(path) if m.split(".")[0] == "services"
        )
        for path in (ROOT / "libs").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_never_imports_another(service: str) -> None:
    offenders = {}
    for path in (ROOT / "services" / service).rglob("*.py"):
        others = sorted(
            m for m in imported_modules(path) if m.startswith("services.") and m.split(".")[1] != service
        )
        if others:
            offenders[str(path.relative_to(ROOT))] = others
    assert offenders == {}


@pytest.mark.parametrize("service", SERVICES)
def test_only_the_model_services_need_torch(service: str) -> None:
    probe = (
        f"import sys; sys.path.insert(0, {str(TORCHLESS.parent)!r}); import torchless; torchless.block(); "
    )
    probe += f"import services.{service}.app"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    if service in NEEDS_TORCH:
        assert done.returncode != 0 and "No module named 'torch'" in done.stderr
    else:
        assert done.returncode == 0, done.stderr


def test_the_extras_say_which_services_need_torch() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def closure(name: str) -> set[str]:
        found = set()
        for requirement in extras[name]:
            if requirement.startswith("crucible["):
                for inner in requirement.removeprefix("crucible[").split("]")[0].split(","):
                    found |= closure(inner)
            else:
                found.add(requirement.split("=")[0].split(">")[0].split("<")[0].split("[")[0])
        return found

    for service in SERVICES:
        assert ("torch" in closure(service)) == (service in NEEDS_TORCH), service
