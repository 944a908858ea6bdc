"""The task generator: deterministic, varied by seed, harder by level, and honest statements."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.catalog.families import FAMILIES
from services.catalog.generator import HIDDEN_TESTS, TEST_COMMAND, generate_task, generate_taskset
from services.catalog.snapshots import tarball
from services.catalog.verify import apply_patch, write_files


@pytest.fixture(scope="module")
def taskset():
    return generate_taskset(seed=7, per_difficulty=len(FAMILIES))


def test_same_inputs_give_identical_tasks_and_archives():
    first = generate_taskset(seed=3, per_difficulty=2)
    second = generate_taskset(seed=3, per_difficulty=2)
    assert first == second
    assert [tarball(t.files) for t in first] == [tarball(t.files) for t in second]


def test_the_seed_changes_names_values_and_code():
    tasks = [generate_task(seed=seed, difficulty=2, index=0) for seed in range(6)]
    assert len({t.task_id for t in tasks}) == 1
    assert len({t.statement for t in tasks}) == 6
    assert len({tuple(sorted(t.files.items())) for t in tasks}) == 6
    assert len({t.bug.function for t in tasks}) > 1


def test_task_ids_and_sets(taskset):
    ids = [t.task_id for t in taskset]
    assert len(ids) == len(set(ids)) == 3 * len(FAMILIES)
    assert all(re.fullmatch(r"pybugs-d[123]-\d{4}", i) for i in ids)
    assert generate_task(seed=7, difficulty=1, index=3, taskset="other").task_id == "other-d1-0003"
    for level in (1, 2, 3):
        assert {t.family for t in taskset if t.difficulty == level} == {f.key for f in FAMILIES}


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="difficulties"):
        generate_taskset(seed=0, per_difficulty=1, difficulties=(4,))
    with pytest.raises(ValueError, match="negative"):
        generate_taskset(seed=0, per_difficulty=-1)


def _modules(task) -> list[str]:
    return [
        p
        for p in task.files
        if p.endswith(".py") and not p.startswith("tests/") and not p.endswith("__init__.py")
    ]


def test_difficulty_adds_modules_and_distance(taskset):
    for task in taskset:
        assert len(_modules(task)) == {1: 1, 2: 2, 3: 4}[task.difficulty], task.task_id
        if task.difficulty == 1:
            assert task.bug.function == task.bug.symptom
        else:
            assert task.bug.function != task.bug.symptom
            symptom_module = next(
                p
                for p in _modules(task)
                if re.search(rf"^def {task.bug.symptom}\(", task.files[p], re.MULTILINE)
            )
            assert symptom_module != task.bug.path


def test_repository_layout(taskset):
    for task in taskset:
        assert {"README.md", "pyproject.toml"} <= task.files.keys()
        visible = [p for p in task.files if p.startswith("tests/test_")]
        assert len(visible) == 1 and visible[0] != HIDDEN_TESTS
        assert list(task.hidden_files) == [HIDDEN_TESTS]
        assert task.hidden_files[HIDDEN_TESTS].count("\ndef test_") >= 2
        assert task.test_command == (*TEST_COMMAND, HIDDEN_TESTS, visible[0])
        assert task.fail_to_pass and all(t.startswith(f"{HIDDEN_TESTS}::test_") for t in task.fail_to_pass)
        assert {t.split("::")[0] for t in task.pass_to_pass} <= {HIDDEN_TESTS, visible[0]}
        assert not set(task.fail_to_pass) & set(task.pass_to_pass)
        for path, text in {**task.files, **task.hidden_files}.items():
            if path.endswith(".py"):
                compile(text, path, "exec")


def test_splits_are_fixed_by_index():
    tasks = generate_taskset(seed=3, per_difficulty=5, difficulties=(1,))
    assert [t.split for t in tasks] == ["train", "test", "train", "validation", "train"]


def test_the_bug_is_in_the_code_and_the_patch_fixes_exactly_it(taskset, tmp_path: Path):
    for task in taskset:
        repo = tmp_path / task.task_id
        write_files(root=repo, files=task.files)
        assert task.bug.buggy_snippet in task.files[task.bug.path]
        assert task.reference_patch.startswith(f"diff --git a/{task.bug.path} b/{task.bug.path}\n")
        assert task.reference_patch.count("diff --git") == 1
        apply_patch(repo=repo, patch=task.reference_patch)
        patched = (repo / task.bug.path).read_text()
        assert task.bug.fixed_snippet in patched and patched != task.files[task.bug.path]


def test_statements_describe_the_symptom_not_the_fix(taskset):
    for task in taskset:
        text = task.statement
        assert task.bug.symptom in text and "```python" in text
        for snippet in (task.bug.fixed_snippet, task.bug.buggy_snippet):
            assert not snippet or snippet not in text, (task.task_id, snippet)
        lowered = text.lower()
        for word in (
            "off-by-one",
            "off by one",
            "operator",
            "swap",
            "mutation",
            "patch",
            task.bug.kind.replace("_", " "),
        ):
            assert word not in lowered, (task.task_id, word)
        if task.difficulty > 1:
            assert not re.search(rf"\b{task.bug.function}\b", text), task.task_id


def test_statements_get_less_specific_with_difficulty(taskset):
    by_level = {level: [t.statement for t in taskset if t.difficulty == level] for level in (1, 2, 3)}
    assert all("The docs of" in s and "I expected" in s for s in by_level[1])
    assert all("The docs of" not in s and "correct result is" in s for s in by_level[2])
    assert all("expected" not in s and "correct result" not in s for s in by_level[3])
