"""Which diffs touch what a fair solution must leave alone."""

from __future__ import annotations

import pytest

from services.grader.anticheat import BadDiff, is_protected, protected_paths, touched_paths

FIX = """\
diff --git a/pkg/core.py b/pkg/core.py
index 1111111..2222222 100644
--- a/pkg/core.py
+++ b/pkg/core.py
@@ -1,3 +1,3 @@
 def add(a, b):
--- a comment line that looks like a file header
+++ b/tests/test_core.py
     return a + b
"""

RENAME_OUT_OF_TESTS = """\
diff --git a/tests/test_core.py b/pkg/moved.py
similarity index 100%
rename from tests/test_core.py
rename to pkg/moved.py
"""

QUOTED_NEW_CONFTEST = """\
diff --git "a/pkg/caf\\303\\251/conftest.py" "b/pkg/caf\\303\\251/conftest.py"
new file mode 100644
index 0000000..8ba3a16
--- /dev/null
+++ "b/pkg/caf\\303\\251/conftest.py"
@@ -0,0 +1 @@
+import pytest
"""

BINARY = """\
diff --git a/data/blob.bin b/data/blob.bin
index bdc955b..350ed01 100644
GIT binary patch
literal 3
KcmZQzVg>*J3IGNG

literal 2
JcmZQz1ONa700IC2

"""


def test_lines_inside_a_hunk_are_not_file_headers():
    assert touched_paths(FIX) == ["pkg/core.py"]
    assert protected_paths(FIX) == []


def test_both_sides_of_a_rename_count():
    assert touched_paths(RENAME_OUT_OF_TESTS) == ["pkg/moved.py", "tests/test_core.py"]
    assert protected_paths(RENAME_OUT_OF_TESTS) == ["tests/test_core.py"]


def test_quoted_paths_are_decoded():
    assert protected_paths(QUOTED_NEW_CONFTEST) == ["pkg/café/conftest.py"]


def new_file(path: str) -> str:
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\nindex 0000000..8ba3a16\n"
        f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+x = 1\n"
    )


def test_a_new_top_level_module_named_like_the_standard_librarys_is_refused():
    for shadow in ("fractions.py", "json/__init__.py", "unittest.py"):
        assert protected_paths(new_file(shadow)) == [shadow]
    for fine in ("pkg/fractions.py", "fractionsx.py", "pkg/json/__init__.py", "tools.py"):
        assert protected_paths(new_file(fine)) == []
    # A repository's own top-level `types.py`, changed: not the change's doing.
    assert protected_paths(FIX.replace("pkg/core.py", "types.py")) == []


def test_bytecode_is_protected():
    assert is_protected("__pycache__/test_core.cpython-311-pytest-8.3.2.pyc")
    assert is_protected("pkg/core.pyc") and not is_protected("pkg/core.py")


def test_binary_patches_are_read():
    assert touched_paths(BINARY) == ["data/blob.bin"]


def test_empty_diff_touches_nothing_and_garbage_is_refused():
    assert touched_paths("") == []
    with pytest.raises(BadDiff):
        touched_paths("I fixed it, trust me\n")


@pytest.mark.parametrize(
    "path",
    [
        "tests/test_hidden.py",
        "tests/__init__.py",
        "tests",
        "pkg/test/helpers.py",
        "test_core.py",
        "pkg/core_test.py",
        "pkg/conftest.py",
        "conftest.py",
        "pytest.ini",
        "setup.cfg",
        "pyproject.toml",
        "tox.ini",
        "sitecustomize.py",
        "pkg/evil.pth",
    ],
)
def test_protected(path):
    assert is_protected(path)


@pytest.mark.parametrize(
    "path", ["pkg/core.py", "pkg/testing_utils.py", "contest.py", "README.md", "pkg/attest.py"]
)
def test_not_protected(path):
    assert not is_protected(path)
