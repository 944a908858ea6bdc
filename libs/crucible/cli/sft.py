"""`crucible sft`: a supervised warm start as a run of its own (`schedule.max_steps = 0`), through the
running stack. Demonstrations are the task set's train-split reference solutions and, with `--demos`,
imported chat conversations (validated here, uploaded to the object store with the CRUCIBLE_S3_*
settings). The result is the run's version 0; an RL run starts from it with `--set model.init=RUN@0`."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from crucible.cli.api import DEFAULT_API, ApiOption, call
from crucible.cli.evals import DONE


def _upload(path: Path) -> str:
    """Validate the JSONL of conversations and store it under its content hash; returns the key."""
    import asyncio

    from crucible.agent.solutions import DemonstrationError, imported_episodes
    from crucible.objectstore import ObjectStore
    from crucible.settings import CommonSettings

    data = path.read_bytes()
    try:
        episodes = imported_episodes(data.decode("utf-8"))
    except (UnicodeDecodeError, DemonstrationError) as exc:
        Console(stderr=True).print(f"[red]{path}: {exc}[/red]")
        raise typer.Exit(2) from None
    if not episodes:
        Console(stderr=True).print(f"[red]{path}: no conversations[/red]")
        raise typer.Exit(2)
    key = f"demonstrations/{hashlib.sha256(data).hexdigest()}.jsonl"

    async def put() -> None:
        store = ObjectStore.from_settings(CommonSettings())
        await store.ensure_bucket()
        await store.put_bytes(key, data, content_type="application/x-ndjson")

    asyncio.run(put())
    return key


def sft(
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps.")] = 200,
    taskset: Annotated[
        str, typer.Option(help="Task set whose train split gives reference demonstrations.")
    ] = "pybugs",
    tasks: Annotated[
        int, typer.Option(min=0, help="Train tasks whose reference patches are played (0: none).")
    ] = 64,
    demos: Annotated[
        Path | None,
        typer.Option(help="JSONL of chat conversations with tool calls to train on too.", dir_okay=False),
    ] = None,
    config_file: Annotated[
        Path | None,
        typer.Option("--config", help="Run config (TOML): model, agent budget, sft options.", dir_okay=False),
    ] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Override one field (repeatable).")
    ] = None,
    name: Annotated[str, typer.Option(help="The run's name.")] = "sft",
    wait: Annotated[bool, typer.Option(help="Wait for the warm start to finish.")] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 3600.0,
    api: ApiOption = DEFAULT_API,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Train a supervised warm start and publish it as a weight version RL runs can start from."""
    from crucible.contracts.runconfig import RunConfig

    fixed = [
        f"sft.steps={steps}",
        f"sft.tasks={tasks}",
        "schedule.max_steps=0",
        f"tasks.taskset={json.dumps(taskset)}",
    ]
    if demos is not None:
        fixed.append(f"sft.imported={json.dumps(_upload(demos))}")
    try:
        text = config_file.read_text() if config_file else ""
        config = RunConfig.from_toml(text, overrides=[*fixed, *(overrides or [])]).model_dump(mode="json")
    except (OSError, ValueError) as exc:
        Console(stderr=True).print(f"[red]bad run config: {exc}[/red]")
        raise typer.Exit(2) from None
    run = call(api, "POST", "/v1/runs", body={"name": name, "config": config})
    console = Console(stderr=as_json, quiet=as_json)
    deadline = time.monotonic() + timeout
    with console.status(f"warm start {run['run_id']}: playing demonstrations, then {steps} steps…"):
        while wait and run["status"] not in DONE and time.monotonic() < deadline:
            time.sleep(2.0)
            run = call(api, "GET", f"/v1/runs/{run['run_id']}")
    summary = _summary(run)
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        table = Table(title=f"warm start {run['run_id']} — {run['status']}", show_header=False)
        for key, value in summary.items():
            table.add_row(key.replace("_", " "), str(value))
        console.print(table)
        if run["status"] == "finished":
            console.print(f"start RL from it: --set model.init={summary['init']}")
    if run["status"] == "failed" or (wait and run["status"] not in DONE):
        raise typer.Exit(1)


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    warm = run.get("warm_start") or {}
    losses = warm.get("losses") or []
    return {
        "run_id": run["run_id"],
        "status": run["status"],
        "error": run["error"],
        "init": f"{run['run_id']}@0",
        "demonstrations": warm.get("demonstrations"),
        "skipped": warm.get("skipped"),
        "steps": warm.get("steps"),
        "tokens": warm.get("tokens"),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "seconds": round(warm["seconds"], 1) if warm else None,
    }


def register(app: typer.Typer) -> None:
    app.command()(sft)
