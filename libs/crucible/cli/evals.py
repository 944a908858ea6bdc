"""`crucible eval --run RUN`: evaluate a published weight version on a held-out split over the REST API
and print pass@1, pass@k, the resolved rate (with 95% intervals) and the quality measures."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from crucible.cli.api import DEFAULT_API, ApiOption, call

DONE = ("finished", "failed")


def rate(r: dict[str, Any]) -> str:
    if r["value"] is None:
        return "-"
    return f"{r['value']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] (n={r['n']})"


def print_eval(console: Console, e: dict[str, Any]) -> None:
    table = Table(title=f"evaluation {e['eval_id']} — {e['status']}", show_header=False)
    table.add_row("run / version", f"{e['run_id']} v{e['version']}")
    table.add_row("tasks", f"{e['taskset']} / {e['split']}: {e['tasks'] if e['tasks'] is not None else '?'}")
    table.add_row("episodes graded", f"{e['graded']} / {e['expected'] if e['expected'] is not None else '?'}")
    table.add_row("pass@1 (greedy)", rate(e["pass_at_1"]))
    table.add_row(f"pass@{e['samples']}", rate(e["pass_at_k"]))
    table.add_row("resolved rate", rate(e["resolved_rate"]))
    for name, value in e["quality"].items():
        table.add_row(name.replace("_", " "), f"{value:.3f}")
    if e["error"]:
        table.add_row("error", e["error"])
    console.print(table)


def evaluate(
    run: Annotated[str, typer.Option("--run", help="The run whose weights to evaluate.")],
    version: Annotated[
        int | None, typer.Option(help="Weight version; default: the latest published.")
    ] = None,
    taskset: Annotated[
        str | None, typer.Option(help="Default: the run's eval.taskset or tasks.taskset.")
    ] = None,
    split: Annotated[
        str | None, typer.Option(help="validation or test (default: the run's eval.split).")
    ] = None,
    samples: Annotated[int | None, typer.Option(help="Sampled episodes per task, for pass@k.")] = None,
    max_tasks: Annotated[int | None, typer.Option(help="Tasks evaluated at most.")] = None,
    wait: Annotated[bool, typer.Option(help="Wait for the evaluation to finish.")] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 1800.0,
    api: ApiOption = DEFAULT_API,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Evaluate a checkpoint on held-out tasks: greedy pass@1, pass@k, resolved rate and quality."""
    body = {"run_id": run, "version": version, "taskset": taskset, "split": split, "samples": samples,
            "max_tasks": max_tasks}  # fmt: skip
    created = call(api, "POST", "/v1/evals", body={k: v for k, v in body.items() if v is not None})
    result = created
    deadline = time.monotonic() + timeout
    console = Console(stderr=as_json, quiet=as_json)
    with console.status(f"evaluating {run} v{created['version']} ({created['eval_id']})…"):
        while wait and result["status"] not in DONE and time.monotonic() < deadline:
            time.sleep(2.0)
            result = call(api, "GET", f"/v1/evals/{created['eval_id']}")
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_eval(Console(), result)
    if result["status"] == "failed" or (wait and result["status"] not in DONE):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("eval")(evaluate)
