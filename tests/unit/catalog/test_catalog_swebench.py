"""SWE-bench- and SWE-smith-format instances become candidate tasks over real local git mirrors (the
sandbox verification is tested in tests/integration/grader/test_imported_tasks.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import swebench_repos

from services.catalog.snapshots import untar
from services.catalog.swebench import candidates
from services.catalog.verify import apply_patch, write_files


@pytest.fixture(scope="module")
def smith(tmp_path_factory):
    root = tmp_path_factory.mktemp("smith")
    mirrors, instances, bugs = swebench_repos.build_smith(root)
    return root, mirrors, instances, bugs


def imported(smith, instances: list[dict], **options):
    root, mirrors, _, _ = smith
    text = swebench_repos.jsonl(instances)
    records, rejected, labels = candidates(
        text, repos=mirrors, taskset="s", split="train", scratch=root / "scratch", **options
    )
    return {labels[r.task_id]: r for r in records}, rejected


def test_a_swe_smith_instance_is_its_bug_branch_with_the_reversed_patch_as_the_fix(smith, tmp_path):
    _, _, instances, _ = smith
    records, rejected = imported(smith, instances)
    assert rejected == {} and set(records) == {i["instance_id"] for i in instances}
    for instance in instances:
        record = records[instance["instance_id"]]
        assert record.source == "swesmith" and record.split == "train"
        snapshot = untar(record.snapshot)
        name = instance["instance_id"].rpartition("_")[2]
        good, bad = swebench_repos.SHAPES_BUGS[name]
        assert bad in snapshot["shapes/rect.py"] and good not in snapshot["shapes/rect.py"]
        # The fix undoes the bug: applied to the snapshot it gives back the clean file.
        repo = tmp_path / name
        write_files(root=repo, files=snapshot)
        apply_patch(repo=repo, patch=record.reference_patch)
        assert (repo / "shapes/rect.py").read_text() == swebench_repos.SHAPES["shapes/rect.py"]
        # The hidden tests are the repository's own test file, as the snapshot holds it.
        assert untar(record.hidden) == {"tests/test_rect.py": swebench_repos.SHAPES["tests/test_rect.py"]}
        assert record.fail_to_pass == tuple(instance["FAIL_TO_PASS"])
        assert record.test_command[-1] == "tests/test_rect.py"


def test_empty_test_patches_and_every_list_encoding_import_and_hints_stay_out(smith):
    _, _, instances, bugs = smith
    variants = swebench_repos.dataset_variants(instances, bugs)
    records, rejected = imported(smith, variants)
    assert rejected == {} and set(records) == {"swebench-encoded", "swerebench-lists"}
    for record in records.values():
        assert record.source == "swebench" and "HINT" not in record.statement
        assert record.fail_to_pass == ("tests/test_rect.py::test_area",)
        assert len(record.pass_to_pass) == 2
        assert "w + h" in untar(record.snapshot)["shapes/rect.py"]
        assert set(untar(record.hidden)) == {"tests/test_rect.py"}
    hinted, _ = imported(smith, variants[:1], hints=True)
    assert hinted["swebench-encoded"].statement.endswith("Hints:\nHINT: look at the operator in area().")


def test_bad_instances_of_either_shape_keep_a_reason_and_the_rest_go_on(smith):
    _, _, instances, bugs = smith
    area, perimeter = instances
    variant = swebench_repos.dataset_variants(instances, bugs)[0]
    bad = [
        {**area, "instance_id": "no-branch"},
        {**area, "instance_id": "not-this-tree", "base_commit": perimeter["base_commit"]},
        {**perimeter, "instance_id": "bad-patch", "patch": "not a diff\n"},
        {**variant, "instance_id": "no-base-commit", "base_commit": None},
        {**variant, "instance_id": "junk-test-patch", "test_patch": "junk\n"},
        {**variant, "instance_id": "not-node-ids", "FAIL_TO_PASS": json.dumps(["test_area (tests.Rect)"])},
    ]
    records, rejected = imported(smith, [area, *bad])
    assert set(records) == {area["instance_id"]}
    assert "no branch 'no-branch'" in rejected["no-branch"]
    assert "did not make this tree" in rejected["not-this-tree"]
    assert rejected["bad-patch"] == "patch holds no file diff"
    assert rejected["no-base-commit"] == "base_commit is missing"
    assert rejected["junk-test-patch"] == "test_patch holds no file diff"
    assert "is not a pytest node id" in rejected["not-node-ids"]


def test_a_clone_with_the_bug_branches_on_origin_imports_too(smith, tmp_path):
    """A mirror cloned with a work tree keeps SWE-smith's branches as `origin/<instance id>`."""
    _, mirrors, instances, _ = smith
    bare = next(p for p in mirrors.iterdir() if p.name.startswith("acme__shapes."))
    clone = tmp_path / "mirrors" / bare.name
    subprocess.run(["git", "clone", "-q", str(bare), str(clone)], capture_output=True, check=True)
    records, rejected, _ = candidates(
        swebench_repos.jsonl(instances[:1]), repos=clone.parent, taskset="s", split="train",
        scratch=tmp_path / "scratch",
    )  # fmt: skip
    assert rejected == {} and len(records) == 1
    assert Path(clone / ".git").is_dir()
