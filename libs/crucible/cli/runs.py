"""`crucible runs list`, `crucible runs show ID` and `crucible runs cancel ID`: run history from the
REST API, and an operator's end to a run."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from crucible.cli.api import DEFAULT_API, ApiOption, call

runs_app = typer.Typer(help="Query run history over the REST API.", no_args_is_help=True)


@runs_app.command("list")
def list_runs(
    api: ApiOption = DEFAULT_API,
    limit: Annotated[int, typer.Option(min=1, max=500)] = 20,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The newest runs."""
    page = call(api, "GET", "/v1/runs", params={"limit": limit})
    if as_json:
        print(json.dumps(page["items"], indent=2))
        return
    table = Table("run", "name", "status", "created", "finished")
    for run in page["items"]:
        table.add_row(run["run_id"], run["name"], run["status"], run["created_at"], run["finished_at"] or "")
    Console().print(table)


@runs_app.command("show")
def show_run(
    run_id: str, api: ApiOption = DEFAULT_API, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """One run: its config, steps, checkpoints and evaluations."""
    run = call(api, "GET", f"/v1/runs/{run_id}")
    steps = call(api, "GET", f"/v1/runs/{run_id}/steps", params={"limit": 500})["items"]
    checkpoints = call(api, "GET", f"/v1/runs/{run_id}/checkpoints", params={"limit": 500})["items"]
    evals = call(api, "GET", f"/v1/runs/{run_id}/evals", params={"limit": 500})["items"]
    if as_json:
        print(json.dumps({"run": run, "steps": steps, "checkpoints": checkpoints, "evals": evals}, indent=2))
        return
    console = Console()
    console.print(f"[bold]{run['run_id']}[/bold] {run['name']} — {run['status']}")
    console.print(json.dumps(run["config"]))
    table = Table("step", "version", "loss", "reward", "resolved", "staleness", "trajectories")
    for s in steps:
        m = s["metrics"]
        table.add_row(
            str(s["step"]),
            str(s["version"]),
            f"{m.get('loss', 0):.4f}",
            f"{m.get('reward_mean', 0):.3f}",
            f"{m.get('resolved_rate', 0):.3f}",
            f"{m.get('staleness_mean', 0):.2f}",
            str(len(s["trajectory_ids"])),
        )
    console.print(table)
    console.print("checkpoints: " + ", ".join(f"v{c['version']} (step {c['step']})" for c in checkpoints))
    if evals:
        from crucible.cli.evals import rate

        table = Table("evaluation", "version", "tasks", "status", "pass@1", "pass@k", "resolved rate")
        for e in evals:
            table.add_row(e["eval_id"], str(e["version"]), f"{e['taskset']}/{e['split']}", e["status"],
                          rate(e["pass_at_1"]), rate(e["pass_at_k"]), rate(e["resolved_rate"]))  # fmt: skip
        console.print(table)


@runs_app.command("cancel")
def cancel_run(run_id: str, api: ApiOption = DEFAULT_API) -> None:
    """End a run now (it becomes `cancelled`; what it trained stays published)."""
    run = call(api, "POST", f"/v1/runs/{run_id}/cancel")
    Console().print(f"{run_id}: {run['status']}")


def register(app: typer.Typer) -> None:
    app.add_typer(runs_app, name="runs")
