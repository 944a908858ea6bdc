"""infra/docker/<service>.Dockerfile, checked without a Docker engine: instructions parse, the image is
python:3.11-slim, installs only its service's extra, runs as a non-root user, and starts the service."""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path

import pytest

from crucible.localstack import SERVICES

INSTRUCTIONS = {
    "FROM",
    "RUN",
    "CMD",
    "LABEL",
    "EXPOSE",
    "ENV",
    "ADD",
    "COPY",
    "ENTRYPOINT",
    "VOLUME",
    "USER",
    "WORKDIR",
    "ARG",
    "ONBUILD",
    "STOPSIGNAL",
    "HEALTHCHECK",
    "SHELL",
}


def parse(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line: comments dropped, backslash continuations joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical = (pending + line).strip()
        pending = ""
        keyword, _, args = logical.partition(" ")
        assert keyword.upper() in INSTRUCTIONS, f"{path.name}: unknown instruction {keyword!r}"
        assert args.strip(), f"{path.name}: {keyword} without arguments"
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, f"{path.name}: ends inside a line continuation"
    return instructions


def dockerfile(repo: Path, service: str) -> list[tuple[str, str]]:
    return parse(repo / "infra" / "docker" / f"{service}.Dockerfile")


def test_exactly_one_dockerfile_per_service(repo: Path) -> None:
    found = {p.name.removesuffix(".Dockerfile") for p in (repo / "infra" / "docker").glob("*.Dockerfile")}
    assert found == set(SERVICES)


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_builds_and_runs_its_service(repo: Path, service: str) -> None:
    instructions = dockerfile(repo, service)
    keywords = [k for k, _ in instructions]
    assert keywords[0] == "FROM" and instructions[0][1] == "python:3.11-slim"
    assert keywords.count("FROM") == 1

    cmd = [args for k, args in instructions if k == "CMD"]
    assert len(cmd) == 1 and json.loads(cmd[0]) == ["python", "-m", f"services.{service}"]

    users = [args for k, args in instructions if k == "USER"]
    if service == "sandbox":  # root to mount quota tmpfs and overlays; sandboxed commands drop to a uid
        assert users and users[-1] == "root"
    else:
        assert users and users[-1] not in ("root", "0"), "the service must not run as root"
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k == "RUN"), (
        "USER after installs"
    )

    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installs = [shlex.split(args) for k, args in instructions if k == "RUN" and "pip install" in args]
    targets = [word for cmd in installs for word in cmd if word.startswith(".")]
    assert targets == [f".[{service}]"], f"{service} must install only its own extra, got {targets}"
    assert service in extras


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_copies_files_that_exist(repo: Path, service: str) -> None:
    for keyword, args in dockerfile(repo, service):
        if keyword in ("COPY", "ADD"):
            *sources, _ = shlex.split(args)
            for source in sources:
                assert not source.startswith("--"), f"{service}: unexpected COPY flag {source}"
                assert (repo / source).exists(), (
                    f"{service}: COPY source {source} missing from the repository"
                )


def test_sandbox_image_has_bubblewrap_ripgrep_and_git(repo: Path) -> None:
    runs = " ".join(args for k, args in dockerfile(repo, "sandbox") if k == "RUN")
    assert "apt-get install" in runs
    for package in ("bubblewrap", "ripgrep", "git"):
        assert package in runs.split()


@pytest.mark.parametrize("service", ["trainer", "rollout"])
def test_torch_images_pin_torch_and_choose_the_build_by_argument(repo: Path, service: str) -> None:
    instructions = dockerfile(repo, service)
    args = [a.split("=")[0] for k, a in instructions if k == "ARG"]
    assert "TORCH_INDEX_URL" in args
    torch_runs = [a for k, a in instructions if k == "RUN" and "torch" in a]
    assert torch_runs and all("torch==2.13.0" in run for run in torch_runs)
    assert "$TORCH_INDEX_URL" in torch_runs[0]


def test_api_image_carries_the_migrations(repo: Path) -> None:
    instructions = dockerfile(repo, "api")
    copies = [shlex.split(a) for k, a in instructions if k == "COPY"]
    assert any(c[0] == "migrations" for c in copies)
    env = " ".join(a for k, a in instructions if k == "ENV")
    assert "CRUCIBLE_MIGRATIONS_DIR=/app/migrations" in env
    assert (repo / "migrations" / "env.py").is_file()


def test_parser_rejects_a_broken_dockerfile(tmp_path: Path) -> None:
    broken = tmp_path / "broken.Dockerfile"
    broken.write_text("FROM python:3.11-slim\nRUNN pip install .\n")
    with pytest.raises(AssertionError, match="unknown instruction 'RUNN'"):
        parse(broken)
