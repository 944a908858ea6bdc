"""Quality measures read from diffs alone, by hand, and the repetition script on a real folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from crucible.contracts import packing
from crucible.contracts.messages import ToolCall, Trajectory
from services.grader.quality import REPETITION, change_measures, lint_paths

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


HELPERS = """def total_price(items, tax):
    subtotal = sum(item.price * item.count for item in items)
    return round(subtotal * (1 + tax), 2)
"""


def repeated(tmp_path: Path, files: dict[str, str], added: dict[str, list[int]]) -> dict[str, int]:
    """The repetition script's counts, run as the grader runs it (python -I, the workspace as cwd)."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    argv = [sys.executable, "-I", "-c", REPETITION, json.dumps(added)]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(proc.stdout)


def test_a_helper_reimplemented_under_other_names_repeats_and_a_call_to_it_does_not(tmp_path):
    copied = (
        "from shop.prices import total_price\n\n\n"
        "def invoice_total(lines, vat):\n"
        "    net = sum(line.price * line.count for line in lines)\n"
        "    return round(net * (1 + vat), 2)\n"
        "\n\n"
        "def invoice(lines, vat):\n"
        "    return {'total': invoice_total(lines, vat)}\n"
    )
    files = {"shop/prices.py": HELPERS, "shop/invoice.py": copied}
    # Lines 4-6 and 9-10 added: the helper's three-line shape repeats, under other names, in 4-6.
    added = {"shop/invoice.py": [4, 5, 6, 9, 10]}
    assert repeated(tmp_path, files, added) == {"added": 5, "repeated": 3}
    called = (
        "from shop.prices import total_price\n\n\n"
        "def invoice(lines, vat):\n"
        "    return {'total': total_price(lines, vat)}\n"
    )
    assert repeated(tmp_path, {"shop/invoice.py": called}, {"shop/invoice.py": [4, 5]}) == {
        "added": 2, "repeated": 0,
    }  # fmt: skip
    # The helper itself, added by the change, repeats nothing: no window without an added line matches.
    (tmp_path / "shop/invoice.py").unlink()
    assert repeated(tmp_path, {}, {"shop/prices.py": [1, 2, 3]}) == {"added": 3, "repeated": 0}


def test_the_script_skips_what_it_cannot_read_and_never_imports_the_code(tmp_path):
    files = {"broken.py": "def f(:\n", "loud.py": "raise SystemExit('imported')\n"}
    (tmp_path / "latin1.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8
    assert repeated(tmp_path, files, {"broken.py": [1], "loud.py": [1]}) == {"added": 1, "repeated": 0}
