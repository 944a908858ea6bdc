"""What each grading-integrity layer costs per graded trajectory, on real projects' test suites
(`make sdists`): the hidden-test run under the runtime guard against the same run without it
(`crucible.pytest_report`), and the tamper scan of the changed file (`services.grader.tamper`) and the
diff rules (`services.grader.anticheat`) against the plain run, each as a ratio measured in the same
process, runs interleaved. (Probes are how generated tasks' tests are written, not a step added to
grading, so they have no cost of their own to measure.) The change graded is a
small helper appended to one module of the project, so the guard attributes against real added lines.

    python -m benches.bench_grading_guard --reps 5 --json
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from crucible import pytest_report
from services.grader.anticheat import added_lines, protected_paths
from services.grader.tamper import added_findings

SDISTS = Path(__file__).resolve().parents[1] / ".crucible" / "sdists"
PROJECTS = {
    "toolz": ("toolz/itertoolz.py", "toolz/tests"),
    "more_itertools": ("more_itertools/more.py", "tests"),
}
HELPER = '''

def _pairs_total(values):
    """A helper the graded change adds."""
    total = 0
    for left, right in zip(values, values[1:]):
        total += left * right
    return total
'''


def run(repo: Path, script: Path, tests: str, spec: Path | None) -> float:
    report = repo.parent / "report" / "results.jsonl"
    report.parent.mkdir(exist_ok=True)
    argv = [sys.executable, str(script), "-p", "no:cacheprovider", f"--crucible-report={report}", "-q"]
    argv += [f"--crucible-guard={spec}"] if spec else []
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.perf_counter()
    proc = subprocess.run([*argv, tests], cwd=repo, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    results = pytest_report.read_report(report.read_text()) if report.exists() else []
    if not results or (spec and (report.parent / pytest_report.GUARD_LOG).read_text()):
        raise SystemExit(f"{repo.name}: the run failed or the guard refused: {proc.stdout[-800:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for project, (module, tests) in PROJECTS.items():
        sdist = next(SDISTS.glob(f"{project}-*.tar.gz"), None)
        if sdist is None:
            raise SystemExit(f"no {project} sdist under {SDISTS}: run `make sdists`")
        with tempfile.TemporaryDirectory() as scratch:
            with tarfile.open(sdist) as tar:
                tar.extractall(scratch, filter="data")
            repo = next(Path(scratch).glob(f"{project}-*"))
            before = (repo / module).read_text()
            after = before + HELPER
            (repo / module).write_text(after)
            diff = "".join(
                difflib.unified_diff(
                    before.splitlines(keepends=True),
                    after.splitlines(keepends=True),
                    f"a/{module}",
                    f"b/{module}",
                )
            )
            spec = Path(scratch) / "guard.json"
            spec.write_text(json.dumps({"added": added_lines(diff), "protected": []}))
            script = pytest_report.install(Path(scratch) / "plugins")
            plain, guarded, scans, rules = [], [], [], []
            run(repo, script, tests, None)  # warm the page cache
            for _ in range(args.reps):
                plain.append(run(repo, script, tests, None))
                guarded.append(run(repo, script, tests, spec))
                started = time.perf_counter()
                assert added_findings(before, after) == []
                scans.append(time.perf_counter() - started)
                started = time.perf_counter()
                assert protected_paths(diff) == [] and added_lines(diff)
                rules.append(time.perf_counter() - started)
            base = statistics.median(plain)
            rows.append({
                "project": project,
                "plain_s": round(base, 3),
                "guarded_s": round(statistics.median(guarded), 3),
                "guard_ratio": round(statistics.median(guarded) / base, 3),
                "scan_s": round(statistics.median(scans), 4),
                "scan_ratio": round(statistics.median(scans) / base, 4),
                "diff_rules_s": round(statistics.median(rules), 5),
                "diff_rules_ratio": round(statistics.median(rules) / base, 5),
            })  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
    for row in rows:
        print(
            f"{row['project']}: tests {row['plain_s']} s, under the guard {row['guarded_s']} s "
            f"(x{row['guard_ratio']}); tamper scan {row['scan_s']} s (x{row['scan_ratio']} of the run); "
            f"diff rules {row['diff_rules_s']} s (x{row['diff_rules_ratio']})"
        )


if __name__ == "__main__":
    main()
