"""`crucible demo`: start the local stack, run a short training run, show live progress, summarise."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

DEMO_CONFIG = """
[tasks]
taskset = "pybugs"
difficulties = [1, 2]

[model]
source = "tiny"
precision = "bf16"

[agent]
max_turns = 3

[schedule]
group_size = 4
groups_per_step = 2
max_steps = 6
publish_every = 2
max_staleness = 1

[eval]
at_end = true
samples = 2
max_tasks = 4
"""
"""The demo run's config, before --config and --set (a config file replaces it whole)."""


def demo(
    config_file: Annotated[
        Path | None,
        typer.Option("--config", help="Run config (TOML) to use instead of the demo's.", dir_okay=False),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override one field, e.g. --set optim.learning_rate=1e-4 (repeatable)."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="Start from these weights instead of the tiny preset, e.g. package:smollm2-135m-instruct "
            "(actions get a 64-token budget for the model's JSON tool calls; --set changes it)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print only a machine-readable summary.")] = False,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 900.0,
    keep_running: Annotated[
        bool, typer.Option(help="Keep the stack up after the run, until Ctrl-C.")
    ] = False,
) -> None:
    """Start every service locally and train a tiny policy for a few steps."""
    from crucible.cli.stopping import ignore_stop_signals, interruptible
    from crucible.contracts.runconfig import RunConfig
    from crucible.localstack import LocalStack

    console = Console(stderr=as_json, quiet=as_json)
    try:
        text = config_file.read_text() if config_file else DEMO_CONFIG
        model_overrides = [f"model.source={json.dumps(model)}", "agent.max_action_tokens=64"] if model else []
        config = RunConfig.from_toml(text, overrides=[*model_overrides, *(overrides or [])]).model_dump(
            mode="json"
        )
    except (OSError, ValueError) as exc:
        typer.echo(f"crucible demo: bad run config ({config_file or 'the demo config'}): {exc}", err=True)
        raise typer.Exit(2) from None
    started = time.monotonic()
    stack = LocalStack(api_port=0)
    with interruptible():
        try:
            _run(stack, config=config, console=console, started=started, as_json=as_json, timeout=timeout,
                 keep_running=keep_running)  # fmt: skip
        except KeyboardInterrupt:
            console.print("interrupted: stopping the stack")
            raise typer.Exit(130) from None
        finally:
            ignore_stop_signals()
            with console.status("stopping the stack…"):
                stack.stop()


def _run(
    stack, *, config, console: Console, started: float, as_json: bool, timeout: float, keep_running: bool
) -> None:
    """Start the stack, run the demo's run on it, print its summary (the caller stops the stack)."""
    import httpx

    with console.status("starting NATS, S3, Redis, the database and seven services…"):
        stack.start()
    client = httpx.Client(base_url=stack.api_url, headers=stack.api_headers, timeout=30)
    response = client.post("/v1/runs", json={"name": "demo", "config": config})
    if response.status_code != 201:
        console.print(f"[red]could not create the run: {response.status_code} {response.text}[/red]")
        raise typer.Exit(1)
    run_id = response.json()["run_id"]
    console.print(f"run [bold]{run_id}[/bold] created; API at {stack.api_url}")
    console.print(
        f"dashboard: {stack.login_url(f'/runs/{run_id}')}"
        + ("" if keep_running else " (--keep-running keeps it up after the run)")
    )
    console.print(f"admin API key: {stack.api_key_file}")
    progress = _follow(client=client, stack=stack, run_id=run_id, console=console, timeout=timeout)
    summary = _summary(client=client, run_id=run_id, stack=stack, elapsed=time.monotonic() - started)
    summary["progress_ok"] = progress
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(console, summary)
    if keep_running:
        console.print("stack is up; Ctrl-C stops it")
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    if summary["status"] != "finished":
        raise typer.Exit(1)


def _pages(client, path: str, **params) -> list[dict[str, Any]]:
    items, cursor = [], None
    while True:
        query = {"limit": 200, **params, **({"cursor": cursor} if cursor else {})}
        page = client.get(path, params=query).raise_for_status().json()
        items.extend(page["items"])
        cursor = page["next_cursor"]
        if not cursor:
            return items


def _follow(*, client, stack, run_id: str, console: Console, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    with Live(console=console, refresh_per_second=2) as live:
        while time.monotonic() < deadline:
            dead = stack.poll()
            if dead:
                console.print(f"[red]service(s) exited: {dead}[/red]")
                return False
            run = client.get(f"/v1/runs/{run_id}").json()
            steps = _pages(client, f"/v1/runs/{run_id}/steps")
            trajectories = _pages(client, f"/v1/runs/{run_id}/trajectories")
            checkpoints = _pages(client, f"/v1/runs/{run_id}/checkpoints")
            evals = _pages(client, f"/v1/runs/{run_id}/evals")
            live.update(_table(run, steps, trajectories, checkpoints, evals, time.monotonic() - t0))
            if run["status"] == "failed":
                return False
            if run["status"] == "finished" and _evals_done(run, evals):
                return True
            time.sleep(1.0)
    console.print("[red]timed out[/red]")
    return False


def _evals_done(run: dict[str, Any], evals: list[dict[str, Any]]) -> bool:
    """The run's end-of-run evaluation (when it asked for one) has finished or failed."""
    if not run["config"]["eval"]["at_end"]:
        return True
    return bool(evals) and evals[-1]["status"] in ("finished", "failed")


def _table(run, steps, trajectories, checkpoints, evals, elapsed: float) -> Table:
    last = steps[-1]["metrics"] if steps else {}
    table = Table(title=f"run {run['run_id']} — {run['status']}", show_header=False)
    table.add_row("step", f"{len(steps)} / {run['config']['schedule']['max_steps']}")
    table.add_row("weight versions published", str(len(checkpoints)))
    table.add_row("trajectories graded", str(len(trajectories)))
    table.add_row("resolved (last step)", f"{last.get('resolved_rate', 0.0):.3f}")
    table.add_row("reward (last step mean)", f"{last.get('reward_mean', 0.0):.3f}")
    if evals:
        e = evals[-1]
        table.add_row(
            f"evaluation v{e['version']}", f"{e['status']}: {e['graded']} / {e['expected'] or '?'} graded"
        )
    table.add_row("staleness (last step mean)", f"{last.get('staleness_mean', 0.0):.2f}")
    table.add_row("throughput", f"{60 * len(trajectories) / max(elapsed, 1e-6):.1f} trajectories/min")
    return table


def _summary(*, client, run_id: str, stack, elapsed: float) -> dict[str, Any]:
    run = client.get(f"/v1/runs/{run_id}").json()
    steps = _pages(client, f"/v1/runs/{run_id}/steps")
    trajectories = _pages(client, f"/v1/runs/{run_id}/trajectories")
    checkpoints = _pages(client, f"/v1/runs/{run_id}/checkpoints")
    evals = _pages(client, f"/v1/runs/{run_id}/evals")
    versions_used = sorted({v for t in trajectories for v in range(t["version_min"], t["version_max"] + 1)})
    rewards = [s["metrics"].get("reward_mean", 0.0) for s in steps]
    resolved = sum(t["resolved"] for t in trajectories)
    last_eval = evals[-1] if evals else None
    return {
        "run_id": run_id,
        "api_url": stack.api_url,
        "bus_url": stack.settings_env["CRUCIBLE_NATS_URL"],
        "api_key_file": str(stack.api_key_file),
        "bus_nkey_file": stack.settings_env.get("CRUCIBLE_NATS_NKEY_FILE"),
        "dashboard_url": f"{stack.api_url}/runs/{run_id}",
        "status": run["status"],
        "trainer": {  # the worker group the run trained in
            "world_size": run["config"]["parallel"]["world_size"],
            "launcher": run["config"]["parallel"]["launcher"],
        },
        "steps": len(steps),
        "trajectories_graded": len(trajectories),
        "trajectories_trained": sum(1 for t in trajectories if t["trained_count"] > 0),
        "graded_more_than_once": sum(1 for t in trajectories if t["graded_count"] > 1),
        "trained_more_than_once": sum(1 for t in trajectories if t["trained_count"] > 1),
        "tool_calls": sum(t["num_tool_calls"] for t in trajectories),
        "weight_versions_published": [c["version"] for c in checkpoints],
        "weight_versions_full": [c["version"] for c in checkpoints if c["kind"] == "full"],
        "weight_bytes": {
            kind: sum(c["size_bytes"] for c in checkpoints if c["kind"] == kind) for kind in ("full", "delta")
        },
        "weight_versions_used_by_rollouts": versions_used,
        "resolved_rate_trajectories": round(resolved / len(trajectories), 4) if trajectories else None,
        "reward_first_step": rewards[0] if rewards else None,
        "reward_last_step": rewards[-1] if rewards else None,
        "eval": None
        if last_eval is None
        else {
            "eval_id": last_eval["eval_id"],
            "version": last_eval["version"],
            "split": f"{last_eval['taskset']}/{last_eval['split']}",
            "status": last_eval["status"],
            "tasks": last_eval["tasks"],
            "pass_at_1": last_eval["pass_at_1"]["value"],
            "pass_at_k": last_eval["pass_at_k"]["value"],
            "resolved_rate": last_eval["resolved_rate"]["value"],
            "resolved_rate_ci": [last_eval["resolved_rate"]["ci_low"], last_eval["resolved_rate"]["ci_high"]],
        },
        "learning": "a demo run this short does not learn: the reward is SWE-bench's resolved (0 unless the "
        "fix is complete), which a policy with no warm start (the tiny preset, randomly initialised, or "
        "SmolLM2-135M-Instruct as shipped) almost never reaches in a few steps; the warm start + RL "
        "experiment is `python -m benches.bench_learning` (docs/benchmarks.md#learning)",
        "wall_seconds": round(elapsed, 1),
        "trajectories_per_minute": round(60 * len(trajectories) / max(elapsed, 1e-6), 2),
    }


def _print_summary(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title="demo summary", show_header=False)
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), str(value))
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command()(demo)
