"""Small real git repositories and a SWE-bench-format file of instances over them, built locally.

Two repositories, each with a few planted bugs: acme/mathkit (a git directory) and acme/textkit (a
tarball of one). Each instance's gold patch fixes one bug, its test patch adds the test that catches
it (FAIL_TO_PASS), and the repository's existing tests are PASS_TO_PASS. `broken_instances` adds one
instance of each kind of bad input.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

MATHKIT = {
    "mathkit/__init__.py": '"""Small numeric helpers."""\n',
    "mathkit/ops.py": '''"""Arithmetic helpers."""


def clamp(x, low, high):
    """x limited to [low, high]."""
    return max(low, min(x, low))


def mean(values):
    """The arithmetic mean of a non-empty list."""
    return sum(values) / (len(values) + 1)


def sign(x):
    """-1, 0 or 1."""
    if x > 0:
        return 1
    if x < 0:
        return 1
    return 0


def double(x):
    return 2 * x
''',
    "tests/test_ops.py": """from mathkit.ops import double


def test_double():
    assert double(3) == 6


def test_double_negative():
    assert double(-2) == -4
""",
    "pyproject.toml": (
        '[project]\nname = "mathkit"\nversion = "0.1.0"\n\n[tool.pytest.ini_options]\npythonpath = ["."]\n'
    ),
}
MATHKIT_FIXES = {
    "clamp": ("return max(low, min(x, low))", "return max(low, min(x, high))", "assert clamp(5, 0, 3) == 3"),
    "mean": ("(len(values) + 1)", "len(values)", "assert mean([1, 2, 3]) == 2"),
    "sign": ("    if x < 0:\n        return 1", "    if x < 0:\n        return -1", "assert sign(-4) == -1"),
}
TEXTKIT = {
    "textkit/__init__.py": '"""Text helpers."""\n',
    "textkit/words.py": '''"""Word helpers."""


def count_words(text):
    return len(text.split(" "))


def title(text):
    return text.lower()


def shout(text):
    return text.upper() + "!"
''',
    "tests/test_words.py": """from textkit.words import shout


def test_shout():
    assert shout("hi") == "HI!"
""",
    "pyproject.toml": (
        '[project]\nname = "textkit"\nversion = "0.1.0"\n\n[tool.pytest.ini_options]\npythonpath = ["."]\n'
    ),
}
TEXTKIT_FIXES = {
    "count_words": ('len(text.split(" "))', "len(text.split())", 'assert count_words("a  b") == 2'),
    "title": ("text.lower()", "text.title()", 'assert title("ab cd") == "Ab Cd"'),
}


def git(repo: Path, *args: str) -> str:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
        "HOME": str(repo),
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=True
    )
    return proc.stdout


def _repo(root: Path, files: dict[str, str]) -> tuple[Path, str]:
    root.mkdir(parents=True)
    git(root, "init", "-q", "-b", "main")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "base")
    return root, git(root, "rev-parse", "HEAD").strip()


def _diff(repo: Path, edit) -> str:
    edit()
    git(repo, "add", "-A")
    patch = git(repo, "diff", "--cached")
    git(repo, "reset", "-q", "--hard")
    return patch


def _instances(repo: Path, name: str, commit: str, module: str, fixes: dict, p2p: list[str]) -> list[dict]:
    out = []
    for function, (bug, fix, check) in fixes.items():
        path = repo / module

        def fix_it(path=path, bug=bug, fix=fix) -> None:
            path.write_text(path.read_text().replace(bug, fix))

        test_file = f"tests/test_{function}.py"
        package, stem = module.removesuffix(".py").split("/")

        def add_test(test_file=test_file, function=function, check=check, package=package, stem=stem) -> None:
            (repo / test_file).write_text(
                f"from {package}.{stem} import {function}\n\n\ndef test_{function}():\n    {check}\n"
            )

        out.append({
            "instance_id": f"{name.replace('/', '__')}-{function}",
            "repo": name,
            "base_commit": commit,
            "problem_statement": f"`{function}` gives the wrong answer; see the example in the new test.",
            "patch": _diff(repo, fix_it),
            "test_patch": _diff(repo, add_test),
            "FAIL_TO_PASS": json.dumps([f"{test_file}::test_{function}"]),  # as the datasets ship it
            "PASS_TO_PASS": p2p,
        })  # fmt: skip
    return out


def build(root: Path) -> tuple[Path, list[dict]]:
    """Mirrors under root/mirrors and the five good instances over them."""
    mirrors = root / "mirrors"
    math_repo, math_commit = _repo(mirrors / "acme__mathkit", MATHKIT)
    text_repo, text_commit = _repo(root / "work" / "textkit", TEXTKIT)
    instances = _instances(
        math_repo,
        "acme/mathkit",
        math_commit,
        "mathkit/ops.py",
        MATHKIT_FIXES,
        ["tests/test_ops.py::test_double", "tests/test_ops.py::test_double_negative"],
    )
    instances += _instances(text_repo, "acme/textkit", text_commit, "textkit/words.py", TEXTKIT_FIXES,
                            ["tests/test_words.py::test_shout"])  # fmt: skip
    with tarfile.open(mirrors / "textkit.tar.gz", "w:gz") as tar:
        tar.add(text_repo, arcname="textkit")
    return mirrors, instances


def broken_instances(good: list[dict]) -> list[dict]:
    """One instance of each bad input, made from a good one; keyed by what is wrong in its id."""
    base = good[0]
    hang_test = base["test_patch"].replace("assert clamp(5, 0, 3) == 3", '__import__("time").sleep(600)')
    return [
        {**base, "instance_id": "missing-mirror", "repo": "acme/nothere"},
        {**base, "instance_id": "no-such-commit", "base_commit": "0123456789abcdef0123456789abcdef01234567"},
        {**base, "instance_id": "no-such-test", "FAIL_TO_PASS": ["tests/test_clamp.py::test_not_there"]},
        {**base, "instance_id": "hangs", "test_patch": hang_test},
    ]


def jsonl(instances: list[dict], *, malformed: bool = False) -> str:
    lines = [json.dumps(i) for i in instances]
    if malformed:
        lines.insert(1, '{"instance_id": "half", "repo": ')
    return "\n".join(lines) + "\n"


SHAPES = {
    "shapes/__init__.py": '"""Rectangle helpers."""\n',
    "shapes/rect.py": '''"""Rectangles given by width and height."""


def area(w, h):
    return w * h


def perimeter(w, h):
    return 2 * (w + h)


def is_square(w, h):
    return w == h
''',
    "tests/test_rect.py": """from shapes.rect import area, is_square, perimeter


def test_area():
    assert area(2, 3) == 6


def test_perimeter():
    assert perimeter(2, 3) == 10


def test_is_square():
    assert is_square(2, 2) and not is_square(2, 3)
""",
    "pyproject.toml": (
        '[project]\nname = "shapes"\nversion = "0.1.0"\n\n[tool.pytest.ini_options]\npythonpath = ["."]\n'
    ),
}
SHAPES_BUGS = {"area": ("w * h", "w + h"), "perimeter": ("2 * (w + h)", "2 * w + h")}
SHAPES_TESTS = [f"tests/test_rect.py::test_{name}" for name in ("area", "perimeter", "is_square")]


def build_smith(root: Path) -> tuple[Path, list[dict], dict[str, tuple[str, str]]]:
    """A SWE-smith-style set, as SWE-smith's harness leaves one: a bare mirror named
    `owner__name.<commit>` whose branch `<instance id>` holds each bug in a commit of its own, and
    instances with no test_patch whose `patch` makes the bug and whose FAIL_TO_PASS are the
    repository's own tests. The area bug's instance names no base_commit (SWE-smith's published
    dataset has none: the branch is the tree), the perimeter bug's names its bug commit. Returns the
    mirrors folder, the instances, and each bug's commit and fix (a diff from it to the clean tree)."""
    work, clean = _repo(root / "work" / "shapes", SHAPES)
    repo = f"swesmith/acme__shapes.{clean[:8]}"
    instances, bugs = [], {}
    for name, (good, bad) in SHAPES_BUGS.items():
        instance_id = f"acme__shapes.{clean[:8]}.func_pm_{name}"
        git(work, "checkout", "-q", "-b", instance_id, "main")
        path = work / "shapes/rect.py"
        path.write_text(path.read_text().replace(good, bad))
        git(work, "commit", "-q", "-am", "Bug Patch")
        commit = git(work, "rev-parse", "HEAD").strip()
        instance = {
            "instance_id": instance_id,
            "repo": repo,
            "patch": git(work, "diff", "main", commit),
            "FAIL_TO_PASS": [f"tests/test_rect.py::test_{name}"],
            "PASS_TO_PASS": [t for t in SHAPES_TESTS if not t.endswith(f"::test_{name}")],
            "created_at": "2026-01-01T00:00:00",
            "image_name": f"swesmith.x86_64.acme__shapes.{clean[:8]}",
            "problem_statement": f"`{name}` of a 2 x 3 rectangle is wrong.",
        }
        if name == "perimeter":
            instance["base_commit"] = commit
        instances.append(instance)
        bugs[name] = (commit, git(work, "diff", commit, "main"))
        git(work, "checkout", "-q", "main")
    mirrors = root / "mirrors"
    mirrors.mkdir(exist_ok=True)
    subprocess.run(
        ["git", "clone", "-q", "--bare", str(work), str(mirrors / f"acme__shapes.{clean[:8]}")],
        capture_output=True, check=True,
    )  # fmt: skip
    return mirrors, instances, bugs


def dataset_variants(smith: list[dict], bugs: dict[str, tuple[str, str]]) -> list[dict]:
    """The area bug again as SWE-bench-shaped instances over the same mirror, in the other datasets'
    spellings: the bug commit as base_commit, the fix as patch and an empty test_patch (the repository's
    own test catches it), with lists JSON-encoded (SWE-bench's own encoding) or plain (SWE-Gym,
    SWE-rebench) and their extra fields, and a hints_text that must not reach the policy by default."""
    area = smith[0]
    commit, fix = bugs["area"]
    common = {
        "repo": area["repo"],
        "base_commit": commit,
        "patch": fix,
        "test_patch": "",
        "problem_statement": area["problem_statement"],
        "hints_text": "HINT: look at the operator in area().",
        "created_at": "2026-01-01T00:00:00Z",
        "version": "0.1",
        "environment_setup_commit": commit,
    }
    return [
        {**common, "instance_id": "swebench-encoded", "FAIL_TO_PASS": json.dumps(area["FAIL_TO_PASS"]),
         "PASS_TO_PASS": json.dumps(area["PASS_TO_PASS"])},
        {**common, "instance_id": "swerebench-lists", "FAIL_TO_PASS": area["FAIL_TO_PASS"],
         "PASS_TO_PASS": area["PASS_TO_PASS"], "meta": {"has_test_patch": False, "is_lite": False},
         "install_config": {"install": "pip install -e .", "test_cmd": "pytest -rA"}},
    ]  # fmt: skip
