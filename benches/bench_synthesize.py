"""Task synthesis yield and cost on real projects' source distributions (`make sdists`): for each, the
verified tasks, the mutations screened and rejected, and the wall time per verified task, with the time
of one run of the project's own test suite in the same sandbox as the baseline (the ratio says how many
test-suite runs one verified task costs). Runs `crucible tasks synthesize` against a local stack of the
sandbox service only.

    python -m benches.bench_synthesize --max-tasks 10 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

SDISTS = Path(__file__).resolve().parents[1] / ".crucible" / "sdists"
PROJECTS = {"toolz": "toolz/tests", "more_itertools": "tests"}


def crucible(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from crucible.cli.main import app; app()", *args],
        capture_output=True, text=True, env=env, check=False, timeout=3600,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tasks", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import os

    from crucible.localstack import LocalStack

    results = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalStack(services=("sandbox",), state_dir=Path(tmp) / "stack") as stack,
    ):
        env = {**os.environ, **stack.settings_env}
        subprocess.run(
            [sys.executable, "-m", "crucible.db", "upgrade"], env=env, check=True, capture_output=True
        )
        for project, tests in PROJECTS.items():
            [archive] = sorted(SDISTS.glob(f"{project}-*.tar.gz"))[-1:]
            with tarfile.open(archive) as tar:
                tar.extractall(Path(tmp) / project, filter="data")
            [root] = list((Path(tmp) / project).iterdir())
            started = time.monotonic()
            suite = crucible(
                "sandbox",
                "tool",
                "--workspace",
                str(root),
                "run_tests",
                json.dumps({"pytest_args": ["-q", "-p", "no:cacheprovider", tests], "timeout_s": 600}),
                env={**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
            )
            suite_s = time.monotonic() - started
            run = crucible(
                "tasks", "synthesize", str(root), "--max-tasks", str(args.max_tasks), "--json", env=env
            )
            if run.returncode not in (0, 1):
                raise SystemExit(f"synthesize failed on {project}: {run.stderr[-2000:]}")
            report = json.loads(run.stdout)
            results[project] = {
                "version": archive.name.removesuffix(".tar.gz").rsplit("-", 1)[-1],
                "verified": report["verified"],
                "rejected": report["rejected"],
                "seconds": report["seconds"],
                "seconds_per_task": report["seconds_per_task"],
                "suite_seconds": round(suite_s, 2),
                "suite_runs_per_task": round(report["seconds_per_task"] / suite_s, 2) if suite_s else None,
                "splits": report["splits"],
                "suite_ok": json.loads(suite.stdout or "{}").get("ok"),
            }
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for project, r in results.items():
            print(
                f"{project} {r['version']}: {r['verified']} verified, {r['rejected']} rejected, "
                f"{r['seconds_per_task']:.1f}s per task = {r['suite_runs_per_task']}x one suite run "
                f"({r['suite_seconds']}s)"
            )


if __name__ == "__main__":
    main()
