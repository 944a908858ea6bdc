"""`crucible tasks` refuses bad names before it reaches for the stack."""

from __future__ import annotations

from cli_runner import crucible


def test_bad_taskset_names_and_splits_are_refused(tmp_path):
    instances = tmp_path / "i.jsonl"
    instances.write_text("{}\n")
    bad_name = crucible("tasks", "import", str(instances), "--repos", str(tmp_path), "--taskset", "no spaces")
    assert bad_name.returncode == 2 and "letters, digits" in bad_name.stderr
    bad_split = crucible("tasks", "import", str(instances), "--repos", str(tmp_path), "--split", "dev")
    assert bad_split.returncode == 2 and "unknown split 'dev'" in bad_split.stderr
    missing = crucible("tasks", "import", str(tmp_path / "nope.jsonl"), "--repos", str(tmp_path))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
