"""Quality measures read from diffs alone, by hand."""

from __future__ import annotations

from crucible.contracts import packing
from crucible.contracts.messages import ToolCall, Trajectory
from services.grader.quality import change_measures, lint_paths

REFERENCE = """\
diff --git a/pkg/a.py b/pkg/a.py
--- a/pkg/a.py
+++ b/pkg/a.py
@@ -1,2 +1,2 @@
 def f():
-    return 1
+    return 2
"""
CHANGE = (
    REFERENCE
    + """\
diff --git a/pkg/b.py b/pkg/b.py
--- a/pkg/b.py
+++ b/pkg/b.py
@@ -1,1 +1,2 @@
 x = 1
+y = 2
diff --git a/tests/test_new.py b/tests/test_new.py
new file mode 100644
--- /dev/null
+++ b/tests/test_new.py
@@ -0,0 +1,5 @@
+def test_one():
+    assert True
+
+async def test_two():
+    assert True
"""
)


def trajectory(diff: str) -> Trajectory:
    call = ToolCall(index=0, name="read_file", arguments="{}", ok=True, output="", duration_s=0.1,
                    token_start=0, token_end=1, policy_version=0)  # fmt: skip
    return Trajectory(
        run_id="r", trajectory_id="t", group_id="g", task_id="k", taskset="s",
        tokens=packing.pack("u32", [1, 2, 3, 4]), logprobs=packing.pack("f32", [0.0] * 4),
        versions=packing.pack("u32", [0] * 4), loss_mask=packing.pack("u8", [0, 1, 1, 1]),
        constraints=packing.pack("u8", [0] * 4), tool_calls=[call, call], final_diff=diff,
        started_at=10.0, finished_at=12.5,
    )  # fmt: skip


def test_measures_by_hand():
    m = change_measures(trajectory=trajectory(CHANGE), reference_patch=REFERENCE)
    # 2 + 1 + 5 changed lines against the reference's 2; b.py is outside it; the new module adds two tests.
    assert m == {"diff_size_ratio": 4.0, "files_outside_reference": 1.0, "tests_added": 2.0,
                 "tool_calls": 2.0, "tokens": 3.0, "wall_s": 2.5}  # fmt: skip
    same = change_measures(trajectory=trajectory(REFERENCE), reference_patch=REFERENCE)
    assert (
        same["diff_size_ratio"] == 1.0
        and same["files_outside_reference"] == 0.0
        and same["tests_added"] == 0.0
    )


def test_lint_reads_the_python_files_that_exist_on_each_side():
    before, after = lint_paths(CHANGE)
    assert before == ["pkg/a.py", "pkg/b.py"] and after == ["pkg/a.py", "pkg/b.py", "tests/test_new.py"]
    assert lint_paths("") == ([], [])
