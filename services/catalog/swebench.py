"""Import SWE-bench-format instances as a task set, each verified in the sandbox before it is served.

One JSON object per line. Two shapes of instance are read, told apart by whether `test_patch` is there:
- SWE-bench's (SWE-bench, Verified, SWE-Gym, SWE-rebench, nebius' SWE-bench-extra): instance_id, repo,
  base_commit (the buggy tree), problem_statement, patch (the gold fix), test_patch (may be empty: the
  repository's own tests already catch the bug), FAIL_TO_PASS and PASS_TO_PASS.
- SWE-smith's (no test_patch): `patch` is the diff that made the bug, the gold fix is its reverse, and
  the buggy tree is base_commit (the bug's commit) or, where the instance has none, the mirror's branch
  named after the instance, as SWE-smith's own harness checks it out.
FAIL_TO_PASS and PASS_TO_PASS are lists of pytest node ids, or those lists JSON-encoded (SWE-bench's
own encoding). Optional: test_command (`python -m pytest ...`, a list or a string; by default pytest on
the files of the listed tests) and hints_text, which reaches the statement only when the import asks for
it (`hints=True`). Other fields (version, created_at, image_name, install_config, meta, ...) are not
used. Install commands are not run: the sandbox has no network, so the tests run with the sandbox's own
Python environment.

Each repository comes from a local mirror under `--repos`: `owner__name`, `owner/name` or `name`, as a
git directory (bare or with a work tree) or a tarball of one (`.tar`, `.tar.gz`, `.tgz`). The task's
snapshot is the buggy tree; its hidden tests are the files test_patch leaves behind and the files of
the listed tests, laid over the workspace before grading (as SWE-bench's harness applies the test patch),
so a change to them never counts. Splits are by repository (`services.catalog.splits`), unless one split
is asked for.

Every bad instance is reported with its reason and the rest go on: a line that is not an instance, a
missing mirror, a base_commit or branch the mirror lacks, a patch that does not apply, a listed test
that does not exist (it does not run), a test run that hangs (the sandbox's timeout).
"""

from __future__ import annotations

import io
import json
import re
import shlex
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec
from unidiff.patch import PatchSet

from crucible import pytest_report
from services.catalog.generator import TEST_COMMAND
from services.catalog.publish import TaskRecord
from services.catalog.snapshots import tarball
from services.catalog.splits import repository_splits
from services.catalog.verify import TestRunError, apply_patch, write_files

GIT = ("git", "-c", "safe.directory=*", "-c", "core.hooksPath=/dev/null")
TARBALL_SUFFIXES = (".tar.gz", ".tgz", ".tar")


class Instance(msgspec.Struct, kw_only=True):
    instance_id: str
    repo: str
    problem_statement: str
    patch: str
    FAIL_TO_PASS: list[str] | str
    PASS_TO_PASS: list[str] | str | None = None
    base_commit: str | None = None
    test_patch: str | None = None
    """None (no such field): a SWE-smith instance, whose `patch` made the bug."""
    hints_text: str | None = None
    test_command: list[str] | str | None = None


class Rejected(ValueError):
    """This instance cannot become a task; the message says why."""


@dataclass(frozen=True)
class Parsed:
    key: str
    """The instance id, or `line N` for a line that is not an instance."""
    instance: Instance | None
    error: str = ""


def read_instances(text: str) -> list[Parsed]:
    out: list[Parsed] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            instance = msgspec.json.decode(line, type=Instance)
        except msgspec.DecodeError as exc:
            out.append(Parsed(f"line {number}", None, f"line {number} is not a SWE-bench instance: {exc}"))
            continue
        if instance.instance_id in seen:
            out.append(
                Parsed(f"line {number}", None, f"line {number} repeats instance {instance.instance_id}")
            )
            continue
        seen.add(instance.instance_id)
        out.append(Parsed(instance.instance_id, instance))
    return out


def test_ids(value: list[str] | str | None, field: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise Rejected(f"{field} is neither a list nor a JSON-encoded list") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise Rejected(f"{field} is not a list of test ids")
    bad = [t for t in value if not t.split("::", 1)[0].endswith(".py")]
    if bad:
        raise Rejected(f"{field}: {bad[0]!r} is not a pytest node id (path.py::name)")
    return list(value)


def find_mirror(repos: Path, repo: str) -> Path:
    owner, _, name = repo.rpartition("/")
    stems = [f"{owner}__{name}", f"{owner}/{name}", name] if owner else [name]
    for stem in stems:
        for candidate in (repos / stem, repos / f"{stem}.git"):
            if candidate.is_dir():
                return candidate
        for suffix in TARBALL_SUFFIXES:
            if (repos / f"{stem}{suffix}").is_file():
                return repos / f"{stem}{suffix}"
    raise Rejected(f"no mirror of {repo} under the repos folder (looked for {', '.join(stems)})")


def unpack_mirror(tarball_path: Path, into: Path) -> Path:
    """A tarball of a git repository, extracted (data only: no links out, no devices); its git dir."""
    try:
        with tarfile.open(tarball_path) as tar:
            tar.extractall(into, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise Rejected(f"mirror {tarball_path.name} does not unpack: {exc}") from None
    for candidate in [into, *sorted(p for p in into.iterdir() if p.is_dir())]:
        if (candidate / ".git").exists() or (candidate / "HEAD").is_file():
            return candidate
    raise Rejected(f"mirror {tarball_path.name} holds no git repository")


def git(mirror: Path, *args: str, stdin: bytes | None = None) -> bytes:
    proc = subprocess.run(
        [*GIT, "-C", str(mirror), *args], input=stdin, capture_output=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise Rejected(f"git {args[0]} failed: {proc.stderr.decode(errors='replace').strip()[:300]}")
    return proc.stdout


def branch_commit(mirror: Path, branch: str) -> str:
    """The commit of `branch` in the mirror: a local branch, or one of a clone's `origin`."""
    for ref in (f"refs/heads/{branch}", f"refs/remotes/origin/{branch}"):
        try:
            return git(mirror, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").decode().strip()
        except Rejected:
            continue
    raise Rejected(f"no base_commit, and the mirror has no branch {branch!r} (SWE-smith's bug branch)")


def tree_at(mirror: Path, commit: str) -> dict[str, bytes]:
    if not re.fullmatch(r"[0-9a-fA-F]{4,64}", commit):
        raise Rejected(f"base_commit {commit!r} is not a commit hash")
    try:
        git(mirror, "cat-file", "-e", f"{commit}^{{commit}}")
    except Rejected:
        raise Rejected(f"base_commit {commit} does not exist in the mirror") from None
    files = {}
    with tarfile.open(fileobj=io.BytesIO(git(mirror, "archive", "--format=tar", commit))) as tar:
        for member in tar:
            if member.isfile():
                extracted = tar.extractfile(member)
                assert extracted is not None
                files[member.name] = extracted.read()
    return files


def parse_patch(patch: str, field: str) -> PatchSet:
    """The patch's file diffs (none for a blank one)."""
    try:
        files = PatchSet(patch)
    except Exception as exc:  # unidiff raises several types
        raise Rejected(f"{field} does not parse: {exc}") from None
    if patch.strip() and not files:
        raise Rejected(f"{field} holds no file diff")
    return files


def hidden_files(snapshot: dict[str, bytes], test_patch: str, tests: list[str]) -> dict[str, bytes]:
    """The files the test patch leaves behind after applying it to the snapshot (an empty one leaves
    the snapshot as it is), and the files of the listed tests as they then stand."""
    files = parse_patch(test_patch, "test_patch")
    if any(f.is_removed_file for f in files):
        raise Rejected("test_patch deletes files; hidden tests can only add or change files")
    paths = [f.path for f in files] + sorted({t.split("::", 1)[0] for t in tests})
    with tempfile.TemporaryDirectory(prefix="crucible-import-") as tmp:
        root = Path(tmp) / "repo"
        write_files(root=root, files=snapshot)
        if files:
            try:
                apply_patch(repo=root, patch=test_patch, what="test_patch")
            except TestRunError as exc:
                raise Rejected(str(exc)) from None
        return {path: (root / path).read_bytes() for path in paths if (root / path).is_file()}


def reverse(tree: dict[str, bytes], patch: str) -> str:
    """The diff that undoes `patch` on `tree`, where it is applied: a SWE-smith instance's gold fix."""
    paths = {
        name.removeprefix("a/").removeprefix("b/")
        for f in parse_patch(patch, "patch")
        for name in (f.source_file, f.target_file)
        if name != "/dev/null"
    }
    with tempfile.TemporaryDirectory(prefix="crucible-import-") as tmp:
        root = Path(tmp) / "repo"
        root.mkdir()
        write_files(root=root, files={path: tree[path] for path in paths if path in tree})
        git(root, "init", "-q")
        git(root, "add", "-A")
        try:
            apply_patch(repo=root, patch=patch, what="patch", reverse=True)
        except TestRunError as exc:
            raise Rejected(f"{exc} in reverse: it did not make this tree") from None
        git(root, "add", "-A", "--intent-to-add")
        fix = git(root, "diff", "--no-color", "--no-ext-diff", "--src-prefix=a/", "--dst-prefix=b/")
    if not fix.strip():
        raise Rejected("patch changes nothing")
    return fix.decode()


def difficulty_of(patch: str) -> int:
    lines = sum(f.added + f.removed for f in PatchSet(patch))
    return 1 if lines <= 5 else 2 if lines <= 20 else 3


def task_id_of(taskset: str, instance_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{taskset}-{instance_id}")[:200]


def candidate(
    instance: Instance, *, taskset: str, split: str, mirror: Path, hints: bool = False
) -> TaskRecord:
    """A TaskRecord for the instance, not yet verified (Rejected says why it cannot be one)."""
    if not instance.problem_statement.strip():
        raise Rejected("problem_statement is empty")
    if not instance.patch.strip():
        raise Rejected("patch is empty")
    fail_to_pass = test_ids(instance.FAIL_TO_PASS, "FAIL_TO_PASS")
    pass_to_pass = test_ids(instance.PASS_TO_PASS, "PASS_TO_PASS")
    if not fail_to_pass:
        raise Rejected("FAIL_TO_PASS is empty")
    command = instance.test_command
    if command is None:
        files = sorted({t.split("::", 1)[0] for t in fail_to_pass + pass_to_pass})
        command = [*TEST_COMMAND, *files]
    elif isinstance(command, str):
        command = shlex.split(command)
    try:
        pytest_report.split_command(command)
    except ValueError as exc:
        raise Rejected(str(exc)) from None
    if instance.test_patch is None:  # SWE-smith: the tree holds the bug, `patch` made it
        snapshot = tree_at(mirror, instance.base_commit or branch_commit(mirror, instance.instance_id))
        source, fix, test_patch = "swesmith", reverse(snapshot, instance.patch), ""
    elif instance.base_commit is None:
        raise Rejected("base_commit is missing")
    else:
        snapshot = tree_at(mirror, instance.base_commit)
        source, fix, test_patch = "swebench", instance.patch, instance.test_patch
    hidden = hidden_files(snapshot, test_patch, fail_to_pass + pass_to_pass)
    statement = instance.problem_statement
    if hints and (instance.hints_text or "").strip():
        statement = f"{statement.rstrip()}\n\nHints:\n{instance.hints_text}"
    return TaskRecord(
        task_id=task_id_of(taskset, instance.instance_id),
        taskset=taskset,
        split=split,
        source=source,
        repo=instance.repo,
        difficulty=difficulty_of(fix),
        family=instance.repo.rpartition("/")[2][:100],
        statement=statement,
        snapshot=tarball(snapshot),
        hidden=tarball(hidden),
        test_command=tuple(command),
        reference_patch=fix,
        fail_to_pass=tuple(fail_to_pass),
        pass_to_pass=tuple(pass_to_pass),
    )


def candidates(
    text: str, *, repos: Path, taskset: str, split: str | None, scratch: Path, hints: bool = False
) -> tuple[list[TaskRecord], dict[str, str], dict[str, str]]:
    """Every instance of a JSONL text as a candidate, or the reason it is not one (by instance id), and
    each candidate's instance id (by task id)."""
    parsed = read_instances(text)
    rejected = {p.key: p.error for p in parsed if p.instance is None}
    instances = [p.instance for p in parsed if p.instance is not None]
    splits = repository_splits(taskset=taskset, repos=[i.repo for i in instances])
    mirrors: dict[str, Path] = {}
    out = []
    labels = {}
    for instance in instances:
        try:
            if instance.repo not in mirrors:
                mirror = find_mirror(repos, instance.repo)
                if mirror.is_file():
                    mirror = unpack_mirror(mirror, scratch / f"mirror-{len(mirrors)}")
                mirrors[instance.repo] = mirror
            record = candidate(
                instance,
                taskset=taskset,
                split=split or splits[instance.repo],
                mirror=mirrors[instance.repo],
                hints=hints,
            )
        except Rejected as exc:
            rejected[instance.instance_id] = str(exc)
            continue
        out.append(record)
        labels[record.task_id] = instance.instance_id
    return out, rejected, labels
